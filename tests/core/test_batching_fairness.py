"""Requests larger than max_batch run in chunks between the others: no head-of-line blocking behind them."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from voxserve.server.core.batching import DeadlineExceeded, DynamicBatcher
from voxserve.server.core.runner import split_executions

MAX_BATCH = 4
SHAPE = (3, 2, 2, 2)
OTHER_SHAPE = (3, 1, 2, 2)


def _request(owner: int, n: int, shape=SHAPE) -> np.ndarray:
    """n samples whose values name their request (owner * 1000) and their row (+ j)."""
    return (owner * 1000 + np.arange(n, dtype=np.float32)).reshape(n, 1, 1, 1, 1) * np.ones((1, *shape), np.float32)


def _per_sample(x: np.ndarray) -> np.ndarray:
    """The fake model: each sample's output row depends on that sample alone."""
    flat = x.reshape(x.shape[0], -1)
    return np.stack([flat[:, 0] * 2.0 + 1.0, flat.sum(axis=1)], axis=1)


def _owner(batch: np.ndarray) -> int:
    return int(batch.flat[0] // 1000)


class Device:
    """A fake ``execute``: splits a batch into executions of at most max_batch samples as the runner does,
    records each one as it starts, and finishes each only when the test releases its gate."""

    def __init__(self) -> None:
        self.started: list[np.ndarray] = []
        self.calls: list[int] = []  # samples per call of execute
        self.gates: asyncio.Queue[asyncio.Future] = asyncio.Queue()

    async def execute(self, arrays: list[np.ndarray], datatype: str) -> np.ndarray:
        self.calls.append(sum(a.shape[0] for a in arrays))
        outputs = []
        for ex in split_executions(arrays, MAX_BATCH):
            batch = ex[0] if len(ex) == 1 else np.concatenate(ex)
            self.started.append(batch)
            gate = asyncio.get_running_loop().create_future()
            self.gates.put_nowait(gate)
            await gate
            outputs.append(_per_sample(batch))
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)

    async def next_gate(self) -> asyncio.Future:
        return await asyncio.wait_for(self.gates.get(), 10)

    def owners(self) -> list[int]:
        return [_owner(b) for b in self.started]


