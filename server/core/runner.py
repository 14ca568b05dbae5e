"""The runner: a dynamic batcher in front of one worker per device, so the event loop never blocks on
compute, concurrent small requests share executions, and on GPUs consecutive batches overlap.

Each device has a worker: the model on that device and one thread that stages and enqueues executions
(ordered, so streams see them in order; on a GPU small ones may be enqueued on the event loop instead).
On a GPU no thread waits for an execution: a CUDA host function wakes the event loop when one has finished
(pipeline.CompletionWatcher). A batch goes to the worker with the fewest executions in flight; with several
GPUs that spreads the load by queue depth. A batch larger than max_batch samples runs as several
executions, pipelined.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

import numpy as np
import torch

from ..metrics import Metrics
from .batching import BatchingConfig, BatchResult, DynamicBatcher, Tensor
from .devicemem import DeviceArray, RegionTensor
from .errors import ServingError, Status
from .model import ExecutionTimes, Model
from .pipeline import PARALLEL_COPY_BYTES, CompletionWatcher
from .stats import ModelStats

log = logging.getLogger(__name__)

# GPU executions with at most this many bytes to copy on the host may be enqueued on the event loop itself
# (Runner._execute_gpu); and while a batch executes, the next starts beside it only from this size on
# (DynamicBatcher's overlap_bytes): smaller ones gain nothing from overlapping and wait, growing meanwhile.
INLINE_BYTES = PARALLEL_COPY_BYTES  # what the loop copies is one memcpy


def _retrieved(task: asyncio.Future) -> None:
    """A cancelled call's collect task, done: its failure (if it had ended before the cancel) is nobody's to
    hear, so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), Python's MemoryError, or the CPU allocator's RuntimeError."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc)))


_T = TypeVar("_T", bound=np.ndarray | DeviceArray)


def split_executions(arrays: Sequence[_T], limit: int) -> list[list[_T]]:
    """Group request arrays (views, never copies) into executions of at most ``limit`` samples, in order."""
    executions: list[list[_T]] = []
    current: list[_T] = []
    count = 0
    for a in arrays:
        start = 0
        while start < a.shape[0]:
            take = min(limit - count, a.shape[0] - start)
            current.append(cast(_T, a[start : start + take]) if take != a.shape[0] else a)
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
        self.inflight = 0  # executions submitted and not finished
        self.submitting = 0  # executions handed to the submit thread and not yet enqueued (event loop only)
        self.lost: str | None = None  # why this device cannot be used any more
        self._watcher: CompletionWatcher | None = None

    def watcher(self) -> CompletionWatcher:
        """The GPU's completion watcher on the running event loop."""
        loop = asyncio.get_running_loop()
        if self._watcher is None or self._watcher.loop is not loop:
            if self._watcher is not None and not self._watcher.loop.is_closed():
                self._watcher.close()
            self._watcher = CompletionWatcher(self.model.gpu_pipeline, loop)
        return self._watcher

    def shutdown(self) -> None:
        """The watcher first: it waits for what is in flight and gives back the slots of executions nobody collects,
        one of which an enqueue on the submit thread may be waiting for (the loop, blocked below until the thread
        is done, could not give it back)."""
        if self._watcher is not None and not self._watcher.loop.is_closed():
            self._watcher.close()
        self.submitter.shutdown(wait=True)


