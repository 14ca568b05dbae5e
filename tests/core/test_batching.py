"""Dynamic batcher semantics with a fake model: merge, split, deadlines, cancellation, full queue."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from voxserve.client import AsyncClient, InferenceError
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.batching import DeadlineExceeded, DynamicBatcher, QueueFull
from voxserve.server.core.model import relative_error

from ..conftest import running_server


class FakeModel:
    """Returns each sample's sum; records batch sizes; can be held to let a queue build up."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.release = threading.Event()
        self.release.set()
        self.started = threading.Event()

    def __call__(self, batch: np.ndarray, datatype: str) -> np.ndarray:
        self.started.set()
        self.release.wait(30)
        self.batches.append(int(batch.shape[0]))
        return batch.reshape(batch.shape[0], -1).sum(axis=1, keepdims=True)


def _x(n: int, value: float, shape=(3, 4, 4, 4)) -> np.ndarray:
    return np.full((n, *shape), value, np.float32)


async def _with_batcher(fn, **kwargs):
    model = FakeModel()
    with ThreadPoolExecutor(1) as pool:
        async def execute(arrays, datatype):
            batch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            return await asyncio.get_running_loop().run_in_executor(pool, model, batch, datatype)

        options = {"max_batch": 8, "max_delay_s": 0.0, "max_queue": 64, **kwargs}
        batcher = DynamicBatcher(execute, **options)
        try:
            return await fn(batcher, model)
        finally:
            model.release.set()
            await batcher.close()


async def _hold(batcher, model):
    """Occupy the executor with one request so that later ones queue behind it."""
    model.release.clear()
    model.started.clear()
    first = asyncio.ensure_future(batcher.submit(_x(1, 0.0, (3, 2, 2, 2)), "FP32"))
    await asyncio.get_running_loop().run_in_executor(None, model.started.wait, 30)
    return first


def test_merges_queued_requests_and_splits_results():
    async def go(batcher, model):
        first = await _hold(batcher, model)
        tasks = [asyncio.ensure_future(batcher.submit(_x(n, v), "FP32")) for n, v in ((1, 1.0), (2, 2.0), (3, 3.0))]
        await asyncio.sleep(0)
        model.release.set()
        results = await asyncio.gather(first, *tasks)
        return model.batches, results

    batches, results = asyncio.run(_with_batcher(go))
    assert batches == [1, 6]  # the three queued requests ran as one execution
    for (n, v), r in zip(((1, 1.0), (2, 2.0), (3, 3.0)), results[1:], strict=True):
        assert r.output.shape == (n, 1) and np.all(r.output == v * 3 * 64) and r.batch_samples == 6


def test_max_batch_and_shapes_bound_a_batch():
    async def go(batcher, model):
        first = await _hold(batcher, model)
        same = [asyncio.ensure_future(batcher.submit(_x(3, 1.0), "FP32")) for _ in range(3)]
        other = asyncio.ensure_future(batcher.submit(_x(2, 1.0, (3, 5, 5, 5)), "FP32"))
        half = asyncio.ensure_future(batcher.submit(_x(1, 1.0), "FP16"))
        big = asyncio.ensure_future(batcher.submit(_x(20, 1.0), "FP32"))
        await asyncio.sleep(0)
        model.release.set()
        await asyncio.gather(first, *same, other, half, big)
        return model.batches

    batches = asyncio.run(_with_batcher(go))
    # 3+3 fit max_batch 8, the third 3 does not; other shapes and datatypes never merge; 20 > 8 runs alone, in
    # chunks of max_batch
    assert sorted(batches[1:]) == sorted([6, 3, 2, 1, 8, 8, 4])


def test_expired_and_cancelled_requests_never_run():
    async def go(batcher, model):
        first = await _hold(batcher, model)
        expired = asyncio.ensure_future(batcher.submit(_x(1, 1.0), "FP32", timeout_s=0.0))
        cancelled = asyncio.ensure_future(batcher.submit(_x(2, 1.0), "FP32"))
        kept = asyncio.ensure_future(batcher.submit(_x(4, 1.0), "FP32"))
        await asyncio.sleep(0)
        cancelled.cancel()
        model.release.set()
        await first
        with pytest.raises(DeadlineExceeded):
            await expired
        assert (await kept).output.shape == (4, 1)
        return model.batches

    assert asyncio.run(_with_batcher(go)) == [1, 4]