async def _release_until_done(device: Device, futures: list[asyncio.Future], rng: random.Random | None = None) -> None:
    """Finish executions (the oldest first, or in a random order with ``rng``) until every future is done."""
    waiting: list[asyncio.Future] = []
    while not all(f.done() for f in futures):
        while not device.gates.empty():
            waiting.append(device.gates.get_nowait())
        if waiting:
            gate = waiting.pop(rng.randrange(len(waiting)) if rng else 0)
            gate.set_result(None)
            continue
        get = asyncio.ensure_future(device.gates.get())
        done, _ = await asyncio.wait([get, *(f for f in futures if not f.done())], timeout=10,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert done, "the batcher stalled"
        if get in done:
            waiting.append(get.result())
        else:
            get.cancel()


def _batcher(device: Device, **options) -> DynamicBatcher:
    return DynamicBatcher(device.execute, **{"max_batch": MAX_BATCH, "max_delay_s": 0.0, "max_queue": 64, **options})


@pytest.mark.parametrize("max_inflight", [1, 3])
@pytest.mark.parametrize("small_shape", [SHAPE, OTHER_SHAPE])
def test_a_small_request_waits_for_at_most_one_chunk_of_queued_large_ones(max_inflight, small_shape):
    """The attack: three requests of 8 * max_batch samples queue, then one of 2 samples. It starts after the
    executions already running plus at most one chunk (none with one slot), and every row is right."""

    async def go():
        device = Device()
        batcher = _batcher(device, max_inflight=max_inflight)
        try:
            inputs = {k: _request(k, 8 * MAX_BATCH) for k in (1, 2, 3)}
            futures = {k: batcher.enqueue(x, "FP32") for k, x in inputs.items()}
            # every slot runs a chunk: whatever the loop starts next is its choice
            running = [await device.next_gate() for _ in range(max_inflight)]
            inputs[9] = _request(9, 2, small_shape)
            futures[9] = batcher.enqueue(inputs[9], "FP32")
            running[0].set_result(None)
            for gate in running[1:]:
                device.gates.put_nowait(gate)
            await _release_until_done(device, [futures[9]])
            owners = device.owners()
            await _release_until_done(device, list(futures.values()))
            return owners, inputs, {k: f.result() for k, f in futures.items()}
        finally:
            await batcher.close()

    owners, inputs, results = asyncio.run(go())
    chunks_before = owners.index(9) - max_inflight  # large chunks started after the small request arrived
    assert chunks_before <= 1 and (max_inflight > 1 or chunks_before == 0), owners
    for k, x in inputs.items():
        assert np.array_equal(results[k].output, _per_sample(x)), k
    assert results[9].batch_samples == 2 and results[1].batch_samples == MAX_BATCH


def test_large_requests_start_and_finish_in_order_with_all_rows_right():
    """Large requests (of any shape) go first come, first served among themselves; small ones between them."""

    async def go(rng):
        device = Device()
        queued_ns: list[int] = []
        done: list[int] = []
        batcher = _batcher(device, max_inflight=3, on_queued=queued_ns.append)
        try:
            sizes = {1: 5, 2: 2, 3: 9, 4: 13, 5: 1, 6: 20, 7: 8, 8: 7}
            inputs = {k: _request(k, n, OTHER_SHAPE if k in (3, 5) else SHAPE) for k, n in sizes.items()}
            futures = {}
            for k, x in inputs.items():
                futures[k] = batcher.enqueue(x, "FP32")
                futures[k].add_done_callback(lambda f, k=k: done.append(k))
            await _release_until_done(device, list(futures.values()), rng)
            assert batcher.depth == 0 and len(queued_ns) == len(inputs)
            assert max(device.calls) <= MAX_BATCH
            return device.owners(), done, inputs, {k: f.result() for k, f in futures.items()}
        finally:
            await batcher.close()

    owners, done, inputs, results = asyncio.run(go(None))
    large = [k for k in inputs if inputs[k].shape[0] > MAX_BATCH]
    assert [k for k in done if k in large] == large
    assert [k for k in dict.fromkeys(owners) if k in large] == large
    for k, x in inputs.items():
        assert np.array_equal(results[k].output, _per_sample(x)), k

    for seed in range(5):  # executions finishing in any order: every request still gets its own rows in order
        _, _, inputs, results = asyncio.run(go(random.Random(seed)))
        for k, x in inputs.items():
            assert np.array_equal(results[k].output, _per_sample(x)), (seed, k)


def test_a_failing_chunk_fails_its_request_only_and_its_later_chunks_never_run():
    async def go():
        device = Device()
        batcher = _batcher(device)
        try:
            inputs = {1: _request(1, 4 * MAX_BATCH), 2: _request(2, 2, OTHER_SHAPE), 3: _request(3, 3 * MAX_BATCH)}
            futures = {k: batcher.enqueue(x, "FP32") for k, x in inputs.items()}
            (await device.next_gate()).set_result(None)  # chunk 0 of request 1
            while device.owners().count(1) < 2:
                gate = await device.next_gate()
                if device.owners()[-1] == 1:
                    gate.set_exception(RuntimeError("chunk 1 failed"))
                else:
                    gate.set_result(None)
            await _release_until_done(device, list(futures.values()))
            with pytest.raises(RuntimeError, match="chunk 1 failed"):
                futures.pop(1).result()
            assert batcher.depth == 0
            return device.owners(), inputs, {k: f.result() for k, f in futures.items()}
        finally:
            await batcher.close()

    owners, inputs, results = asyncio.run(go())
    assert owners.count(1) == 2 and owners.count(3) == 3 and owners.count(2) == 1
    for k, r in results.items():
        assert np.array_equal(r.output, _per_sample(inputs[k])), k


@pytest.mark.parametrize("stop", ["cancel", "deadline"])
def test_a_cancelled_or_expired_large_request_runs_no_further_chunk(stop):
    async def go():
        device = Device()
        batcher = _batcher(device)
        loop = asyncio.get_running_loop()
        try:
            timeout_s = 0.3 if stop == "deadline" else None
            large = batcher.enqueue(_request(1, 8 * MAX_BATCH), "FP32", timeout_s)
            due = loop.time() + 0.3
            small = _request(2, 3)
            later = batcher.enqueue(small, "FP32")
            chunk = await device.next_gate()
            assert device.owners() == [1]
            if stop == "cancel":
                large.cancel()
            else:
                await asyncio.sleep(max(0.0, due - loop.time()) + 0.01)  # let the deadline pass while it runs
            chunk.set_result(None)
            await _release_until_done(device, [large, later])
            if stop == "deadline":
                with pytest.raises(DeadlineExceeded, match="after 1 of its 8 executions"):
                    large.result()
            assert large.done() and batcher.depth == 0
            return device.owners(), later.result(), small
        finally:
            await batcher.close()

    owners, result, small = asyncio.run(go())
    assert owners == [1, 2]  # chunk 0 ran; the 7 others never did
    assert np.array_equal(result.output, _per_sample(small))
