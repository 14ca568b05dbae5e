"""Dynamic batching: concurrent requests of equal sample shape and datatype run as one execution.

A bounded queue of requests in lanes: a group per (Cin, D, H, W, datatype) for requests of at most
``max_batch`` samples, and one lane for the larger ones whatever their shape, each FIFO. One loop forms
batches, each when a slot is free, from the lane whose turn comes first: a group's turn is its head's
arrival; the large lane's is the later of its head's arrival and the last time one of its chunks was
formed or finished (ties go to the group). From a group the loop waits up to ``max_delay_s`` (from the
head's arrival) for ``max_batch`` samples to gather, and hands the batch (the requests' own arrays, not
a copy) to the runner. While the runner is busy, new requests queue up, so under load batches grow by
themselves. A large request runs as chunks of ``max_batch`` samples (views), one execution each, never
merged with others; its answer is its chunks' rows in order once all have finished. So every execution
holds at most ``max_batch`` samples, and after each chunk the large lane gives way to whatever arrived
before.

The bound: a request of at most ``max_batch`` samples starts executing after at most
  - the executions already started when it arrived (at most ``max_inflight``),
  - one batch per request of at most ``max_batch`` samples that arrived before it and was still queued
    (fewer where they merge: each batch is led by one of them),
  - one chunk of large requests, however many and however large they are; none when it arrives while
    a chunk holds the only slot (``max_inflight`` 1, the CPU), since that chunk's finish is the large
    lane's turn,
plus its own batch's waits to fill (``max_delay_s``) or to grow (``overlap_bytes``: until a running
execution finishes). Forming a chunk moves the large lane's turn past every request queued then, so
no second chunk comes before them. Nor is the large lane starved: between two of its chunks only
batches led by requests that arrived before its turn run. Large requests start, and on a device that
finishes executions in order complete, first come first served among themselves.

Expired requests are answered DeadlineExceeded without running, and a large one whose deadline passes
between chunks runs no further chunk; cancelled ones are dropped, and so are the remaining chunks of a
cancelled large one. A failing chunk fails its request, whose remaining chunks do not run; a large request that
fails (or expires) is answered once its chunks still executing are over, as they use its memory. An execution
whose task is cancelled (a shutdown) cancels its requests, as it may go on; ``close()`` lets nothing more start,
waits for the executions running and cancels what is still queued. No gRPC here: the service maps the exceptions
to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from .devicemem import DeviceArray

Tensor = np.ndarray | DeviceArray  # a request's input: its bytes on the host, or where it lies on a device


class QueueFull(Exception):
    """The queue holds its maximum number of requests."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before it could run."""


class Stopped(Exception):
    """The batcher was closed: it runs nothing more."""


class _Item:
    """One queued request (a plain class with slots: one is made per request, on the hot path)."""

    __slots__ = ("array", "arrived_ns", "deadline", "future", "samples")

    def __init__(self, array: Tensor, deadline: float | None, future: asyncio.Future) -> None:
        self.array = array
        self.deadline = deadline  # loop.time() by which the answer is due
        self.future = future
        self.arrived_ns = time.perf_counter_ns()
        self.samples = int(array.shape[0])


class _Large(_Item):
    """A request larger than max_batch: chunks of max_batch samples, formed in order, finished in any order."""

    __slots__ = ("datatype", "error", "finished", "formed", "outputs", "running", "started_ns")

    def __init__(self, array: Tensor, deadline: float | None, future: asyncio.Future, datatype: str,
                 chunks: int) -> None:
        super().__init__(array, deadline, future)
        self.datatype = datatype
        self.formed = 0  # chunks handed to execute
        self.finished = 0  # chunks whose output is in
        self.running = 0  # chunks executing now
        self.outputs: list = [None] * chunks  # by chunk index
        self.started_ns = 0  # when its first chunk started executing
        self.error: BaseException | None = None  # why it failed: answered once none of its chunks runs any more

    def fail(self, error: BaseException) -> None:
        """Fail the request: no further chunk of it runs, and it is answered with ``error`` (the first one) once
        its chunks still executing are over: until then they read its input and write its output, which may lie
        in the client's own memory (shared memory), so the client must not be told it is done with it before."""
        if self.error is None:
            self.error = error
        if self.running == 0 and not self.future.done():
            self.future.set_exception(self.error)


_LARGE = ("requests larger than max_batch",)  # the large lane's key: no (shape, datatype) group equals it


@dataclass(frozen=True)
class BatchingConfig:
    enabled: bool
    max_delay_s: float
    max_queue: int

    @classmethod
    def from_settings(cls, s) -> BatchingConfig:
        """--batching, --max-queue-delay-ms, --max-queue-size."""
        return cls(s.batching, s.max_queue_delay_ms / 1e3, s.max_queue_size)


