"""Dynamic batching: concurrent requests of equal sample shape and datatype run as one execution.

A bounded queue of requests, grouped by (Cin, D, H, W, datatype). One loop forms batches: it takes
the group whose oldest request waited longest, waits up to ``max_delay_s`` (from that request's
arrival) for ``max_batch`` samples to gather, and hands the batch (the requests' own arrays, not a
copy) to the runner. While the runner is busy, new requests queue up, so under load batches grow by
themselves. A request larger
than ``max_batch`` runs alone (the runner splits it into executions of at most ``max_batch``).
Expired requests are answered DeadlineExceeded without running; cancelled ones are dropped.
No gRPC here: the service maps the exceptions to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np


class QueueFull(Exception):
    """The queue holds its maximum number of requests."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before it could run."""


class _Item:
    """One queued request (a plain class with slots: one is made per request, on the hot path)."""

    __slots__ = ("array", "arrived_ns", "deadline", "future", "samples")

    def __init__(self, array: np.ndarray, deadline: float | None, future: asyncio.Future) -> None:
        self.array = array
        self.deadline = deadline  # loop.time() by which the answer is due
        self.future = future
        self.arrived_ns = time.perf_counter_ns()
        self.samples = int(array.shape[0])


@dataclass(frozen=True)
class BatchResult:
    output: np.ndarray  # this request's rows of the batch output
    queue_ns: int  # arrival -> its batch started executing
    batch_samples: int  # samples in the execution it was part of