class Runner:
    def __init__(self, models: Model | Sequence[Model], stats: ModelStats, metrics: Metrics, batching: BatchingConfig,
                 on_device_lost: Callable[[str], object] | None = None, enqueue_on_loop: bool = False) -> None:
        models = [models] if isinstance(models, Model) else list(models)
        self.workers = [DeviceWorker(m) for m in models]
        self.enqueue_on_loop = enqueue_on_loop  # see _execute_gpu
        self.max_batch = models[0].max_batch
        self.batching = batching
        self.device_lost: str | None = None  # set when no device can be used any more in this process
        self._on_device_lost = on_device_lost or (lambda reason: None)
        self._stats = stats
        self._metrics = metrics
        depth = models[0].pipeline.depth if models[0].pipeline is not None else 1
        depth_gauge = metrics.queue_depth.labels(metrics.model)
        queue_duration = metrics.series.queue_duration
        self.batcher = DynamicBatcher(self._execute, max_batch=self.max_batch, max_delay_s=batching.max_delay_s,
                                      max_queue=batching.max_queue, enabled=batching.enabled,
                                      max_inflight=depth * len(self.workers),
                                      overlap_bytes=INLINE_BYTES if models[0].pipeline is not None else 0,
                                      devices=len(self.workers),
                                      on_depth=depth_gauge.set,
                                      on_queued=lambda ns: queue_duration.observe(ns / 1e9))

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

    def run(self, arr: np.ndarray | DeviceArray | RegionTensor, datatype: str,
            timeout_s: float | None = None) -> Awaitable[BatchResult]:
        """Infer one request's (N, Cin, D, H, W) wire-typed array (raises QueueFull, DeadlineExceeded). The future
        itself, awaited by the caller: no frame of this method keeps the array (a failure's traceback would)."""
        if isinstance(arr, RegionTensor):  # a front end's: the model's process knows CUDA tensors by address
            raise ServingError(Status.INTERNAL, "a tensor known only by its region reached the model's process")
        return self.enqueue(arr, datatype, timeout_s)

    def enqueue(self, arr: np.ndarray | DeviceArray, datatype: str, timeout_s: float | None = None) -> asyncio.Future:
        """``run`` as a future (the engine of --frontends answers from its callback, no task per request)."""
        return self.batcher.enqueue(arr, datatype, timeout_s)

    # --- executing one batch ---------------------------------------------------------

    async def _execute(self, arrays: list[Tensor], datatype: str) -> np.ndarray:
        live = [w for w in self.workers if w.lost is None]
        if not live:
            raise self.lost_error()
        worker = min(live, key=lambda w: w.inflight)
        executions = split_executions(arrays, self.max_batch)
        host = cast(list[list[np.ndarray]], executions)  # unless a tensor lies on a device (the first branch)
        if not isinstance(arrays[0], np.ndarray):  # in a client's CUDA memory: on its device, read where it lies
            place = arrays[0].place
            worker = min((w for w in live if str(w.model.device) == place), key=lambda w: w.inflight, default=worker)
            pipeline = worker.model.pipeline
            if pipeline is not None and pipeline.native is not None and str(worker.model.device) == place:
                # one library call each, no host copy, no thread waiting for the device (as host batches)
                return self._joined(await self._execute_gpu(worker, cast(list[list[np.ndarray]], executions),
                                                            datatype))
            loop = asyncio.get_running_loop()
            outputs = []
            for ex in executions:
                worker.inflight += 1
                try:
                    outputs.append(await loop.run_in_executor(worker.submitter, self._run_device_sync, worker, ex,
                                                              datatype))
                finally:
                    worker.inflight -= 1
        elif worker.model.pipeline is not None:
            outputs = await self._execute_gpu(worker, host, datatype)
        else:  # the CPU: one execution after another, each start to finish on the worker thread
            loop = asyncio.get_running_loop()
            outputs = []
            for host_ex in host:
                worker.inflight += 1
                try:
                    outputs.append(await loop.run_in_executor(worker.submitter, self._run_sync, worker, host_ex,
                                                              datatype))
                finally:
                    worker.inflight -= 1
        return self._joined(outputs)

    @staticmethod
    def _joined(outputs: list[np.ndarray]) -> np.ndarray:
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)

    async def _execute_gpu(self, worker: DeviceWorker, executions: list[list[np.ndarray]],
                           datatype: str) -> list[np.ndarray]:
        """Enqueue each execution without waiting for the one before, then collect them in order. No thread
        waits for the GPU: the pipeline's completion watcher wakes this loop when an execution has finished.

        Enqueueing is a few dozen CUDA calls, each of which lets go of the interpreter lock and takes it back;
        on a worker thread each taking-back waits for the event loop to let go in turn. With
        ``enqueue_on_loop`` (the engine of --frontends, whose loop does nothing but batch) an execution with
        little host work (page-locked sources, which are only DMA'd, or a host copy of at most INLINE_BYTES)
        is enqueued right here: on a busy engine a batch whose GPU time was 0.2 ms took 3-6 ms to execute
        from the thread (bench/results/frontends-h100-80gb-hbm3.md). A loop that also terminates gRPC keeps
        the submit thread: there the loop is the bottleneck, and enqueueing on it halved batch-1 throughput.
        Large host copies always go to the thread, and while one does, the next executions follow it there:
        one thread at a time enqueues, in order (CUDA graphs' input buffers are shared)."""
        tracked: list[tuple[Any, asyncio.Future]] = []  # each enqueued execution and its end (the watcher's)
        waits: list[asyncio.Future] = []
        failure: Exception | None = None
        worker.inflight += len(executions)
        try:
            for ex in executions:
                try:
                    pending = None
                    if self.enqueue_on_loop and worker.submitting == 0:
                        # None: no free slot now, or more than INLINE_BYTES to copy on the host
                        pending = self._submit(worker, ex, datatype, wait_for_slot=False, max_host_copy=INLINE_BYTES)
                    if pending is None:
                        pending = await self._submit_on_thread(worker, ex, datatype)
                except Exception as exc:  # those enqueued before are still collected, then this one fails the call
                    failure = exc
                    break
                done = worker.watcher().done(pending)
                tracked.append((pending, done))
                if len(executions) == 1:  # (every batch the batcher forms: collected here, with no task or gather)
                    return [await self._collect(worker, pending, done)]
                waits.append(asyncio.ensure_future(self._collect(worker, pending, done)))
            results = await asyncio.gather(*waits, return_exceptions=True)
        except asyncio.CancelledError:
            for wait in waits:  # (cancelled during a later enqueue: gather did not cancel them)
                wait.cancel()  # one whose execution has ended but that has yet to run finishes nothing now
                wait.add_done_callback(_retrieved)
            self._abandon(worker, tracked)
            raise
        finally:
            worker.inflight -= len(executions)
        errors = [r for r in results if isinstance(r, BaseException)]
        if failure is not None or errors:
            raise failure if failure is not None else errors[0]
        return cast(list[np.ndarray], results)

    async def _submit_on_thread(self, worker: DeviceWorker, arrays: list[np.ndarray], datatype: str):
        """``_submit`` on the worker's thread. Cancelled meanwhile, the enqueue still runs to its end: until then
        the thread counts as submitting (so no execution is enqueued on the loop beside it), and what it enqueued
        is handed to the watcher unwaited for, which returns its slot once the device has finished with it."""
        loop = asyncio.get_running_loop()
        worker.submitting += 1
        job = worker.submitter.submit(self._submit, worker, arrays, datatype)
        try:
            pending = await asyncio.wrap_future(job, loop=loop)
        except asyncio.CancelledError:
            job.add_done_callback(functools.partial(self._abandoned, worker, loop))
            raise
        except BaseException:
            worker.submitting -= 1
            raise
        worker.submitting -= 1
        return pending

    @staticmethod
    def _abandon(worker: DeviceWorker, tracked: list[tuple[Any, asyncio.Future]]) -> None:
        """A cancelled call's enqueued executions (a shutdown): each slot comes back once the device has finished
        with it, now for those that have (unless collected already: a slot is released once), from the watcher
        for the others."""
        for pending, done in tracked:
            if not done.done():
                done.cancel()
            elif not done.cancelled():
                done.exception()  # (retrieved: an execution's failure nobody is told of is not an error to log)
                worker.model.gpu_pipeline.release(pending)

    @staticmethod
    def _abandoned(worker: DeviceWorker, loop: asyncio.AbstractEventLoop, job: concurrent.futures.Future) -> None:
        """The end of an enqueue whose caller was cancelled (on the submit thread, or the loop if it had not
        started)."""
        def on_loop() -> None:
            worker.submitting -= 1
            if not job.cancelled() and job.exception() is None:
                worker.watcher().abandon(job.result())

        with contextlib.suppress(RuntimeError):  # the loop has closed: the process is ending
            loop.call_soon_threadsafe(on_loop)

    def _run_sync(self, worker: DeviceWorker, arrays: list[np.ndarray], datatype: str) -> np.ndarray:
        """One CPU execution, start to finish, on the worker thread."""
        if worker.lost is not None:
            raise self.lost_error()
        try:
            y, times = worker.model.run_arrays(arrays, datatype)
        except Exception as exc:
            raise self._fault(worker, exc, arrays) from None
        self._record(int(y.shape[0]), times)
        return y

    def _run_device_sync(self, worker: DeviceWorker, arrays: list, datatype: str) -> np.ndarray:
        """One execution of tensors in clients' CUDA memory (DeviceArrays), start to finish, on the worker
        thread."""
        if worker.lost is not None:
            raise self.lost_error()
        try:
            y, times = worker.model.run_device_arrays(arrays, datatype)
        except Exception as exc:
            raise self._fault(worker, exc, arrays) from None
        self._record(int(y.shape[0]), times)
        return y

    def _submit(self, worker: DeviceWorker, arrays: list[np.ndarray], datatype: str, wait_for_slot: bool = True,
                max_host_copy: int | None = None):
        if worker.lost is not None:
            raise self.lost_error()
        try:
            return worker.model.gpu_pipeline.submit(arrays, datatype, wait_for_slot, notify=True,
                                                    max_host_copy=max_host_copy)
        except Exception as exc:
            raise self._fault(worker, exc, arrays) from None

    async def _collect(self, worker: DeviceWorker, pending, done: asyncio.Future) -> np.ndarray:
        """``pending``'s output once ``done`` (its end, from the watcher), its slot back."""
        pipeline = worker.model.gpu_pipeline
        try:
            await done
            y, input_ns, infer_ns, output_ns = pipeline.finish(pending)
        except Exception as exc:
            pipeline.release(pending)
            raise self._fault(worker, exc, None, pending.samples) from None
        self._record(int(y.shape[0]), ExecutionTimes(input_ns, infer_ns, output_ns))
        return y

    def _record(self, size: int, times: ExecutionTimes) -> None:
        self._stats.record_execution(size, times.input_ns, times.infer_ns, times.output_ns)
        self._metrics.series.compute_duration.observe(times.infer_ns / 1e9)
        self._metrics.series.batch_size.observe(size)

    # --- faults ----------------------------------------------------------------------------

    def lost_error(self) -> ServingError:
        return ServingError(Status.UNAVAILABLE, f"{', '.join(self.devices)} failed ({self.device_lost}); "
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
            return ServingError(Status.UNAVAILABLE, f"execution on {device} failed and the device "
                                f"cannot recover ({problem}); retry on another replica")
        if oom:
            return ServingError(Status.RESOURCE_EXHAUSTED, f"{device} ran out of memory executing {what}; "
                                f"retry later or with fewer samples")
        return ServingError(Status.INTERNAL, f"execution on {device} failed ({type(exc).__name__}); "
                            f"the server recovered and serves further requests")

    async def close(self) -> None:
        await self.batcher.close()
        for worker in self.workers:
            worker.shutdown()