def test_full_queue_rejects_at_once_with_the_limit():
    async def go(batcher, model):
        first = await _hold(batcher, model)
        queued = [asyncio.ensure_future(batcher.submit(_x(1, 1.0), "FP32")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="--max-queue-size 2"):
            await batcher.submit(_x(1, 1.0), "FP32")
        model.release.set()
        await asyncio.gather(first, *queued)
        return batcher.depth

    assert asyncio.run(_with_batcher(go, max_queue=2)) == 0


def test_unbatched_mode_runs_one_request_per_execution():
    async def go(batcher, model):
        first = await _hold(batcher, model)
        tasks = [asyncio.ensure_future(batcher.submit(_x(1, 1.0), "FP32")) for _ in range(3)]
        await asyncio.sleep(0)
        model.release.set()
        await asyncio.gather(first, *tasks)
        return model.batches

    assert asyncio.run(_with_batcher(go, enabled=False)) == [1, 1, 1, 1]


def test_delay_gathers_a_batch_without_load():
    async def go(batcher, model):
        tasks = [asyncio.ensure_future(batcher.submit(_x(2, 1.0), "FP32")) for _ in range(4)]
        await asyncio.gather(*tasks)
        return model.batches

    # the first request waits up to 5 s for 8 samples; the four arrive at once and fill the batch
    assert asyncio.run(_with_batcher(go, max_delay_s=5.0)) == [8]


def test_small_batches_wait_for_the_running_one_and_large_ones_overlap_it():
    sample = _x(1, 1.0).nbytes

    async def go():
        started: list[int] = []
        release = asyncio.Event()

        async def execute(arrays, datatype):
            started.append(sum(a.shape[0] for a in arrays))
            await release.wait()
            batch = np.concatenate(arrays)
            return batch.reshape(batch.shape[0], -1).sum(axis=1, keepdims=True)

        batcher = DynamicBatcher(execute, max_batch=64, max_delay_s=0.0, max_queue=64, max_inflight=3,
                                 overlap_bytes=8 * sample)
        try:
            first = asyncio.ensure_future(batcher.submit(_x(1, 1.0), "FP32"))
            await asyncio.sleep(0.01)
            small = [asyncio.ensure_future(batcher.submit(_x(1, 2.0), "FP32")) for _ in range(3)]
            await asyncio.sleep(0.01)
            held_back = list(started)  # 3 samples < overlap_bytes: they wait for the running batch
            large = asyncio.ensure_future(batcher.submit(_x(5, 3.0), "FP32"))
            await asyncio.sleep(0.01)
            overlapped = list(started)  # 3 + 5 samples reach overlap_bytes: one batch starts beside the first
            release.set()
            results = await asyncio.gather(first, *small, large)
        finally:
            release.set()
            await batcher.close()
        return held_back, overlapped, started, results

    held_back, overlapped, started, results = asyncio.run(go())
    assert held_back == [1] and overlapped == [1, 8] and started == [1, 8]
    assert [r.output.shape[0] for r in results] == [1, 1, 1, 1, 5]
    assert all(np.all(r.output == v * 3 * 64) for r, v in zip(results, (1, 2, 2, 2, 3), strict=True))


def test_small_batches_start_at_once_without_overlap_bytes_unbatched_or_on_a_free_device():
    async def go(**options):
        started: list[int] = []
        release = asyncio.Event()

        async def execute(arrays, datatype):
            started.append(sum(a.shape[0] for a in arrays))
            await release.wait()
            return np.concatenate(arrays).reshape(-1, 192).sum(axis=1, keepdims=True)

        batcher = DynamicBatcher(execute, max_batch=64, max_delay_s=0.0, max_queue=64, max_inflight=3, **options)
        tasks = [asyncio.ensure_future(batcher.submit(_x(1, 1.0), "FP32"))]
        await asyncio.sleep(0.01)
        tasks += [asyncio.ensure_future(batcher.submit(_x(1, 1.0), "FP32")) for _ in range(2)]
        await asyncio.sleep(0.01)
        seen = list(started)
        release.set()
        await asyncio.gather(*tasks)
        await batcher.close()
        return seen

    assert asyncio.run(go()) == [1, 2]  # no overlap_bytes: the next batch starts beside the first
    assert asyncio.run(go(overlap_bytes=1 << 30, enabled=False)) == [1, 1, 1]  # unbatched: each starts at once
    assert asyncio.run(go(overlap_bytes=1 << 30, devices=2)) == [1, 2]  # the second device takes the next batch
    assert asyncio.run(go(overlap_bytes=1 << 30)) == [1]  # one device, busy: the two wait and grow


@pytest.mark.parametrize("batching", [True, False])
def test_server_results_batched_and_unbatched_match_float64(rng, batching):
    w, b = reference_weights()
    xs = [torch.randn(1, 3, 6, 7, 8, generator=rng).numpy() for _ in range(12)]

    async def go(url):
        async with AsyncClient(url) as c:
            return await asyncio.gather(*(c.infer(x) for x in xs))

    with running_server(batching=batching, max_queue_delay_ms=20.0) as srv:
        assert srv.wait_ready()
        ys = asyncio.run(go(srv.url))
        stats = srv.server.state.stats.snapshot()
    for x, y in zip(xs, ys, strict=True):
        assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
    request_executions = {size: d.compute_infer.count for size, d in stats.batches.items()}
    if batching:
        assert max(request_executions) > 1  # concurrent requests shared executions
    else:
        assert request_executions.get(1, 0) >= 12


def test_server_deadline_exceeded(rng):
    async def go(url):
        async with AsyncClient(url, timeout_s=0.001) as c:
            with pytest.raises(InferenceError) as err:
                await c.infer(np.zeros((64, 3, 16, 32, 32), np.float32))
            return err.value.code

    with running_server() as srv:
        assert srv.wait_ready()
        assert asyncio.run(go(srv.url)) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_server_full_queue_is_unavailable_with_the_limit():
    x = np.random.default_rng().standard_normal((128, 3, 16, 32, 32), dtype=np.float32)

    async def go(url):
        async with AsyncClient(url, timeout_s=120) as c:
            return await asyncio.gather(*(c.infer(x) for _ in range(6)), return_exceptions=True)

    with running_server(max_queue_size=1, batching=False) as srv:
        assert srv.wait_ready()
        results = asyncio.run(go(srv.url))
    rejected = [r for r in results if isinstance(r, InferenceError)]
    served = [r for r in results if isinstance(r, np.ndarray)]
    assert rejected and served and len(rejected) + len(served) == 6
    assert all(r.code == grpc.StatusCode.UNAVAILABLE and "--max-queue-size 1" in r.message for r in rejected)


def test_split_executions_makes_views_in_order():
    from voxserve.server.core.runner import split_executions

    arrays = [np.arange(n * 2, dtype=np.float32).reshape(n, 2) + 100 * i for i, n in enumerate((3, 10, 1))]
    executions = split_executions(arrays, 4)
    assert [sum(a.shape[0] for a in ex) for ex in executions] == [4, 4, 4, 2]
    flat = np.concatenate([a for ex in executions for a in ex])
    assert np.array_equal(flat, np.concatenate(arrays))
    for ex in executions:
        for part in ex:
            assert any(np.shares_memory(part, a) for a in arrays)  # a view of a request, never a copy


def test_copies_of_request_bytes_on_the_cpu_path(monkeypatch):
    """A single request runs on a view of its own bytes (no copy); a merged batch costs exactly one."""
    from voxserve.server.protocol import codec

    decoded_ptrs, executed = [], []
    real_decode = codec.decode_request

    def decode(*args, **kwargs):
        d = real_decode(*args, **kwargs)
        decoded_ptrs.append(d.array.__array_interface__["data"][0])
        return d

    monkeypatch.setattr(codec, "decode_request", decode)
    with running_server(max_queue_delay_ms=0.0) as srv:
        assert srv.wait_ready()
        model = srv.server.state.runner.model
        real_run = model.run_tensor
        gate = threading.Event()
        gate.set()

        def run(x):
            gate.wait(30)
            executed.append((x.data_ptr(), int(x.shape[0]), x.is_contiguous()))
            return real_run(x)

        model.run_tensor = run
        x = np.random.default_rng().standard_normal((2, 3, 5, 6, 7), dtype=np.float32)
        from voxserve.client import Client

        with Client(srv.url, timeout_s=30) as c:
            c.infer(x)
            assert executed[-1][0] == decoded_ptrs[-1] and executed[-1][1] == 2  # 0 copies
            decoded_ptrs.clear()
            executed.clear()
            gate.clear()  # hold the runner: the next requests queue and merge
            with ThreadPoolExecutor(4) as pool:
                first = pool.submit(c.infer, x)
                deadline = time.monotonic() + 10
                while not decoded_ptrs and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.2)
                rest = [pool.submit(c.infer, x) for _ in range(3)]
                deadline = time.monotonic() + 10
                while len(decoded_ptrs) < 4 and time.monotonic() < deadline:
                    time.sleep(0.01)
                gate.set()
                for f in [first, *rest]:
                    assert f.result(30).shape == (2, 16)
    merged = [e for e in executed if e[1] == 6]
    assert merged, executed  # the three queued requests ran as one execution ...
    assert merged[0][0] not in decoded_ptrs[1:] and merged[0][2]  # ... on one new contiguous buffer: 1 copy


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12), max_batch=st.integers(1, 16),
       max_inflight=st.integers(1, 3))