class DynamicBatcher:
    """``execute(arrays, datatype)`` runs one batch (a list of request arrays with equal sample shapes) and
    returns its output rows in order; up to ``max_inflight`` batches run at once (a pipelined device takes
    the next batch while one computes). A batch is formed only when it can start, so under load it
    gathers everything that queued meanwhile. With ``overlap_bytes``, once ``devices`` batches run, a further
    batch starts beside them only when it holds that many bytes; a smaller one waits for one of them to
    finish, and grows meanwhile. ``on_depth(requests waiting)`` is called once per event-loop iteration in
    which the depth changed; ``on_queued(ns)`` with each answered request's wait from arrival to execution."""

    def __init__(self, execute: Callable[[list[np.ndarray], str], Awaitable[np.ndarray]], *, max_batch: int,
                 max_delay_s: float, max_queue: int, enabled: bool = True, max_inflight: int = 1,
                 overlap_bytes: int = 0, devices: int = 1, on_depth: Callable[[int], None] | None = None,
                 on_queued: Callable[[int], None] | None = None) -> None:
        self._execute = execute
        self._slots = asyncio.Semaphore(max_inflight)
        self._running: set[asyncio.Task] = set()
        self._executing = 0  # batches started and not finished
        self.overlap_bytes = overlap_bytes
        self.devices = devices  # batches that run side by side without overlapping on one device
        self.max_batch, self.max_delay_s, self.max_queue, self.enabled = max_batch, max_delay_s, max_queue, enabled
        self._on_depth = on_depth or (lambda depth: None)
        self._depth_due = False
        self._on_queued = on_queued or (lambda queue_ns: None)
        self._groups: OrderedDict[tuple, deque[_Item]] = OrderedDict()
        self._queued = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def depth(self) -> int:
        """Requests waiting (not yet executing)."""
        return self._queued

    def admit(self) -> None:
        """QueueFull, naming the limit, when the queue holds its maximum number of requests."""
        if self._queued >= self.max_queue:
            raise QueueFull(f"the queue holds {self._queued} requests, its limit (--max-queue-size {self.max_queue})")

    async def submit(self, array: np.ndarray, datatype: str, timeout_s: float | None = None) -> BatchResult:
        """Queue one request's (N, Cin, D, H, W) array; QueueFull at once when the queue is full."""
        return await self.enqueue(array, datatype, timeout_s)  # a cancelled caller cancels the future: skipped

    def enqueue(self, array: np.ndarray, datatype: str, timeout_s: float | None = None) -> asyncio.Future:
        """``submit`` without a coroutine: the future of the request's BatchResult (cancel it to drop the
        request); QueueFull at once when the queue is full."""
        self.admit()
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._loop())
        item = _Item(array, None if timeout_s is None else loop.time() + timeout_s, loop.create_future())
        self._groups.setdefault((array.shape[1:], datatype), deque()).append(item)
        self._queued += 1
        self._depth_changed(loop)
        self._wake.set()
        return item.future

    def _depth_changed(self, loop: asyncio.AbstractEventLoop) -> None:
        """Report the queue depth once per loop iteration, however many requests arrived in it."""
        if not self._depth_due:
            self._depth_due = True
            loop.call_soon(self._publish_depth)

    def _publish_depth(self) -> None:
        self._depth_due = False
        self._on_depth(self._queued)

    def _next_group(self) -> tuple | None:
        """The group whose head request arrived first."""
        live = [(q[0].arrived_ns, key) for key, q in self._groups.items() if q]
        return min(live)[1] if live else None

    def _take(self, key: tuple) -> list[_Item]:
        queue = self._groups[key]
        taken: list[_Item] = []
        samples = 0
        while queue:
            item = queue[0]
            if taken and (not self.enabled or samples + item.samples > self.max_batch):
                break
            queue.popleft()
            self._queued -= 1
            if item.future.done():  # cancelled while queued
                continue
            taken.append(item)
            samples += item.samples
            if not self.enabled:
                break
        if not queue:
            del self._groups[key]
        self._depth_changed(asyncio.get_running_loop())
        return taken

    async def _gather(self, key: tuple) -> None:
        """Wait, up to max_delay_s after the head request arrived, for a full batch of this group."""
        loop = asyncio.get_running_loop()
        queue = self._groups[key]
        head_wait_s = (time.perf_counter_ns() - queue[0].arrived_ns) / 1e9
        deadline = loop.time() + max(0.0, self.max_delay_s - head_wait_s)
        while sum(i.samples for i in queue) < self.max_batch:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def _grow(self, key: tuple) -> None:
        """While every device executes a batch, hold this group's batch back until it holds ``overlap_bytes``
        (enough that its transfers are worth overlapping with a running batch) or a device is free. A small
        batch gains nothing by starting early on a device that runs one batch at a time, and each execution
        costs host time: waiting lets it grow instead."""
        while self._executing >= self.devices and key in self._groups:
            if sum(i.array.nbytes for i in self._groups[key]) >= self.overlap_bytes:
                return
            self._wake.clear()
            await self._wake.wait()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            key = self._next_group()
            if key is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._slots.acquire()  # form the batch only when it can start
            if self.enabled and self.overlap_bytes and self._executing >= self.devices:
                await self._grow(key)
            if self.enabled and self.max_delay_s > 0:
                await self._gather(key)
            if key not in self._groups:
                self._slots.release()
                continue
            items = self._take(key)
            now = loop.time()
            runnable = []
            for item in items:
                if item.deadline is not None and now >= item.deadline:
                    item.future.set_exception(DeadlineExceeded("the request's deadline passed while it was queued"))
                else:
                    runnable.append(item)
            if not runnable:
                self._slots.release()
                continue
            self._executing += 1
            task = loop.create_task(self._run(key[1], runnable))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, datatype: str, items: list[_Item]) -> None:
        started = time.perf_counter_ns()
        try:
            output = await self._execute([i.array for i in items], datatype)
        except Exception as exc:
            for item in items:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        finally:
            self._executing -= 1
            self._slots.release()
            self._wake.set()  # a batch held back for growth may start now
        samples = sum(i.samples for i in items)
        offset = 0
        for item in items:
            rows = output[offset : offset + item.samples]
            offset += item.samples
            if not item.future.done():
                item.future.set_result(BatchResult(rows, started - item.arrived_ns, samples))
                self._on_queued(started - item.arrived_ns)

    async def close(self) -> None:
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
