"""The GPU data path: pinned staging, a copy stream and a compute stream, so batches overlap.

For each execution (at most max_batch samples):

    request bytes --(1: host copy, also merges a batch)--> pinned staging slot
                  --(2: DMA, copy stream)--> device input buffer of the slot
                  --(kernel, compute stream, after the copy's event)--> (N, Cout) on the device
                  --(3: DMA of N x Cout floats, compute stream)--> pinned output of the slot

``submit`` does the host copy and enqueues the rest without waiting; ``wait`` blocks on the execution's
last event and returns its output, or, on an event loop, a CompletionWatcher is woken when the execution
has finished and ``finish`` returns it. With ``depth`` slots, the host copy and DMA of batch i+1 run while
batch i computes and batch i-1's output comes back. Copy 1 is the only one of the input on the host:
the request's bytes are viewed, not copied, up to here (``np.frombuffer`` over protobuf's bytes; where
protobuf materialises ``raw_input_contents`` as a Python bytes object, that is protobuf's own copy at
parse time). Where the batcher used to concatenate a batch, the staging copy now does it.

Inputs already in page-locked memory (a front end's arena, which the engine of --frontends registers; a pinned
buffer) skip copy 1 when every request of the batch is: the DMAs read them in place. Inputs in ranges registered
DMA-only (a client's shared-memory segment, page-locked where it lies: server/protocol/shm.py) are never read on
the host at all: in a batch with other inputs, those are staged and the DMA gathers both.

Every time in the returned ExecutionTimes comes from CUDA events, except the host copy's.

With the fused op (``native``: its kernels.cuda.Launcher), an execution is enqueued by one call into the kernel
library (fused.cu: voxserve_execute), which does every step above without a Python call per step, and replays
CUDA graphs of the library's own, one per (bucket, sample shape, datatype) and slot, captured over the slot's
input buffer. The torch calls remain for a model the fused kernel does not compute.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, cast

import numpy as np
import torch

from voxserve.kernels import cuda as fused_cuda
from voxserve.kernels.graphs import GraphCache
from voxserve.kernels.ops import TORCH_DTYPES

from .devicemem import DeviceArray

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]

# Small batches run as captured CUDA graphs, one per (bucket, sample shape): a batch of N samples is padded
# with zero samples up to the next bucket, so the dynamic batcher's varying sizes reuse a handful of graphs
# instead of capturing (a device-wide synchronisation and a garbage collection each) one per size.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# Host copies from this size on use torch's multi-threaded copy; smaller ones a single memcpy.
PARALLEL_COPY_BYTES = 4 * 1024 * 1024

# The native path counts the runs of graph-sized shapes not yet captured up to this many shapes (then afresh).
MAX_SEEN_SHAPES = 4096


# Page-locked host ranges, (start, end) sorted by start, replaced whole on a change (readers on other threads see
# one version or the other); _DMA_ONLY: those of them the CPU must never read (clients' segments, which the client
# may truncate: a CPU read would fault; the DMA reads the pages locked at registration).
_LOCKED: tuple[tuple[int, int], ...] = ()
_DMA_ONLY: tuple[tuple[int, int], ...] = ()
_locked_lock = threading.Lock()


def register_page_locked(address: int, nbytes: int, dma_only: bool = False) -> None:
    """Note that [address, address + nbytes) is page-locked (registered with cudaHostRegister) until
    ``unregister_page_locked``, so submit need not ask CUDA for each source in it; ``dma_only``: the range is
    only ever DMA'd, never copied on the host (a batch mixing it with other sources stages those only)."""
    global _LOCKED, _DMA_ONLY
    with _locked_lock:
        _LOCKED = tuple(sorted((*_LOCKED, (address, address + nbytes))))
        if dma_only:
            _DMA_ONLY = tuple(sorted((*_DMA_ONLY, (address, address + nbytes))))


def unregister_page_locked(address: int, nbytes: int) -> None:
    """Forget a range noted by register_page_locked (before it is unlocked: no batch may take it as locked after)."""
    global _LOCKED, _DMA_ONLY
    span = (address, address + nbytes)
    with _locked_lock:
        _LOCKED = tuple(s for s in _LOCKED if s != span)
        _DMA_ONLY = tuple(s for s in _DMA_ONLY if s != span)