@dataclass(frozen=True)
class BatchResult:
    output: np.ndarray  # this request's rows of the batch output
    queue_ns: int  # arrival -> its (first) batch started executing
    batch_samples: int  # samples in the (largest) execution it was part of


class DynamicBatcher:
    """``execute(arrays, datatype)`` runs one batch (a list of request arrays with equal sample shapes, at most
    ``max_batch`` samples) and returns its output rows in order; up to ``max_inflight``
    batches run at once (a pipelined device takes the next batch while one computes). A batch is formed
    only when it can start, so under load it gathers everything that queued meanwhile. With
    ``overlap_bytes``, once ``devices`` batches run, a further batch starts beside them only when it holds
    that many bytes; a smaller one waits for one of them to finish, and grows meanwhile. ``on_depth(requests
    waiting)`` is called once per event-loop iteration in which the depth changed; ``on_queued(ns)`` with
    each answered request's wait from arrival to execution. Requests larger than ``max_batch`` run in chunks
    between the others (see the module's docstring for the bound on any request's wait)."""

    def __init__(self, execute: Callable[[list[Tensor], str], Awaitable[np.ndarray]], *, max_batch: int,
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
        self._group_bytes: dict[tuple, int] = {}  # each group's arrays' bytes (cancelled ones until taken out)
        self._large: deque[_Large] = deque()
        self._large_turn_ns = 0  # the last time a chunk was formed or finished
        self._queued = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False  # close() was called

    @property
    def depth(self) -> int:
        """Requests waiting (not yet executing; a large one until its first chunk starts)."""
        return self._queued

    def admit(self) -> None:
        """QueueFull, naming the limit, when the queue holds its maximum number of requests; Stopped once closed."""
        if self._closed:
            raise Stopped("its executions have stopped (the server is shutting down)")
        if self._queued >= self.max_queue:
            raise QueueFull(f"the queue holds {self._queued} requests, its limit (--max-queue-size {self.max_queue})")

    async def submit(self, array: Tensor, datatype: str,
                     timeout_s: float | None = None) -> BatchResult:
        """Queue one request's (N, Cin, D, H, W) array; QueueFull at once when the queue is full."""
        return await self.enqueue(array, datatype, timeout_s)  # a cancelled caller cancels the future: skipped

    def enqueue(self, array: Tensor, datatype: str,
                timeout_s: float | None = None) -> asyncio.Future:
        """``submit`` without a coroutine: the future of the request's BatchResult (cancel it to drop the
        request); QueueFull at once when the queue is full."""
        self.admit()
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._loop())
        deadline = None if timeout_s is None else loop.time() + timeout_s
        if array.shape[0] > self.max_batch:
            self._large.append(_Large(array, deadline, loop.create_future(), datatype,
                                      -(-array.shape[0] // self.max_batch)))
            future = self._large[-1].future
        else:
            item = _Item(array, deadline, loop.create_future())
            # A tensor in a client's CUDA memory batches only with tensors on its device (its place).
            key = (array.shape[1:], datatype) if isinstance(array, np.ndarray) else (array.shape[1:], datatype,
                                                                                    array.place)
            self._groups.setdefault(key, deque()).append(item)
            self._group_bytes[key] = self._group_bytes.get(key, 0) + array.nbytes
            future = item.future
        self._queued += 1
        self._depth_changed(loop)
        self._wake.set()
        return future

    def _depth_changed(self, loop: asyncio.AbstractEventLoop) -> None:
        """Report the queue depth once per loop iteration, however many requests arrived in it."""
        if not self._depth_due:
            self._depth_due = True
            loop.call_soon(self._publish_depth)

    def _publish_depth(self) -> None:
        self._depth_due = False
        self._on_depth(self._queued)

    def _next_group(self) -> tuple | None:
        """The lane whose turn comes first: the group whose head arrived first, unless the large lane's turn is
        earlier still (ties go to the group)."""
        key = None
        first_ns = 0
        for k, queue in self._groups.items():
            if queue and (key is None or queue[0].arrived_ns < first_ns):
                key, first_ns = k, queue[0].arrived_ns
        if self._large and (key is None or max(self._large[0].arrived_ns, self._large_turn_ns) < first_ns):
            return _LARGE
        return key

    def _take(self, key: tuple) -> list[_Item]:
        queue = self._groups[key]
        taken: list[_Item] = []
        samples = 0
        while queue:
            item = queue[0]
            if taken and (not self.enabled or samples + item.samples > self.max_batch):
                break
            queue.popleft()
            self._group_bytes[key] -= item.array.nbytes
            self._queued -= 1
            if item.future.done():  # cancelled while queued
                continue
            taken.append(item)
            samples += item.samples
            if not self.enabled:
                break
        if not queue:
            del self._groups[key], self._group_bytes[key]
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
            if self._group_bytes[key] >= self.overlap_bytes:
                return
            self._wake.clear()
            await self._wake.wait()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._groups and not self._large:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._slots.acquire()  # form the batch only when it can start, from the lane due then
            key = self._next_group()
            if key is _LARGE:
                self._start_chunk(loop)
                continue
            # a chunk is always max_batch samples (but the last): it can neither grow nor gather
            if key is not None and self.enabled and self.overlap_bytes and self._executing >= self.devices:
                await self._grow(key)
            if key is not None and self.enabled and self.max_delay_s > 0:
                await self._gather(key)
            if key is None or key not in self._groups:
                self._slots.release()
                continue
            self._start_batch(loop, key)

    def _start_batch(self, loop: asyncio.AbstractEventLoop, key: tuple) -> None:
        """Take ``key``'s group and start executing it (holding one slot); those past their deadline are answered
        DeadlineExceeded. A method of its own so that, between batches, no local of the loop keeps the last
        batch's requests (and their arrays: a shared-memory copy is counted until freed) alive."""
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
            return
        self._executing += 1
        task = loop.create_task(self._run(key[1], runnable))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _start_chunk(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the next chunk of the large lane's head (holding one slot), dropping the heads that are done:
        cancelled, failed in an earlier chunk, or past their deadline."""
        lane = self._large
        now = loop.time()
        while lane:
            item = lane[0]
            expired = item.deadline is not None and now >= item.deadline
            if item.future.done() or item.error is not None or expired:
                lane.popleft()
                if item.formed == 0:
                    self._queued -= 1
                    self._depth_changed(loop)
                if expired and not item.future.done():
                    item.fail(DeadlineExceeded(
                        "the request's deadline passed while it was queued" if item.formed == 0 else
                        f"the request's deadline passed after {item.formed} of its {len(item.outputs)} executions "
                        f"of at most {self.max_batch} samples"))
                continue
            index = item.formed
            item.formed += 1
            if item.formed == len(item.outputs):
                lane.popleft()
            if index == 0:
                self._queued -= 1
                self._depth_changed(loop)
            self._large_turn_ns = time.perf_counter_ns()
            self._executing += 1
            item.running += 1
            start = index * self.max_batch
            task = loop.create_task(self._run_chunk(item, index, item.array[start : start + self.max_batch]))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            return
        self._slots.release()

    async def _run(self, datatype: str, items: list[_Item]) -> None:
        started = time.perf_counter_ns()
        try:
            output = await self._execute([i.array for i in items], datatype)
        except Exception as exc:
            for item in items:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        except BaseException:  # cancelled (a shutdown): its execution may go on, so its requests are cancelled too
            for item in items:
                item.future.cancel()
            raise
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

    async def _run_chunk(self, item: _Large, index: int, chunk: Tensor) -> None:
        started = time.perf_counter_ns()
        if index == 0:
            item.started_ns = started
        failure: Exception | None = None
        try:
            output = await self._execute([chunk], item.datatype)
        except Exception as exc:
            failure = exc
        except BaseException:  # cancelled (a shutdown): its execution may go on, so its request is cancelled too
            item.future.cancel()
            raise
        finally:
            item.running -= 1
            self._executing -= 1
            self._large_turn_ns = time.perf_counter_ns()  # what arrived while it ran goes before the next chunk
            self._slots.release()
            self._wake.set()
        del chunk  # (its view of the request's memory: no longer read)
        error = failure if failure is not None else item.error
        if error is not None:  # its later chunks are dropped when they come up
            item.fail(error)
            return
        if item.future.done():  # cancelled meanwhile
            return
        item.outputs[index] = output
        item.finished += 1
        if item.finished == len(item.outputs):
            item.future.set_result(BatchResult(np.concatenate(item.outputs), item.started_ns - item.arrived_ns,
                                               self.max_batch))
            self._on_queued(item.started_ns - item.arrived_ns)

    async def close(self) -> None:
        """Stop forming executions, wait for those running, then cancel the requests still queued (none of them runs
        any more). Nothing forms while it waits: once it returns no execution reads a request's memory (the server
        then unmaps its clients' regions)."""
        self._closed = True  # what comes after is refused (Stopped), not queued for a loop that is gone
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        lanes: list[deque] = [*self._groups.values(), self._large]
        for lane in lanes:
            for item in lane:
                item.future.cancel()
        self._groups.clear()
        self._group_bytes.clear()
        self._large.clear()
        if self._queued:
            self._queued = 0
            self._on_depth(0)