def test_any_mix_of_requests_gets_exactly_its_own_rows(sizes, max_batch, max_inflight):
    """Whatever the sizes, limits and overlap, each request gets its own rows in order (batching never changes
    a result), every execution stays within max_batch, and no sample is run twice or dropped."""
    from voxserve.server.core.runner import split_executions

    executed: list[int] = []

    async def execute(arrays, datatype):
        rows = []
        for ex in split_executions(arrays, max_batch):
            batch = ex[0] if len(ex) == 1 else np.concatenate(ex)
            executed.append(int(batch.shape[0]))
            await asyncio.sleep(0)
            rows.append(batch.reshape(batch.shape[0], -1)[:, :1] * 2.0)
        return np.concatenate(rows)

    async def main():
        batcher = DynamicBatcher(execute, max_batch=max_batch, max_delay_s=0.0, max_queue=1000,
                                 max_inflight=max_inflight)
        try:
            inputs, start = [], 0
            for n in sizes:
                inputs.append(np.arange(start, start + n, dtype=np.float32).reshape(n, 1, 1, 1, 1)
                              * np.ones((1, 3, 1, 1, 1), np.float32))
                start += n
            results = await asyncio.gather(*(batcher.submit(x, "FP32") for x in inputs))
            return inputs, results
        finally:
            await batcher.close()

    inputs, results = asyncio.run(main())
    for x, r in zip(inputs, results, strict=True):
        assert np.array_equal(r.output[:, 0], x[:, 0, 0, 0, 0] * 2.0)
    assert sum(executed) == sum(sizes) and max(executed) <= max_batch


