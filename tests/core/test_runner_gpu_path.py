"""The runner's GPU path (server/core/runner.py: _execute_gpu, _collect) with a stand-in pipeline
(voxserve/testing/fake_pipeline.py), so it runs without a GPU: executions enqueued without waiting for the one
before and collected in order, a batch split into several executions joined back, a failed enqueue or a failed
execution answered with its error while the others are served, and nothing left counted in flight.
tests/core/test_pipeline_gpu.py runs the same path against the real pipeline."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading

import numpy as np
import pytest

try:
    import uvloop
except ImportError:  # (the test extra installs it)
    uvloop = None

from voxserve.server.core.batching import BatchingConfig
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.core.runner import Runner
from voxserve.server.core.stats import ModelStats
from voxserve.server.metrics import Metrics
from voxserve.testing.fake_pipeline import FakeGpuModel, expected

from ..e2e.test_lifecycle import _wait_for  # (blocking: the event loop does not run meanwhile)


def _runner(enqueue_on_loop: bool, depth: int) -> Runner:
    return Runner([FakeGpuModel(max_batch=8, depth=depth)], ModelStats(), Metrics("voxnet", gpu_metrics=False),
                  BatchingConfig(True, 0.0, 4096), enqueue_on_loop=enqueue_on_loop)


def _closed(runner: Runner) -> None:
    """Close ``runner`` and its pipeline: every slot is back, none was read or released after it came back."""
    pipeline = runner.model.gpu_pipeline
    asyncio.run(runner.close())
    pipeline.close()
    assert not pipeline.violations
    assert pipeline.free_slots == pipeline.depth


@pytest.fixture(params=[False, True], ids=["submit thread", "enqueue on the loop"])
def runner(request):
    runner = _runner(request.param, depth=4)  # (slots for each execution of a call: none waits for one)
    yield runner
    _closed(runner)


def _inputs(sizes) -> list[np.ndarray]:
    rng = np.random.default_rng()
    return [rng.standard_normal((n, 3, 2, 2, 2), dtype=np.float32) for n in sizes]


def test_requests_of_every_size_are_answered_in_order_and_nothing_stays_in_flight(runner):
    """Batch 1 to beyond max_batch (split into executions of at most 8 samples), many at once: each request gets
    its own rows, every execution is collected, and no execution is left counted as in flight."""
    pipeline = runner.model.gpu_pipeline
    xs = _inputs([1, 3, 8, 9, 20, 1, 1, 5, 16, 2] * 3)

    async def go():
        return await asyncio.gather(*(runner.run(x, "FP32") for x in xs))

    results = asyncio.run(go())
    for x, result in zip(xs, results, strict=True):
        np.testing.assert_array_equal(result.output, expected(x))
    assert max(pipeline.submitted) <= 8 and sum(pipeline.submitted) == sum(len(x) for x in xs)
    assert runner.workers[0].inflight == 0 and runner.workers[0].submitting == 0 and pipeline.released == 0


@pytest.mark.parametrize("failure", ["enqueue", "execution"])
def test_a_failed_execution_is_answered_with_its_error_and_the_others_are_served(runner, failure):
    """An execution that fails (its enqueue, or on the device) answers its requests INTERNAL (the device recovered)
    and releases its slot; requests in other executions, before and after, are served."""
    pipeline = runner.model.gpu_pipeline
    (pipeline.fail_submit if failure == "enqueue" else pipeline.fail_event).add(7)
    good, bad = _inputs([3, 7])

    async def go():
        first = await runner.run(good, "FP32")
        with pytest.raises(ServingError) as err:
            await runner.run(bad, "FP32")
        after = await runner.run(good, "FP32")
        return first, err.value, after

    first, err, after = asyncio.run(go())
    assert err.code == Status.INTERNAL and "recovered" in err.message
    np.testing.assert_array_equal(first.output, expected(good))
    np.testing.assert_array_equal(after.output, expected(good))
    assert runner.model.recovered == 1 and pipeline.released == (1 if failure == "execution" else 0)
    assert runner.workers[0].inflight == 0


def test_one_failed_execution_of_a_split_request_fails_the_request_and_every_execution_is_collected(runner):
    """A 20-sample request runs as executions of 8, 8 and 4: the 4's failure fails the request, and the two that
    succeeded are still collected (their slots back), nothing in flight."""
    pipeline = runner.model.gpu_pipeline
    pipeline.fail_event.add(4)
    (x,) = _inputs([20])

    async def go():
        with pytest.raises(ServingError):
            await runner.run(x, "FP32")

    asyncio.run(go())
    assert pipeline.submitted == [8, 8, 4] and pipeline.released == 1 and runner.workers[0].inflight == 0


def test_several_executions_of_one_call_are_collected_together_and_joined_in_order(runner):
    """The runner split into executions of at most max_batch itself (the batcher hands it at most that many, so
    only a direct call takes this path): 20 samples run as 8, 8 and 4, joined back in order; nothing in flight."""
    pipeline = runner.model.gpu_pipeline
    (x,) = _inputs([20])
    out = asyncio.run(runner._execute([x[:5], x[5:20]], "FP32"))
    np.testing.assert_array_equal(out, expected(x))
    assert pipeline.submitted == [8, 8, 4] and runner.workers[0].inflight == 0


async def _until(condition, timeout_s: float = 10.0) -> None:
    """Wait on the loop until ``condition()`` holds; a test that would hang fails instead."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("sizes", [[8], [5, 15]], ids=["one execution", "three executions"])