def _within(ranges: tuple[tuple[int, int], ...], address: int, nbytes: int) -> bool:
    i = bisect.bisect_right(ranges, (address, float("inf"))) - 1
    return i >= 0 and ranges[i][1] >= address + nbytes


def _registered(address: int, nbytes: int) -> bool:
    return _within(_LOCKED, address, nbytes)


def touches_dma_only(address: int, nbytes: int) -> bool:
    """Whether any byte of [address, address + nbytes) lies in a DMA-only range. The ranges are mappings of their
    own, which never overlap: the last one starting before the span's end is the only one that can reach into it."""
    ranges = _DMA_ONLY
    i = bisect.bisect_left(ranges, (address + nbytes,)) - 1
    return i >= 0 and ranges[i][1] > address


def _check_host_readable(a: np.ndarray) -> None:
    """Refuse to read ``a`` on the host if it reaches into a DMA-only range: the copy could fault (the client may
    have truncated its segment) and take the process down. The views server/protocol/shm.py hands out never get
    here (they lie whole in their range, contiguous, and go in place): this is the guard that keeps it so."""
    low, high = byte_bounds(a)
    if touches_dma_only(low, high - low):
        raise RuntimeError("an input in a client's segment (DMA-only) would be copied on the host: refused")


def _overlaps(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    return a < b + b_bytes and b < a + a_bytes


def pinned_buffer(nbytes: int) -> memoryview:
    """Page-locked host memory (torch's caching host allocator) as a writable buffer."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy().data


def graph_bucket(samples: int, sample_bytes: int, max_input_bytes: int) -> int:
    """The padded batch size for ``samples`` (itself when no bucket applies)."""
    for bucket in GRAPH_BUCKETS:
        if bucket >= samples:
            return bucket if bucket * sample_bytes <= max_input_bytes else samples
    return samples


def _round_up(n: int) -> int:
    return 1 << max(20, (n - 1).bit_length())  # powers of two from 1 MiB: few re-allocations


class _Slot:
    """Pinned host input, device input, pinned host output and the timing events of one execution in flight.

    The events are made once per slot (a slot is reused only after its execution's last event completed)
    instead of five new CUDA events per execution: in a py-spy profile of two runners on two GPUs, event
    creation + record were ~17 % of the submit threads' samples."""

    def __init__(self, device: torch.device, native: fused_cuda.Launcher | None = None) -> None:
        self.device = device
        self.host = torch.empty(0, dtype=torch.uint8)
        self.dev = torch.empty(0, dtype=torch.uint8, device=device)
        self.out = torch.empty(0, dtype=torch.float32)
        self.native = native
        if native is None:
            with torch.cuda.device(device):
                self.events: tuple = tuple(torch.cuda.Event(enable_timing=True) for _ in range(5))
            return
        # The native path: the library's own events, an Execution filled once, graphs over this slot's input.
        self.native_events = fused_cuda.create_events(device.index or 0)
        self.events = tuple(fused_cuda.Event(h) for h in self.native_events)
        self.execution = fused_cuda.Execution()
        native.fill(self.execution)
        self.execution.events[:] = list(self.native_events)
        # key -> (graph, out, workspace), least recently used first
        self.graphs: collections.OrderedDict[tuple, tuple[int, torch.Tensor, torch.Tensor]] = collections.OrderedDict()
        self.direct_out = torch.empty(0, dtype=torch.float32, device=device)
        self.workspace = torch.empty(0, dtype=torch.float32, device=device)

    def reserve(self, nbytes: int, out_floats: int, staging: bool = True) -> None:
        """Room for an execution of ``nbytes`` of input (``staging``: in page-locked staging too, not only on the
        device) and ``out_floats`` of output."""
        if staging and self.host.numel() < nbytes:
            self.host = torch.empty(_round_up(nbytes), dtype=torch.uint8, pin_memory=True)
        if self.dev.numel() < nbytes:
            self.dev = torch.empty(_round_up(nbytes), dtype=torch.uint8, device=self.device)
            if self.native is not None:
                self.drop_graphs()  # they read the input buffer just replaced
        if self.out.numel() < out_floats:
            self.out = torch.empty(max(out_floats, 4096), dtype=torch.float32, pin_memory=True)

    def drop_graphs(self) -> None:
        """Free the slot's graphs (the slot is idle: none of them is running)."""
        if self.native is not None:
            for graph, _, _ in self.graphs.values():
                fused_cuda.destroy_graph(graph)
            self.graphs.clear()

    def close(self) -> None:
        """Free what the library made for this slot (the slot is idle)."""
        if self.native is not None:
            self.drop_graphs()
            fused_cuda.destroy_events(self.native_events)


class _Batch(NamedTuple):
    """A batch as submit takes it in: its slot, its sizes, the spans its DMA gathers (None: all staged, one DMA),
    which arrays are staged first (into the slot, where their spans point), and its padding."""

    slot: _Slot
    samples: int
    nbytes: int
    direct: np.ndarray | None
    padded_bytes: int
    shape: tuple[int, ...]
    staged: list[bool]


@dataclass
class Pending:
    """One execution in flight: its slot, its events and what the host copy took."""

    slot: _Slot
    samples: int
    cout: int
    host_copy_ns: int
    # h2d start, h2d end, compute start, compute end, d2h end: torch.cuda.Event, or kernels.cuda.Event (native path)
    events: tuple
    source: list[np.ndarray] | None = None  # page-locked request arrays the DMA reads in place: alive until done
    released: bool = False  # its slot is back in the free list


class CudaPipeline:
    """``depth`` slots of page-locked staging and device memory through which executions of ``compute`` (the op on
    (N, Cin, D, H, W) -> (N, cout), on the current stream) go; ``graphs``: captured CUDA graphs of it for small
    batches, padded to their buckets (None: none)."""

    def __init__(self, device: torch.device, cout: int, compute: Callable[[torch.Tensor], torch.Tensor],
                 graphs: GraphCache | None = None, depth: int = 3, native: fused_cuda.Launcher | None = None) -> None:
        self.device = device
        self.cout = cout
        self.compute = compute
        self.graphs = graphs
        # native: the fused op's launcher, with which an execution is enqueued by one library call (_submit_native)
        self.native = native if native is not None and native.supported else None
        self.copy_stream = torch.cuda.Stream(self.device)
        self.compute_stream = torch.cuda.Stream(self.device)
        self._free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(depth):
            self._free.put(_Slot(self.device, self.native))
        self.depth = depth
        if self.native is not None:
            self._capture_stream = torch.cuda.Stream(self.device)
            self._max_graphs = graphs.max_graphs if graphs is not None else 0  # per slot
            self._seen: collections.Counter[tuple] = collections.Counter()  # graph keys run directly so far
            self.native_executions = 0  # executions enqueued by the native path, ever (tests read it)
        # Written (by a CUDA host function) when an execution submitted with notify=True finishes. Open for the
        # pipeline's life: a host function still queued must never write into a descriptor number reused since.
        self.completion_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.staged_bytes = 0  # host bytes copied into staging, ever (the copy-count tests read it)
        self.direct_bytes = 0  # bytes sent to the GPU straight from pinned request buffers, ever
        self.device_bytes = 0  # input bytes of tensors in clients' CUDA memory, ever (read on the device only)
        self.device_output_bytes = 0  # output bytes written into clients' CUDA memory on the device, ever
        self._lock = threading.Lock()

    @staticmethod
    def _sources(arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays' bytes as flat uint8 tensors (views, not copies)."""
        with warnings.catch_warnings():  # request bytes are read-only; they are only read here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return [torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for a in arrays]

    def _page_locked(self, a: np.ndarray) -> bool:
        """Whether ``a`` lies in page-locked memory (the DMA can read it in place).

        Addresses in a range registered with register_page_locked (a front end's arena in the engine, a client's
        segment) are known at the cost of a search; others are asked of CUDA, through torch, which costs more
        (this runs once per request of every batch)."""
        if not a.flags.c_contiguous:
            return False
        return _registered(a.__array_interface__["data"][0], a.nbytes) or self._sources([a])[0].is_pinned()

    @property
    def _graph_max_bytes(self) -> int:
        """Batches up to this many input bytes run as graphs (0: none do)."""
        return self.graphs.max_input_bytes if self.graphs is not None else 0

    def _begin(self, arrays: list[np.ndarray], wait: bool, max_host_copy: int | None) -> _Batch | None:
        """The batch's sizes, its page-locked spans (None when it is staged), its padding to a graph bucket, and a
        free slot with room for it (waiting for one if ``wait``). None when ``max_host_copy`` refuses it, or when no
        slot is free and ``wait`` is False."""
        samples = sum(int(a.shape[0]) for a in arrays)
        nbytes = sum(a.nbytes for a in arrays)
        # Sources already in page-locked memory (shared-memory inputs, a front end's arena) go to the GPU in place,
        # gathered by one call, when every one is; otherwise the batch is merged into the slot's staging, except
        # for sources in DMA-only ranges (clients' segments), which are never read on the host: those go in place,
        # gathered with the staged ones.
        if all(self._page_locked(a) for a in arrays):
            staged = [False] * len(arrays)
        else:
            staged = [not _within(_DMA_ONLY, a.__array_interface__["data"][0], a.nbytes) for a in arrays]
        for a, copy in zip(arrays, staged, strict=True):
            if copy or not a.flags.c_contiguous:
                _check_host_readable(a)
        host_bytes = sum(a.nbytes for a, copy in zip(arrays, staged, strict=True) if copy)
        if host_bytes and max_host_copy is not None and host_bytes > max_host_copy:
            return None
        limit = self._graph_max_bytes
        padded = graph_bucket(samples, nbytes // samples, limit) if limit else samples
        padded_bytes, shape = nbytes // samples * padded, (padded, *arrays[0].shape[1:])
        try:
            slot = self._free.get(block=wait)
        except queue.Empty:
            return None
        try:
            slot.reserve(padded_bytes, padded * self.cout)
        except BaseException:
            self._free.put(slot)
            raise
        direct = None
        if not all(staged):
            spans, offset, staging = [], 0, slot.host.data_ptr()
            for a, copy in zip(arrays, staged, strict=True):
                spans.append((staging + offset if copy else a.__array_interface__["data"][0], a.nbytes))
                offset += a.nbytes
            direct = np.array(spans, dtype=np.int64).reshape(-1, 2)
        return _Batch(slot, samples, nbytes, direct, padded_bytes, shape, staged)

    def _stage(self, slot: _Slot, arrays: list[np.ndarray], staged: list[bool]) -> int:
        """Copy 1: the arrays to be staged into the slot's pinned staging, each where it lies in the batch (the
        others are DMA'd in place, never read here); the nanoseconds it took."""
        t0 = time.perf_counter_ns()
        offset = 0
        for a, copy in zip(arrays, staged, strict=True):
            if copy:
                src = self._sources([a])[0]
                if src.numel() >= PARALLEL_COPY_BYTES:  # torch's copy is multi-threaded for large tensors
                    slot.host[offset : offset + src.numel()].copy_(src)
                else:  # one memcpy: cheaper than waking a thread pool on a busy machine
                    slot.host[offset : offset + src.numel()].numpy()[:] = src.numpy()
            offset += a.nbytes
        return time.perf_counter_ns() - t0

    def _count(self, arrays: list[np.ndarray], staged: list[bool], native: bool = False) -> None:
        staged_bytes = sum(a.nbytes for a, copy in zip(arrays, staged, strict=True) if copy)
        with self._lock:
            self.staged_bytes += staged_bytes
            self.direct_bytes += sum(a.nbytes for a in arrays) - staged_bytes
            if native:
                self.native_executions += 1

    def submit(self, arrays: list[np.ndarray], datatype: str, wait_for_slot: bool = True, notify: bool = False,
               max_host_copy: int | None = None) -> Pending | None:
        """Stage ``arrays`` (same sample shape, wire-typed) as one batch and enqueue its execution; with
        ``notify``, ``completion_fd`` becomes readable when it has finished (see CompletionWatcher).

        Blocks while all ``depth`` slots are in flight; with ``wait_for_slot=False`` returns None instead. With
        ``max_host_copy``, returns None (nothing enqueued) when the batch would copy more bytes than that on
        the host (page-locked sources copy none)."""
        if arrays and isinstance(arrays[0], DeviceArray):
            return self._submit_device(cast(list[DeviceArray], arrays), datatype, wait_for_slot, notify)
        if self.native is not None:
            return self._submit_native(arrays, datatype, wait_for_slot, notify, max_host_copy)
        batch = self._begin(arrays, wait_for_slot, max_host_copy)
        if batch is None:
            return None
        slot, samples, nbytes, direct, padded_bytes, shape, staged = batch
        cout = self.cout
        try:
            host_copy_ns = self._stage(slot, arrays, staged) if any(staged) else 0
            self._count(arrays, staged)
            events = slot.events
            h2d_start, h2d_end, start, end, done = events
            with torch.cuda.stream(self.copy_stream):
                h2d_start.record()
                if direct is None:
                    slot.dev[:nbytes].copy_(slot.host[:nbytes], non_blocking=True)  # copy 2
                else:
                    fused_cuda.copy_spans(slot.dev, direct, self.copy_stream)
                if padded_bytes > nbytes:
                    slot.dev[nbytes:padded_bytes].zero_()
                h2d_end.record()
            x = slot.dev[:padded_bytes].view(TORCH_DTYPES[datatype]).view(shape)
            with torch.cuda.stream(self.compute_stream):
                self.compute_stream.wait_event(h2d_end)
                start.record()
                y = self.compute(x)
                end.record()
                slot.out[: samples * cout].view(samples, cout).copy_(y[:samples], non_blocking=True)  # 3: N x Cout
                done.record()
                if notify:
                    fused_cuda.notify(self.compute_stream, self.completion_fd)
        except BaseException:
            self._free.put(slot)
            raise
        return Pending(slot, samples, cout, host_copy_ns, events, arrays if direct is not None else None)

    def _submit_native(self, arrays: list[np.ndarray], datatype: str, wait_for_slot: bool, notify: bool,
                       max_host_copy: int | None) -> Pending | None:
        """``submit`` with one library call (fused.cu: voxserve_execute) doing what the torch path does in a dozen:
        the gather into staging (or the DMA straight from page-locked sources), the padding, the kernel or its
        graph, the result's copy back, the events and the wake-up. Graphs are the library's own, one per (bucket,
        sample shape, datatype) and slot, captured over the slot's input buffer: no staging copy into a graph's
        input either."""
        assert self.native is not None
        for a in arrays:
            if not a.flags.c_contiguous:
                _check_host_readable(a)
        arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in arrays]
        batch = self._begin(arrays, wait_for_slot, max_host_copy)
        if batch is None:
            return None
        slot, samples, nbytes, spans, padded_bytes, shape, staged = batch
        locked = spans is not None
        if spans is None:
            spans = np.array([(a.__array_interface__["data"][0], a.nbytes) for a in arrays], dtype=np.int64)
        cout = self.cout
        try:
            ex = slot.execution
            host_copy_ns = 0
            if locked:  # every span page-locked: in place, or staged here first (a batch of both)
                host_copy_ns = self._stage(slot, arrays, staged) if any(staged) else 0
                ex.stage = 0
            elif max(a.nbytes for a in arrays) >= PARALLEL_COPY_BYTES:  # torch's copy is multi-threaded
                host_copy_ns = self._stage(slot, arrays, staged)
                ex.stage = 2
            else:
                ex.stage = 1  # a memcpy per request, in the library call
            self._graph_or_direct(slot, ex, shape, datatype, padded_bytes)
            ex.spans, ex.nspans, ex.bytes, ex.padded_bytes = spans.ctypes.data, len(spans), nbytes, padded_bytes
            ex.staging, ex.dev_in = slot.host.data_ptr(), slot.dev.data_ptr()
            ex.host_out, ex.out_bytes = slot.out.data_ptr(), samples * cout * 4
            ex.copy_stream, ex.compute_stream = self.copy_stream.cuda_stream, self.compute_stream.cuda_stream
            ex.notify_fd = self.completion_fd if notify else -1
            ex.nout_spans = 0
            fused_cuda.execute(ex)
            if ex.stage == 1:
                host_copy_ns = ex.host_copy_ns
            self._count(arrays, staged, native=True)
        except BaseException:
            self._free.put(slot)
            raise
        return Pending(slot, samples, cout, host_copy_ns, slot.events, arrays if locked else None)

    def _graph_or_direct(self, slot: _Slot, ex: fused_cuda.Execution, shape: tuple[int, ...], datatype: str,
                         padded_bytes: int) -> None:
        """Fill ``ex`` to replay the slot's graph for ``shape`` over its input buffer, or to launch the kernel."""
        graph = self._graph_for(slot, shape, datatype, padded_bytes)
        if graph is not None:
            ex.graph_exec, ex.out = graph[0], graph[1].data_ptr()
        else:
            self._direct(slot, ex, shape, datatype)

    def _graph_for(self, slot: _Slot, shape: tuple[int, ...], datatype: str, padded_bytes: int) -> tuple | None:
        """The slot's graph for ``shape`` (captured now if the shape recurs and is small enough), or None."""
        key = (shape, datatype)
        graph = slot.graphs.get(key)
        if graph is not None:
            slot.graphs.move_to_end(key)
        elif padded_bytes <= self._graph_max_bytes:
            if len(self._seen) >= MAX_SEEN_SHAPES:  # many one-off shapes: start counting afresh
                self._seen.clear()
            self._seen[key] += 1
            if self._seen[key] >= 2:  # a shape that recurs: capture it for this slot
                graph = self._capture(slot, key, shape, TORCH_DTYPES[datatype])
        return graph

    def _direct(self, slot: _Slot, ex: fused_cuda.Execution, shape: tuple[int, ...], datatype: str,
                out: int | None = None) -> None:
        """Fill ``ex`` for a direct launch of the kernel on ``shape`` (no graph), its output at ``out`` (default: the
        slot's own)."""
        assert self.native is not None
        floats = self.native.workspace_floats(shape)
        if slot.workspace.numel() < floats:
            slot.workspace = torch.empty(_round_up(floats), dtype=torch.float32, device=self.device)
        if out is None:
            if slot.direct_out.numel() < shape[0] * self.cout:
                slot.direct_out = torch.empty(max(shape[0] * self.cout, 4096), dtype=torch.float32, device=self.device)
            out = slot.direct_out.data_ptr()
        ex.graph_exec, ex.out, ex.workspace = None, out, slot.workspace.data_ptr()
        ex.sizes[:] = shape
        ex.strides[:] = fused_cuda.contiguous_strides(shape)
        ex.dtype = fused_cuda.dtype_code(TORCH_DTYPES[datatype])

    def _submit_device(self, arrays: list[DeviceArray], datatype: str, wait_for_slot: bool,
                       notify: bool) -> Pending | None:
        """``submit`` of tensors in clients' CUDA memory on this device (DeviceArrays), with one library call and
        no host copy. A lone request too large for a graph is read in place by the kernel; otherwise the requests
        are gathered device to device into the slot's input buffer (padded to their graph bucket, replayed as a
        graph). A request whose ``result`` lies in device memory gets its output rows there, copied on the device
        (or written by the kernel itself when it runs in place on one request: no copy at all); every output also
        comes back to the host, N x Cout floats, for the response's checks."""
        if self.native is None:
            raise RuntimeError("tensors in CUDA memory are executed by the fused op's library (native path)")
        samples = sum(int(a.shape[0]) for a in arrays)
        nbytes = sum(a.nbytes for a in arrays)
        limit = self._graph_max_bytes
        padded = graph_bucket(samples, nbytes // samples, limit) if limit else samples
        padded_bytes, shape = nbytes // samples * padded, (padded, *arrays[0].shape[1:])
        in_place = len(arrays) == 1 and padded_bytes > limit  # (then padded == samples: no bucket holds it)
        try:
            slot = self._free.get(block=wait_for_slot)
        except queue.Empty:
            return None
        cout = self.cout
        try:
            slot.reserve(0 if in_place else padded_bytes, padded * cout, staging=False)  # gathered on the device
            ex = slot.execution
            ex.stage = 3
            results = [a.result for a in arrays]
            out_spans = np.array([(r.address if r is not None else 0, int(a.shape[0]) * cout * 4)
                                  for a, r in zip(arrays, results, strict=True)], dtype=np.int64)
            if in_place:
                ex.nspans, ex.dev_in, ex.bytes, ex.padded_bytes = 0, arrays[0].address, nbytes, nbytes
                result = results[0]
                # The kernel writes the client's region itself, unless its output would overlap the input it reads.
                into = (result.address if result is not None
                        and not _overlaps(result.address, result.nbytes, arrays[0].address, nbytes) else None)
                self._direct(slot, ex, shape, datatype, into)
            else:
                self._graph_or_direct(slot, ex, shape, datatype, padded_bytes)
                spans = np.array([(a.address, a.nbytes) for a in arrays], dtype=np.int64)  # (alive until execute)
                ex.spans, ex.nspans, ex.bytes, ex.padded_bytes = spans.ctypes.data, len(spans), nbytes, padded_bytes
                ex.dev_in = slot.dev.data_ptr()
            ex.out_spans, ex.nout_spans = out_spans.ctypes.data, len(out_spans) if any(
                r is not None for r in results) else 0
            ex.staging, ex.host_out, ex.out_bytes = slot.host.data_ptr(), slot.out.data_ptr(), samples * cout * 4
            ex.copy_stream, ex.compute_stream = self.copy_stream.cuda_stream, self.compute_stream.cuda_stream
            ex.notify_fd = self.completion_fd if notify else -1
            fused_cuda.execute(ex)
            with self._lock:
                self.device_bytes += nbytes
                self.device_output_bytes += int(out_spans[:, 1][out_spans[:, 0] != 0].sum())
                self.native_executions += 1
        except BaseException:
            self._free.put(slot)
            raise
        # the arrays (and their results) stay alive, and their mappings open, until the execution has finished
        return Pending(slot, samples, cout, 0, slot.events, cast(list, arrays))

    def _capture(self, slot: _Slot, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> tuple:
        """A graph of the op over ``slot``'s input buffer for ``shape``, kept in the slot under ``key``."""
        assert self.native is not None
        out = torch.empty(shape[0] * self.cout, dtype=torch.float32, device=self.device)
        workspace = torch.empty(self.native.workspace_floats(shape), dtype=torch.float32, device=self.device)
        handle = self.native.capture(slot.dev.data_ptr(), shape, dtype, out, workspace, self._capture_stream)
        slot.graphs[key] = (handle, out, workspace)
        while len(slot.graphs) > self._max_graphs:  # bounded, whatever shapes clients send
            fused_cuda.destroy_graph(slot.graphs.popitem(last=False)[1][0])
        return slot.graphs[key]

    def wait(self, pending: Pending) -> tuple[np.ndarray, int, int, int]:
        """Block until ``pending`` finished; (output (N, Cout) float32, input ns, compute ns, output ns)."""
        try:
            pending.events[-1].synchronize()
        except BaseException:
            self.release(pending)
            raise
        return self.finish(pending)

    def finish(self, pending: Pending) -> tuple[np.ndarray, int, int, int]:
        """Once ``pending`` has finished: ``wait``'s result, and the slot back for the next execution."""
        h2d_start, h2d_end, start, end, done = pending.events
        try:
            pending.source = None
            out = pending.slot.out[: pending.samples * pending.cout].numpy().reshape(pending.samples, pending.cout)
            out = out.copy()  # the slot is reused as soon as it is released
            input_ns = pending.host_copy_ns + int(h2d_start.elapsed_time(h2d_end) * 1e6)
            infer_ns = int(start.elapsed_time(end) * 1e6)
            output_ns = int(end.elapsed_time(done) * 1e6)
        finally:
            self.release(pending)
        return out, input_ns, infer_ns, output_ns

    def release(self, pending: Pending) -> None:
        """Return ``pending``'s slot (once; after a failed wait too)."""
        if not pending.released:
            pending.released = True
            self._free.put(pending.slot)

    def reset(self) -> None:
        """After a fault: wait for the streams, drop the staging memory (it is re-reserved on demand)."""
        for stream in (self.copy_stream, self.compute_stream):
            stream.synchronize()
        drained = 0
        while not self._free.empty():  # slots in flight come back through finish() and keep their memory
            old = self._free.get_nowait()
            with contextlib.suppress(Exception):  # a failed context may refuse to free anything
                old.close()
            drained += 1
        for _ in range(drained):
            self._free.put(_Slot(self.device, self.native))


class CompletionWatcher:
    """Executions in flight on one pipeline, each resolved on the event loop as it finishes.

    The pipeline's host function makes ``completion_fd`` readable after each execution submitted with
    ``notify=True``; the loop then checks the oldest executions' last events (one stream: they finish in order)
    and resolves their futures. No thread waits for the GPU, so none has to take the interpreter lock back
    from a busy loop to report an end (on a busy engine that hand-back cost milliseconds per execution). A slow
    poll backs the wake-ups up, so an execution whose host function never runs (a failed context) still ends,
    with the error its event reports."""

    POLL_S = 0.05

    def __init__(self, pipeline: CudaPipeline, loop: asyncio.AbstractEventLoop) -> None:
        self.pipeline = pipeline
        self.loop = loop
        self._inflight: collections.deque[tuple[Pending, asyncio.Future]] = collections.deque()
        self._poll: asyncio.TimerHandle | None = None
        self.closed = False
        loop.add_reader(pipeline.completion_fd, self._wake)

    def done(self, pending: Pending) -> asyncio.Future:
        """A future that is set once ``pending`` (submitted with notify=True, after every earlier one) finished."""
        future = self.loop.create_future()
        self._track(pending, future)
        return future

    def abandon(self, pending: Pending) -> None:
        """``pending`` (as for ``done``) whose caller has gone (a shutdown): its slot is released once it has
        finished, as is that of each execution whose ``done`` future was cancelled."""
        future = self.loop.create_future()
        future.cancel()
        self._track(pending, future)

    def _track(self, pending: Pending, future: asyncio.Future) -> None:
        if self.closed:  # (an enqueue abandoned at shutdown that ended after the runner closed)
            self._settle(pending, future)
            return
        self._inflight.append((pending, future))
        self._check()  # it may have finished, and its wake-up been read, before it was handed over
        if self._inflight and self._poll is None:
            self._poll = self.loop.call_later(self.POLL_S, self._backstop)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # another wake-up read it first
            os.eventfd_read(self.pipeline.completion_fd)
        self._check()

    def _backstop(self) -> None:
        self._poll = None
        self._check()
        if self._inflight:
            self._poll = self.loop.call_later(self.POLL_S, self._backstop)

    def _check(self) -> None:
        while self._inflight:
            pending, future = self._inflight[0]
            error: Exception | None = None
            try:
                if not pending.events[-1].query():
                    return
            except Exception as exc:  # the device failed: this execution's error
                error = exc
            self._inflight.popleft()
            self._ended(pending, future, error)

    def _ended(self, pending: Pending, future: asyncio.Future, error: Exception | None) -> None:
        if future.cancelled():  # nobody collects it (a shutdown): its slot comes back now the device is done
            self.pipeline.release(pending)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)

    def _settle(self, pending: Pending, future: asyncio.Future) -> None:
        """Wait for ``pending`` to end (blocking: only once closed, at a shutdown), then end it."""
        error: Exception | None = None
        try:
            pending.events[-1].synchronize()
        except Exception as exc:
            error = exc
        self._ended(pending, future, error)

    def close(self) -> None:
        """No more wake-ups on the loop. The executions still in flight are waited for here (at most the pipeline's
        depth: a shutdown), so each ends: its future resolved, or, nobody's, its slot released; as does any handed
        over afterwards."""
        self.closed = True
        self.loop.remove_reader(self.pipeline.completion_fd)
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        while self._inflight:
            self._settle(*self._inflight.popleft())