@pytest.mark.parametrize("ending", ["a chunk fails", "its deadline passes"])
def test_a_large_request_that_fails_is_answered_after_its_running_chunks(ending):
    """Chunks of one large request run side by side; when one fails, or the deadline passes before the last forms,
    the request is answered with that error only once the chunks still executing are over (they read its input and
    may write its output in the client's memory), and its remaining chunks never run."""
    async def go():
        started: list[tuple[int, asyncio.Event]] = []

        async def execute(arrays, datatype):
            go_on = asyncio.Event()
            started.append((len(started), go_on))
            await go_on.wait()
            if ending == "a chunk fails" and len(started) and started[0][1] is go_on:
                raise RuntimeError("the first chunk failed")
            batch = np.concatenate(arrays)
            return batch.reshape(batch.shape[0], -1).sum(axis=1, keepdims=True)

        batcher = DynamicBatcher(execute, max_batch=2, max_delay_s=0.0, max_queue=8, max_inflight=2)
        try:
            timeout = 0.3 if ending == "its deadline passes" else None
            answer = asyncio.ensure_future(batcher.submit(_x(6, 1.0), "FP32", timeout))
            while len(started) < 2:
                await asyncio.sleep(0.005)
            if timeout:
                await asyncio.sleep(timeout + 0.05)
            started[0][1].set()  # chunk 0 ends (failing, or after the deadline): chunk 1 still runs
            await asyncio.sleep(0.05)
            pending_while_running = not answer.done()
            started[1][1].set()
            with pytest.raises((RuntimeError, DeadlineExceeded)) as err:
                await answer
            return pending_while_running, len(started), err.type
        finally:
            for _, event in started:
                event.set()
            await batcher.close()

    pending_while_running, chunks, error = asyncio.run(go())
    assert pending_while_running, "answered while a chunk of it was still executing"
    assert chunks == 2  # the third chunk never ran
    assert error is (RuntimeError if ending == "a chunk fails" else DeadlineExceeded)
