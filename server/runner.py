"""The runner: a dynamic batcher in front of one worker thread per device, so the event loop never
blocks on compute and concurrent small requests share executions."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .batching import BatchResult, DynamicBatcher
from .metrics import Metrics
from .model import Model, wire_to_tensor
from .stats import ModelStats


@dataclass(frozen=True)
class BatchingConfig:
    enabled: bool
    max_delay_s: float
    max_queue: int


class Runner:
    def __init__(self, model: Model, stats: ModelStats, metrics: Metrics, batching: BatchingConfig) -> None:
        self.model = model
        self._stats = stats
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"runner-{model.device}")
        depth = metrics.queue_depth.labels(metrics.model)
        self.batcher = DynamicBatcher(self._execute, self._executor, max_batch=model.max_batch,
                                      max_delay_s=batching.max_delay_s, max_queue=batching.max_queue,
                                      enabled=batching.enabled, on_depth=depth.set)

    async def run(self, arr: np.ndarray, datatype: str, timeout_s: float | None = None) -> BatchResult:
        """Infer one request's (N, Cin, D, H, W) wire-typed array (raises QueueFull, DeadlineExceeded)."""
        result = await self.batcher.submit(arr, datatype, timeout_s)
        self._metrics.queue_duration.labels(self._metrics.model).observe(result.queue_ns / 1e9)
        return result

    def _execute(self, batch: np.ndarray, datatype: str) -> np.ndarray:
        """On the worker thread: executions of at most max_batch samples, each recorded."""
        x = wire_to_tensor(batch, datatype)
        step = self.model.max_batch
        parts = []
        for i in range(0, x.shape[0], step):
            y, times = self.model.run_tensor(x[i : i + step])
            size = int(y.shape[0])
            self._stats.record_execution(size, times.input_ns, times.infer_ns, times.output_ns)
            self._metrics.compute_duration.labels(self._metrics.model).observe(times.infer_ns / 1e9)
            self._metrics.batch_size.labels(self._metrics.model).observe(size)
            parts.append(y.numpy())
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def close(self) -> None:
        await self.batcher.close()
        self._executor.shutdown(wait=True)
