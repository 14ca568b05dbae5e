"""The batcher when executions fail, are cancelled or are cut short by close(): every request is answered (never left
pending), only once nothing of it executes any more (or cancelled, where it may still), and the batcher's own
accounting (executions, slots, depth) comes back to rest. Executions are held by events: no timing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from voxserve.server.core.batching import DeadlineExceeded, DynamicBatcher, Stopped
from voxserve.server.core.errors import Status, runner_error


def _x(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((n, 3, 2, 2, 2), value, np.float32)


class _Held:
    """An execute() whose executions each wait for their own event; ``fail`` names the ones that raise."""

    def __init__(self) -> None:
        self.started: list[tuple[int, asyncio.Event]] = []  # (samples, go on)
        self.fail: set[int] = set()  # indices (in start order) that raise once let go
        self.cancelled = 0

    async def __call__(self, arrays, datatype):
        index = len(self.started)
        go_on = asyncio.Event()
        self.started.append((sum(int(a.shape[0]) for a in arrays), go_on))
        try:
            await go_on.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if index in self.fail:
            raise RuntimeError(f"execution {index} failed")
        batch = np.concatenate(arrays)
        return batch.reshape(batch.shape[0], -1).sum(axis=1, keepdims=True)

    def release(self, index: int) -> None:
        self.started[index][1].set()

    def release_all(self) -> None:
        for _, event in self.started:
            event.set()


async def _until(predicate, turns: int = 200) -> None:
    """Let the loop run until ``predicate()`` holds (loop turns, not time)."""
    for _ in range(turns):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def _turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _at_rest(batcher: DynamicBatcher, max_inflight: int) -> None:
    await _turns()  # (a finished task leaves the running set in a callback)
    assert batcher._executing == 0 and not batcher._running
    assert batcher._slots._value == max_inflight  # every slot given back
    assert batcher.depth == 0


def _make(max_inflight: int = 2, max_batch: int = 2,
          fail: frozenset[int] = frozenset()) -> tuple[_Held, DynamicBatcher]:
    """A held model (``fail``: the executions that raise) and a batcher over it."""
    model = _Held()
    model.fail = set(fail)
    return model, DynamicBatcher(model, max_batch=max_batch, max_delay_s=0.0, max_queue=8, max_inflight=max_inflight)


def _run(body, **options) -> None:
    """``body(model, batcher)`` on a fresh pair (``_make``'s options); whatever happens, every execution is let go and
    the batcher closed."""
    async def go():
        model, batcher = _make(**options)
        try:
            await body(model, batcher)
        finally:
            model.release_all()
            await batcher.close()

    asyncio.run(go())


def test_a_failure_in_the_last_formed_chunk_waits_for_an_earlier_one_still_running():
    async def body(model, batcher):
        answer = batcher.enqueue(_x(6), "FP32")
        await _until(lambda: len(model.started) == 2)
        model.release(1)  # the later chunk fails while chunk 0 still runs
        await _turns()
        assert not answer.done(), "answered while chunk 0 still executes"
        model.release(0)
        await _until(answer.done)
        with pytest.raises(RuntimeError, match="execution 1 failed"):
            answer.result()
        await _turns()
        assert len(model.started) == 2  # its third chunk never ran
        await _at_rest(batcher, 2)

    _run(body, fail=frozenset({1}))


def test_one_processor_a_failing_chunk_answers_at_once_and_the_next_request_runs():
    async def body(model, batcher):
        large = batcher.enqueue(_x(6), "FP32")
        await _until(lambda: len(model.started) == 1)
        small = batcher.enqueue(_x(1, 2.0), "FP32")
        model.release(0)
        await _until(large.done)
        assert isinstance(large.exception(), RuntimeError)
        await _until(lambda: len(model.started) == 2)
        assert model.started[1][0] == 1  # the small request, not the large one's next chunk
        model.release(1)
        assert (await small).output[0, 0] == 2.0 * 24
        await _turns()
        assert len(model.started) == 2
        await _at_rest(batcher, 1)

    _run(body, max_inflight=1, fail=frozenset({0}))


def test_interleaved_large_requests_one_fails_the_other_gets_its_own_rows():
    async def body(model, batcher):
        first = batcher.enqueue(_x(4, 1.0), "FP32")
        second = batcher.enqueue(_x(4, 3.0), "FP32")
        # first's chunks 0 and 1 run; after each finishes the lane's head goes on
        await _until(lambda: len(model.started) == 2)
        model.fail = {0}
        model.release(0)  # first fails while its chunk 1 runs
        await _until(lambda: len(model.started) == 3)  # second's chunk 0 takes the slot
        assert not first.done()
        model.release(1)
        await _until(first.done)
        assert isinstance(first.exception(), RuntimeError)
        await _until(lambda: len(model.started) == 4)
        model.release(2)
        model.release(3)
        result = await second
        assert np.array_equal(result.output[:, 0], np.full(4, 3.0 * 24, np.float32))
        await _at_rest(batcher, 2)

    _run(body)


def test_cancelled_by_its_caller_while_chunks_run_then_one_fails():
    async def body(model, batcher):
        answer = batcher.enqueue(_x(6), "FP32")
        await _until(lambda: len(model.started) == 2)
        answer.cancel()
        model.release(0)
        model.release(1)
        await _turns()
        assert len(model.started) == 2  # its third chunk never ran
        await _at_rest(batcher, 2)

    _run(body, fail=frozenset({0}))


def test_the_deadline_passes_while_no_chunk_of_it_runs():
    """Another request's execution holds the only slot; the large request's deadline passes meanwhile (after its first
    chunk): it is answered DeadlineExceeded when its turn comes, with nothing of it running."""
    async def body(model, batcher):
        loop = asyncio.get_running_loop()
        large = batcher.enqueue(_x(6), "FP32", timeout_s=3600.0)
        await _until(lambda: len(model.started) == 1)
        small = batcher.enqueue(_x(1), "FP32")
        model.release(0)  # chunk 0 done; the small request goes first
        await _until(lambda: len(model.started) == 2)
        batcher._large[0].deadline = loop.time()  # (its deadline passes while the small one runs)
        model.release(1)
        await small
        await _until(large.done)
        assert isinstance(large.exception(), DeadlineExceeded)
        assert len(model.started) == 2
        await _at_rest(batcher, 1)

    _run(body, max_inflight=1)


def test_close_with_a_failed_large_request_whose_other_chunk_runs_answers_it():
    async def go():
        model, batcher = _make(fail=frozenset({0}))
        answer = batcher.enqueue(_x(6), "FP32")
        await _until(lambda: len(model.started) == 2)
        model.release(0)
        await _turns()
        closing = asyncio.ensure_future(batcher.close())
        await _turns()
        assert not answer.done() and not closing.done()  # chunk 1 still runs: close waits for it
        model.release(1)
        await closing
        assert isinstance(answer.exception(), RuntimeError)
        assert len(model.started) == 2

    asyncio.run(go())


def test_a_chunk_cancelled_while_its_sibling_failed_still_answers_the_request():
    """Chunk 0 fails while chunk 1 runs (the answer waits for it); then chunk 1's task is cancelled (a shutdown that
    stops waiting for close()). The request must still be answered: cancelled, as its execution may go on."""
    async def go():
        model, batcher = _make(fail=frozenset({0}))
        answer = batcher.enqueue(_x(6), "FP32")
        await _until(lambda: len(model.started) == 2)
        model.release(0)
        await _turns()
        assert not answer.done()
        closing = asyncio.ensure_future(batcher.close())
        await _turns()
        closing.cancel()  # cancels the gather, and with it the running chunk's task
        with pytest.raises(asyncio.CancelledError):
            await closing
        await _turns()
        done = answer.done()
        model.release_all()
        await batcher.close()
        return done, model.cancelled

    done, cancelled = asyncio.run(go())
    assert cancelled == 1  # (the chunk's execution was cancelled indeed)
    assert done, "the request is never answered"


def test_a_cancelled_batch_task_answers_its_requests():
    async def go():
        model, batcher = _make(max_inflight=1, max_batch=8)
        answer = batcher.enqueue(_x(2), "FP32")
        await _until(lambda: len(model.started) == 1)
        closing = asyncio.ensure_future(batcher.close())
        await _turns()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await _turns()
        done = answer.done()
        model.release_all()
        await batcher.close()
        return done

    assert asyncio.run(go()), "the request is never answered"


def test_close_waits_for_every_execution_including_one_formed_while_it_waited():
    """close() waits for the executions running when it was called; one formed meanwhile (the large request's next
    chunk, started when a slot came free) must be waited for too: after close() the server unmaps every client
    region (cudashm.py close: 'its executions are over')."""
    async def go():
        model, batcher = _make()
        answer = batcher.enqueue(_x(6), "FP32")
        await _until(lambda: len(model.started) == 2)
        closing = asyncio.ensure_future(batcher.close())
        await _turns()
        model.release(0)
        model.release(1)
        await _turns()
        returned_with_one_running = closing.done() and any(not e.is_set() for _, e in model.started)
        model.release_all()
        await _turns()
        if not closing.done():
            await closing
        await _turns()
        return returned_with_one_running, batcher._executing, answer

    returned_with_one_running, executing, answer = asyncio.run(go())
    assert not returned_with_one_running, "close() returned while an execution still ran"
    assert executing == 0
    assert answer.done()


def test_close_answers_the_requests_still_queued():
    async def go():
        model, batcher = _make(max_inflight=1)
        running = batcher.enqueue(_x(1), "FP32")
        await _until(lambda: len(model.started) == 1)
        queued = [batcher.enqueue(_x(1), "FP32"), batcher.enqueue(_x(5), "FP32")]
        closing = asyncio.ensure_future(batcher.close())
        await _turns()
        model.release(0)
        await closing
        await _turns()
        return running, queued, len(model.started)

    running, queued, executions = asyncio.run(go())
    assert running.result().output.shape == (1, 1)
    assert executions == 1  # nothing starts once close() was called
    assert all(f.done() for f in queued), "a request queued at close() is never answered"


def test_a_request_after_close_is_refused_not_left_waiting():
    async def go():
        _model, batcher = _make()
        await batcher.close()
        with pytest.raises(Stopped):
            batcher.enqueue(_x(1), "FP32")
        return runner_error(Stopped("its executions have stopped"), "voxnet")

    error = asyncio.run(go())
    assert error is not None and error.code == Status.UNAVAILABLE and "retry on another replica" in error.message
