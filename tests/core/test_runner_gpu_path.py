"""The runner's GPU path (server/core/runner.py: _execute_gpu, _collect) with a stand-in pipeline
(voxserve/testing/fake_pipeline.py), so it runs without a GPU: executions enqueued without waiting for the one
before and collected in order, a batch split into several executions joined back, a failed enqueue or a failed
execution answered with its error while the others are served, and nothing left counted in flight.
tests/core/test_pipeline_gpu.py runs the same path against the real pipeline."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from voxserve.server.core.batching import BatchingConfig
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.core.runner import Runner
from voxserve.server.core.stats import ModelStats
from voxserve.server.metrics import Metrics
from voxserve.testing.fake_pipeline import FakeGpuModel, expected


@pytest.fixture(params=[False, True], ids=["submit thread", "enqueue on the loop"])
def runner(request):
    model = FakeGpuModel(max_batch=8)
    runner = Runner([model], ModelStats(), Metrics("voxnet", gpu_metrics=False), BatchingConfig(True, 0.0, 4096),
                    enqueue_on_loop=request.param)
    yield runner
    asyncio.run(runner.close())
    model.pipeline.close()


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
            deadline = time.monotonic() + 10
            while pipeline.finished < executions:
                assert time.monotonic() < deadline, "timed out"
                time.sleep(0.001)
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