@pytest.mark.parametrize("where", ["while they run", "during the last enqueue", "once they have finished"])
def test_a_cancelled_execution_leaves_nothing_in_flight_and_its_slots_come_back(runner, sizes, where):
    """Cancelled (a shutdown) while its executions run, while the submit thread enqueues the last of them, or once
    they have finished but before they are collected, a call ends at once: its executions no longer count as in
    flight (the least busy device is chosen by that count), and each slot comes back once the device has
    finished with it (an enqueue the cancel interrupted runs to its end first, and nothing is enqueued on the
    loop beside it meanwhile)."""
    pipeline = runner.model.gpu_pipeline
    worker = runner.workers[0]
    arrays = _inputs(sizes)
    executions = -(-sum(sizes) // 8)
    if where == "during the last enqueue":
        if runner.enqueue_on_loop:
            pytest.skip("the loop enqueues these itself: nothing runs to be cancelled during an enqueue")
        pipeline.gated.add(sum(sizes) - 8 * (executions - 1))
    pipeline.hold.clear()  # the stream waits: the executions stay running

    async def go():
        task = asyncio.ensure_future(runner._execute(arrays, "FP32"))
        await _until(lambda: len(pipeline.submitted) == executions)
        if where != "during the last enqueue":
            await _until(lambda: pipeline.enqueued == executions)
        if where == "once they have finished":  # waited for without letting the loop see their ends
            pipeline.hold.set()
            _wait_for(lambda: pipeline.finished == executions, 10, "the executions to end")
        else:
            assert pipeline.released == 0
        assert worker.inflight > 0
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=10)
        assert done, "the cancelled call went on"
        with pytest.raises(asyncio.CancelledError):
            task.result()
        assert worker.inflight == 0
        pipeline.gate.set()
        pipeline.hold.set()
        await _until(lambda: pipeline.released == executions and worker.submitting == 0)
        assert pipeline.finished == executions

    try:
        asyncio.run(go())
    finally:
        pipeline.gate.set()
        pipeline.hold.set()


LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run} if uvloop is not None else {"asyncio": asyncio.run}


