"""The runner: a dynamic batcher in front of one worker per device, so the event loop never blocks on
compute, concurrent small requests share executions, and on GPUs consecutive batches overlap.

Each device has a worker: the model on that device, one thread that stages and enqueues executions
(ordered, so streams see them in order) and, on a GPU, one thread that waits for them to finish. A
batch goes to the worker with the fewest executions in flight; with several GPUs that spreads the
load by queue depth. A batch larger than max_batch samples runs as several executions, pipelined.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from .batching import BatchResult, DynamicBatcher
from .errors import ServingError
from .metrics import Metrics
from .model import ExecutionTimes, Model
from .stats import ModelStats

log = logging.getLogger(__name__)

# GPU batches up to this size run start to finish in one hop to the worker thread (see Runner._execute).
INLINE_BYTES = 2 * 1024 * 1024


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), Python's MemoryError, or the CPU allocator's RuntimeError."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc)))


@dataclass(frozen=True)
class BatchingConfig:
    enabled: bool
    max_delay_s: float
    max_queue: int

    @classmethod
    def from_settings(cls, s) -> BatchingConfig:
        """--batching, --max-queue-delay-ms, --max-queue-size."""
        return cls(s.batching, s.max_queue_delay_ms / 1e3, s.max_queue_size)


def split_executions(arrays: Sequence[np.ndarray], limit: int) -> list[list[np.ndarray]]:
    """Group request arrays (views, never copies) into executions of at most ``limit`` samples, in order."""
    executions: list[list[np.ndarray]] = []
    current: list[np.ndarray] = []
    count = 0
    for a in arrays:
        start = 0
        while start < a.shape[0]:
            take = min(limit - count, a.shape[0] - start)
            current.append(a[start : start + take] if take != a.shape[0] else a)
            count += take
            start += take
            if count == limit:
                executions.append(current)
                current, count = [], 0
    if current:
        executions.append(current)
    return executions


class DeviceWorker:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"submit-{model.device}")
        self.waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"wait-{model.device}") \
            if model.pipeline is not None else None
        self.inflight = 0  # executions submitted and not finished
        self.lost: str | None = None  # why this device cannot be used any more

    def shutdown(self) -> None:
        self.submitter.shutdown(wait=True)
        if self.waiter is not None:
            self.waiter.shutdown(wait=True)


class Runner:
    def __init__(self, models: Model | Sequence[Model], stats: ModelStats, metrics: Metrics, batching: BatchingConfig,
                 on_device_lost: Callable[[str], None] | None = None) -> None:
        models = [models] if isinstance(models, Model) else list(models)
        self.workers = [DeviceWorker(m) for m in models]
        self.max_batch = models[0].max_batch
        self.batching = batching
        self.device_lost: str | None = None  # set when no device can be used any more in this process
        self._on_device_lost = on_device_lost or (lambda reason: None)
        self._stats = stats
        self._metrics = metrics
        depth = models[0].pipeline.depth if models[0].pipeline is not None else 1
        depth_gauge = metrics.queue_depth.labels(metrics.model)
        self.batcher = DynamicBatcher(self._execute, max_batch=self.max_batch, max_delay_s=batching.max_delay_s,
                                      max_queue=batching.max_queue, enabled=batching.enabled,
                                      max_inflight=depth * len(self.workers), on_depth=depth_gauge.set)

    @property
    def model(self) -> Model:
        """The first device's model (the only one on a single device)."""
        return self.workers[0].model

    @property
    def devices(self) -> list[str]:
        return [str(w.model.device) for w in self.workers]

    def admit(self) -> None:
        """QueueFull when no further request may queue (checked before a request is decoded)."""
        self.batcher.admit()

    async def run(self, arr: np.ndarray, datatype: str, timeout_s: float | None = None) -> BatchResult:
        """Infer one request's (N, Cin, D, H, W) wire-typed array (raises QueueFull, DeadlineExceeded)."""
        return await self.enqueue(arr, datatype, timeout_s)

    def enqueue(self, arr: np.ndarray, datatype: str, timeout_s: float | None = None) -> asyncio.Future:
        """``run`` as a future (the engine of --frontends answers from its callback, no task per request)."""
        future = self.batcher.enqueue(arr, datatype, timeout_s)
        future.add_done_callback(self._observe_queue)
        return future

    def _observe_queue(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._metrics.queue_duration.labels(self._metrics.model).observe(future.result().queue_ns / 1e9)

    # --- executing one batch ---------------------------------------------------------

    async def _execute(self, arrays: list[np.ndarray], datatype: str) -> np.ndarray:
        live = [w for w in self.workers if w.lost is None]
        if not live:
            raise self.lost_error()
        worker = min(live, key=lambda w: w.inflight)
        executions = split_executions(arrays, self.max_batch)
        loop = asyncio.get_running_loop()
        if worker.waiter is None or sum(a.nbytes for a in arrays) <= INLINE_BYTES:
            # One execution after another, each in one hop to the worker thread: the CPU, and small GPU
            # batches, for which a second hop would cost more latency than overlapping their transfers saves.
            outputs = []
            for ex in executions:
                worker.inflight += 1
                try:
                    outputs.append(await loop.run_in_executor(worker.submitter, self._run_sync, worker, ex, datatype))
                finally:
                    worker.inflight -= 1
        else:  # GPU: submit each execution without waiting; a second thread collects them in order
            waits: list[asyncio.Future] = []
            failure: BaseException | None = None
            for ex in executions:
                worker.inflight += 1
                try:
                    pending = await loop.run_in_executor(worker.submitter, self._submit, worker, ex, datatype)
                except BaseException as exc:
                    worker.inflight -= 1
                    failure = exc
                    break
                waits.append(loop.run_in_executor(worker.waiter, self._collect, worker, pending))
            results = await asyncio.gather(*waits, return_exceptions=True)
            worker.inflight -= len(waits)
            errors = [r for r in results if isinstance(r, BaseException)]
            if failure is not None or errors:
                raise failure if failure is not None else errors[0]
            outputs = results
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)

    def _run_sync(self, worker: DeviceWorker, arrays: list[np.ndarray], datatype: str) -> np.ndarray:
        """One execution, start to finish, on the worker thread (Model.run_arrays: the pipeline on a GPU)."""
        if worker.lost is not None:
            raise self.lost_error()
        try:
            y, times = worker.model.run_arrays(arrays, datatype)
        except Exception as exc:
            raise self._fault(worker, exc, arrays) from None
        self._record(int(y.shape[0]), times)
        return y

    def _submit(self, worker: DeviceWorker, arrays: list[np.ndarray], datatype: str):
        if worker.lost is not None:
            raise self.lost_error()
        try:
            return worker.model.pipeline.submit(arrays, datatype)
        except Exception as exc:
            raise self._fault(worker, exc, arrays) from None

    def _collect(self, worker: DeviceWorker, pending) -> np.ndarray:
        try:
            y, input_ns, infer_ns, output_ns = worker.model.pipeline.wait(pending)
        except Exception as exc:
            raise self._fault(worker, exc, None, pending.samples) from None
        self._record(int(y.shape[0]), ExecutionTimes(input_ns, infer_ns, output_ns))
        return y

    def _record(self, size: int, times: ExecutionTimes) -> None:
        self._stats.record_execution(size, times.input_ns, times.infer_ns, times.output_ns)
        self._metrics.compute_duration.labels(self._metrics.model).observe(times.infer_ns / 1e9)
        self._metrics.batch_size.labels(self._metrics.model).observe(size)

    # --- faults ----------------------------------------------------------------------------

    def lost_error(self) -> ServingError:
        return ServingError(grpc.StatusCode.UNAVAILABLE, f"{', '.join(self.devices)} failed ({self.device_lost}); "
                            f"this replica must be restarted, retry on another")

    def _fault(self, worker: DeviceWorker, exc: Exception, arrays: list[np.ndarray] | None,
               samples: int | None = None) -> ServingError:
        """Count a failed execution, restore the device for the next one, and say what the client gets."""
        if isinstance(exc, ServingError):
            return exc
        device = worker.model.device
        if arrays is not None:
            samples = sum(int(a.shape[0]) for a in arrays)
        what = f"{samples} samples" + (f" of {list(arrays[0].shape[1:])}" if arrays else "")
        oom = is_out_of_memory(exc)
        reason = "out_of_memory" if oom else "device_error"
        self._metrics.execution_failures.labels(self._metrics.model, reason).inc()
        log.error("execution of %s on %s failed: %s: %s", what, device, type(exc).__name__,
                  str(exc).splitlines()[0] if str(exc) else "")
        problem = worker.model.recover()
        if problem is not None:
            worker.lost = problem
            log.critical("%s cannot be used any more (%s)", device, problem)
            if all(w.lost is not None for w in self.workers):
                self.device_lost = problem
                self._on_device_lost(problem)
            return ServingError(grpc.StatusCode.UNAVAILABLE, f"execution on {device} failed and the device "
                                f"cannot recover ({problem}); retry on another replica")
        if oom:
            return ServingError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{device} ran out of memory executing {what}; "
                                f"retry later or with fewer samples")
        return ServingError(grpc.StatusCode.INTERNAL, f"execution on {device} failed ({type(exc).__name__}); "
                            f"the server recovered and serves further requests")

    async def close(self) -> None:
        await self.batcher.close()
        for worker in self.workers:
            worker.shutdown()
