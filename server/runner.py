"""The runner: one worker thread per device feeds the model, so the event loop never blocks on compute."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .metrics import Metrics
from .model import Model, wire_to_tensor
from .stats import ModelStats


@dataclass(frozen=True)
class RunResult:
    output: np.ndarray  # (N, Cout) float32
    queue_ns: int  # submitted -> first execution started


class Runner:
    def __init__(self, model: Model, stats: ModelStats, metrics: Metrics) -> None:
        self.model = model
        self._stats = stats
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"runner-{model.device}")
        self._waiting = 0

    async def run(self, arr: np.ndarray, datatype: str) -> RunResult:
        """Infer one request's (N, Cin, D, H, W) wire-typed array; executions of max_batch samples each."""
        loop = asyncio.get_running_loop()
        submitted = time.perf_counter_ns()
        self._waiting += 1
        self._metrics.queue_depth.labels(self._metrics.model).set(self._waiting)
        started: list[int] = []
        left_queue = False

        def dequeue() -> None:  # runs on the loop thread only, once
            nonlocal left_queue
            if not left_queue:
                left_queue = True
                self._waiting -= 1
                self._metrics.queue_depth.labels(self._metrics.model).set(self._waiting)

        def work() -> np.ndarray:
            started.append(time.perf_counter_ns())
            loop.call_soon_threadsafe(dequeue)
            return self._execute(wire_to_tensor(arr, datatype))

        try:
            output = await loop.run_in_executor(self._executor, work)
        finally:
            dequeue()
        queue_ns = started[0] - submitted
        self._metrics.queue_duration.labels(self._metrics.model).observe(queue_ns / 1e9)
        return RunResult(output, queue_ns)

    def _execute(self, x: torch.Tensor) -> np.ndarray:
        step = self.model.max_batch
        parts = []
        for i in range(0, x.shape[0], step):
            y, times = self.model.run_tensor(x[i : i + step])
            batch = int(y.shape[0])
            self._stats.record_execution(batch, times.input_ns, times.infer_ns, times.output_ns)
            self._metrics.compute_duration.labels(self._metrics.model).observe(times.infer_ns / 1e9)
            self._metrics.batch_size.labels(self._metrics.model).observe(batch)
            parts.append(y.numpy())
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