@pytest.mark.parametrize("run", LOOPS.values(), ids=LOOPS.keys())
@pytest.mark.parametrize("enqueue_on_loop", [False, True], ids=["submit thread", "enqueue on the loop"])
def test_a_cancel_just_ahead_of_the_devices_wake_up_reads_no_slot_that_came_back(enqueue_on_loop, run):
    """Two slots, a call of three executions: the third waits on the submit thread for a slot. The first two end,
    and the cancel comes from an I/O callback that runs just ahead of the watcher's wake-up (both ready in one
    turn of the loop): the watcher has ended their futures but their collects have yet to run. Their slots come
    back (the waiting enqueue takes one at once), so the collects must not then read them: cancelled with the
    call, they finish nothing; the third execution's slot comes back once it has ended."""
    runner = _runner(enqueue_on_loop, depth=2)
    pipeline, worker = runner.model.gpu_pipeline, runner.workers[0]
    pipeline.hold.clear()
    other = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    async def go():
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(runner._execute(_inputs([5, 15]), "FP32"))

        def cancel() -> None:
            loop.remove_reader(other)
            task.cancel()

        loop.add_reader(other, cancel)
        await _until(lambda: pipeline.waiting == 1)  # the third enqueue, for a slot
        os.eventfd_write(other, 1)  # ready first
        pipeline.hold.set()
        _wait_for(lambda: pipeline.finished == 2, 10, "two executions to end")  # their wake-ups, in the same turn
        done, _ = await asyncio.wait([task], timeout=10)
        assert done and task.cancelled()
        await _until(lambda: pipeline.finished == 3 and pipeline.free_slots == 2 and worker.submitting == 0)
        assert worker.inflight == 0 and not pipeline.violations

    try:
        run(go())
    finally:
        pipeline.hold.set()
        os.close(other)
        _closed(runner)


def test_a_cancelled_call_whose_executions_failed_logs_no_error_nobody_retrieved(caplog):
    """The first two executions of a call fail on the device and are collected (the call keeps their errors), then
    the call is cancelled during its last enqueue: nobody is told of those errors, and asyncio logs none of them
    as never retrieved."""
    runner = _runner(False, depth=4)
    pipeline = runner.model.gpu_pipeline
    pipeline.fail_event.add(8)
    pipeline.gated.add(4)

    async def go():
        task = asyncio.ensure_future(runner._execute(_inputs([5, 15]), "FP32"))
        await _until(lambda: len(pipeline.submitted) == 3 and pipeline.released == 2)  # the failures collected
        await asyncio.sleep(0.01)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=10)
        assert done and task.cancelled()
        pipeline.gate.set()
        await _until(lambda: pipeline.free_slots == 4 and runner.workers[0].submitting == 0)

    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio.run(go())
            gc.collect()
    finally:
        pipeline.gate.set()
        _closed(runner)
    assert runner.model.recovered == 2
    assert not [r for r in caplog.records if r.name == "asyncio"], [r.getMessage() for r in caplog.records]


def test_closing_while_an_enqueue_waits_for_a_slot_ends_and_every_slot_comes_back():
    """A shutdown while the submit thread waits for a slot held by a cancelled call's execution: closing the runner
    waited for the thread, on the event loop, and the slot could only come back from the loop (the watcher hears
    of the execution's end there): it never did, and the process hung on its way out. The watcher is closed first
    now (it waits for what is in flight itself and gives back the cancelled executions' slots), then the thread."""
    runner = _runner(False, depth=2)
    pipeline, worker = runner.model.gpu_pipeline, runner.workers[0]
    pipeline.hold.clear()  # the first two executions run until the device is let go below

    async def go():
        task = asyncio.ensure_future(runner._execute(_inputs([5, 15]), "FP32"))
        await _until(lambda: pipeline.waiting == 1)  # the third enqueue, for a slot
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=10)
        assert done and task.cancelled()
        threading.Timer(0.2, pipeline.hold.set).start()  # the device finishes them a moment later
        await runner.close()

    closing = threading.Thread(target=asyncio.run, args=(go(),), daemon=True)
    closing.start()
    closing.join(15)
    hung = closing.is_alive()
    if hung:  # let the thread go (a slot it can take), so that the test process can end
        pipeline.hold.set()
        pipeline._free.put(-1)
        closing.join(15)
    assert not hung, "closing the runner hung"
    assert pipeline.finished == 3 and worker.submitting == 0 and worker.inflight == 0
    pipeline.close()
    assert not pipeline.violations and pipeline.free_slots == 2
