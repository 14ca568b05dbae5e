"""CUDA graphs of the fused op, one per input (shape, dtype) bucket.

Small batches are launch-bound: the kernel needs about a microsecond, the
launch sequence (two kernels, allocations, argument marshalling) several.
A captured graph replays the whole sequence with one launch. A shape is
captured after it has been seen ``min_uses`` times, up to ``max_graphs``
graphs (least recently used dropped) and only for inputs up to
``max_input_bytes`` (large batches gain nothing and would pin memory).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from .ops import fused_forward


@dataclass
class GraphEntry:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: torch.Tensor

    def stage(self, x: torch.Tensor) -> None:
        """Copy x (host or device) into the graph's input buffer on the current stream."""
        self.static_in.copy_(x, non_blocking=True)

    def replay(self) -> torch.Tensor:
        """Run the graph; the result buffer is overwritten by the next replay."""
        self.graph.replay()
        return self.static_out


class GraphCache:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, *, max_graphs: int = 32,
                 max_input_bytes: int = 16 * 1024 * 1024, min_uses: int = 2, precision: str = "fp32") -> None:
        self.weight, self.bias, self.precision = weight, bias, precision
        self.device = weight.device
        self.max_graphs, self.max_input_bytes, self.min_uses = max_graphs, max_input_bytes, min_uses
        self._graphs: OrderedDict[tuple, GraphEntry] = OrderedDict()
        self._seen: Counter[tuple] = Counter()
        self._capture_stream = torch.cuda.Stream(self.device)

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return (tuple(x.shape), x.dtype)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph and its buffers (after a device fault; shapes are captured again as they recur)."""
        self._graphs.clear()
        self._seen.clear()

    def lookup(self, x: torch.Tensor) -> GraphEntry | None:
        entry = self._graphs.get(self._key(x))
        if entry is not None:
            self._graphs.move_to_end(self._key(x))
        return entry

    def note(self, x_dev: torch.Tensor) -> None:
        """Record an eager run of x_dev; capture its bucket once it has been seen often enough."""
        key = self._key(x_dev)
        if key in self._graphs or x_dev.numel() * x_dev.element_size() > self.max_input_bytes:
            return
        self._seen[key] += 1
        if self._seen[key] >= self.min_uses:
            self._graphs[key] = self.capture(x_dev)
            del self._seen[key]
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)

    def capture(self, example: torch.Tensor) -> GraphEntry:
        static_in = torch.empty(example.shape, dtype=example.dtype, device=self.device)
        static_in.copy_(example)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside capture, as graph capture requires
            fused_forward(static_in, self.weight, self.bias, self.precision)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the runner's other threads (collecting finished work, other GPUs) keep using CUDA while
        # this one captures; only this thread's calls are checked for capture safety.
        # An explicit capture stream on this cache's device: torch's default capture stream belongs to whichever
        # device was current when it was first made, and a capture must begin and end on one device's stream.
        with torch.cuda.graph(graph, stream=self._capture_stream, capture_error_mode="thread_local"):
            static_out = fused_forward(static_in, self.weight, self.bias, self.precision)
        return GraphEntry(graph, static_in, static_out)
