"""The runner: a dynamic batcher in front of one worker thread per device, so the event loop never
blocks on compute and concurrent small requests share executions."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from .batching import BatchResult, DynamicBatcher
from .errors import ServingError
from .metrics import Metrics
from .model import Model, wire_to_tensor
from .stats import ModelStats

log = logging.getLogger(__name__)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), Python's MemoryError, or the CPU allocator's RuntimeError."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc)))


@dataclass(frozen=True)
class BatchingConfig:
    enabled: bool
    max_delay_s: float
    max_queue: int


class Runner:
    def __init__(self, model: Model, stats: ModelStats, metrics: Metrics, batching: BatchingConfig,
                 on_device_lost: Callable[[str], None] | None = None) -> None:
        self.model = model
        self.device_lost: str | None = None  # set when the device cannot be used again in this process
        self._on_device_lost = on_device_lost or (lambda reason: None)
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
            if self.device_lost is not None:
                raise self.lost_error()
            try:
                y, times = self.model.run_tensor(x[i : i + step])
            except Exception as exc:
                raise self._fault(exc, tuple(x[i : i + step].shape)) from None
            size = int(y.shape[0])
            self._stats.record_execution(size, times.input_ns, times.infer_ns, times.output_ns)
            self._metrics.compute_duration.labels(self._metrics.model).observe(times.infer_ns / 1e9)
            self._metrics.batch_size.labels(self._metrics.model).observe(size)
            parts.append(y.numpy())
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def lost_error(self) -> ServingError:
        return ServingError(grpc.StatusCode.UNAVAILABLE, f"{self.model.device} failed ({self.device_lost}); this "
                            f"replica must be restarted, retry on another")

    def _fault(self, exc: Exception, shape: tuple[int, ...]) -> ServingError:
        """Count a failed execution, restore the device for the next one, and say what the client gets."""
        oom = is_out_of_memory(exc)
        reason = "out_of_memory" if oom else "device_error"
        self._metrics.execution_failures.labels(self._metrics.model, reason).inc()
        log.error("execution of %s on %s failed: %s: %s", list(shape), self.model.device, type(exc).__name__,
                  str(exc).splitlines()[0] if str(exc) else "")
        problem = self.model.recover()
        if problem is not None:
            self.device_lost = problem
            log.critical("%s cannot be used any more (%s): reporting not ready", self.model.device, problem)
            self._on_device_lost(problem)
            return ServingError(grpc.StatusCode.UNAVAILABLE, f"execution on {self.model.device} failed and the "
                                f"device cannot recover ({problem}); retry on another replica")
        if oom:
            return ServingError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.model.device} ran out of memory executing {shape[0]} samples of "
                                f"{list(shape[1:])}; retry later or with fewer samples")
        return ServingError(grpc.StatusCode.INTERNAL, f"execution on {self.model.device} failed "
                            f"({type(exc).__name__}); the server recovered and serves further requests")

    async def close(self) -> None:
        await self.batcher.close()
        self._executor.shutdown(wait=True)
