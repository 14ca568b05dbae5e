"""--frontends: gRPC front-end processes in front of an engine process (server/topology/: ipc, engine, remote)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import os
import re
import signal
import threading
import time
import types
import urllib.request
import uuid

import grpc
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from voxserve.client import Client, InferenceError, SharedMemoryBuffer
from voxserve.datatypes import to_wire
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.app import VoxServer
from voxserve.server.core.batching import BatchingConfig
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.core.model import relative_error
from voxserve.server.protocol.shm import SharedMemoryRegistry
from voxserve.server.settings import Settings, add_arguments, from_namespace, validate
from voxserve.server.topology import ipc
from voxserve.server.topology.engine import Engine
from voxserve.server.topology.ipc import Arena
from voxserve.server.topology.remote import EngineCudaSharedMemory, RemoteRunner
from voxserve.server.topology.roles import FRONTEND, Role
from voxserve.server.topology.supervisor import cgroup_cpu_quota, resolve_frontends, usable_cpus
from voxserve.testing.fake_devicemem import FakeDeviceMemory
from voxserve.testing.fake_hostmem import FakePageLocker
from voxserve.testing.load import proc_stat

from ..conftest import ServerThread, serve_process
from ..e2e.test_lifecycle import _metric, _wait_for

W, B = reference_weights()
MiB = 1 << 20


def _ref(x: np.ndarray) -> torch.Tensor:
    return reference_float64(torch.from_numpy(np.asarray(x, dtype=np.float32)), W, B)


# --- the arena -----------------------------------------------------------------------------------------


def test_outbox_sends_one_iterations_records_in_one_write_and_replies_parse_across_reads():
    from voxserve.server.topology import ipc

    class Writer:
        def __init__(self):
            self.writes, self.closing = [], False

        def write(self, data):
            self.writes.append(data)

        def is_closing(self):
            return self.closing

    records = [ipc.REPLY.pack(ipc.OK, 0, 8 * i, i, 5, 9) + bytes(range(8 * i)) for i in range(4)]

    async def main():
        writer = Writer()
        outbox = ipc.Outbox(writer)
        for r in records:
            outbox.put(r)
        assert writer.writes == []  # not before the iteration is over
        await asyncio.sleep(0)
        assert writer.writes == [b"".join(records)]
        outbox.put(records[0])
        writer.closing = True
        await asyncio.sleep(0)
        assert len(writer.writes) == 1  # nothing is written into a closing connection
        return writer.writes[0]

    stream = asyncio.run(main())
    buffer, got = bytearray(), []
    for cut in range(0, len(stream), 7):  # arriving in arbitrary pieces
        buffer += stream[cut : cut + 7]
        replies, used = ipc.replies(buffer)
        del buffer[:used]
        got += replies
    assert not buffer
    assert [(h[3], p) for h, p in got] == [(i, bytes(range(8 * i))) for i in range(4)]
    assert all(h[:2] == (ipc.OK, 0) and h[4:] == (5, 9) for h, _ in got)


def test_registered_page_locked_ranges_are_found_by_address(monkeypatch):
    from voxserve.server.core import pipeline

    monkeypatch.setattr(pipeline, "_LOCKED", ())  # this process's registry is left as it was
    base = 1 << 40  # no real memory is touched: the registry only compares addresses
    pipeline.register_page_locked(base, 4096)
    pipeline.register_page_locked(base + 8192, 4096)
    assert pipeline._registered(base, 4096) and pipeline._registered(base + 100, 10)
    assert pipeline._registered(base + 8192, 4096)
    assert not pipeline._registered(base + 4000, 200)  # runs past the first range's end
    assert not pipeline._registered(base + 4096, 1)  # between the ranges
    assert not pipeline._registered(base - 1, 2)



def test_arena_blocks_are_reused_only_after_every_view_is_gone():
    arena = Arena(MiB)
    offset, block = arena.try_allocate(1000)
    assert offset == 0 and len(block) == 1000
    a = np.frombuffer(block, np.uint8).view(np.float32)  # views derived any way keep the block
    t = torch.from_numpy(a.reshape(10, 25))
    del block, a
    gc.collect()
    assert arena.in_use >= 1000
    second, other = arena.try_allocate(1000)
    assert second >= 1000  # not the first block's bytes: those are still viewed
    del t
    gc.collect()
    assert arena.in_use < 2048  # the first block is back; the second one is still held
    del other
    gc.collect()
    assert arena.in_use == 0
    arena.close()


def test_arena_wraps_refuses_when_full_and_places_views():
    arena = Arena(MiB)
    with pytest.raises(ValueError):
        arena.try_allocate(arena.largest + 1)
    held = [arena.try_allocate(300 * 1024) for _ in range(3)]
    assert all(h is not None for h in held)
    assert arena.try_allocate(300 * 1024) is None  # no room until the oldest is released
    del held[0]
    gc.collect()
    offset, block = arena.try_allocate(300 * 1024)  # does not fit before the end: wraps to the start
    assert offset == 0
    x = np.frombuffer(block, np.uint8)
    assert arena.offset_of(x[256:512]) == 256
    assert arena.offset_of(np.zeros(8)) is None
    assert arena.offset_of(x[::2]) is None  # not contiguous: copied like any other array
    # The registry hook never waits: private memory while the ring is full.
    fallback = arena.allocate_now(300 * 1024)
    assert arena.offset_of(np.frombuffer(fallback, np.uint8)) is None
    del block, x, held
    gc.collect()
    assert arena.offset_of(np.frombuffer(arena.allocate_now(4096), np.uint8)) is not None
    arena.close()


def test_arena_allocate_waits_for_room():
    async def main():
        arena = Arena(MiB)
        first = arena.try_allocate(arena.largest)
        second = arena.try_allocate(arena.largest)
        waiter = asyncio.create_task(arena.allocate(4096))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        del first
        gc.collect()
        offset, _ = await asyncio.wait_for(waiter, 5)
        assert offset == 0
        del second

    asyncio.run(main())


# --- an engine and a front end's runner in one event loop --------------------------------------------------


@contextlib.asynccontextmanager
async def engine_and_runner(tmp_path, arena_bytes: int = 64 * MiB, runner_queue: int = 512, device: str = "cpu",
                            regions_dir: str | None = None, device_memory=None, **engine_settings):
    settings = Settings(device=device, **engine_settings)
    path = str(tmp_path / f"e-{uuid.uuid4().hex[:6]}.sock")
    engine = Engine(settings, path, regions_dir=regions_dir, device_memory=device_memory)
    await asyncio.to_thread(engine.load)
    stop = asyncio.Event()
    serving = asyncio.create_task(engine.serve(stop))
    lost: list[str] = []
    runner = await asyncio.wait_for(RemoteRunner.connect(
        [path], Arena(arena_bytes), "test", BatchingConfig(True, 0.0, runner_queue), lost.append), 30)
    try:
        yield engine, runner, stop, lost
    finally:
        await runner.close()
        stop.set()
        await asyncio.wait_for(serving, 30)


def test_engine_serves_a_front_end_exactly_and_batches_its_requests(tmp_path):
    rng = np.random.default_rng()

    async def main():
        async with engine_and_runner(tmp_path) as (engine, runner, _stop, _lost):
            assert runner.devices == ["cpu"] and runner.cout == 16
            shapes = [(1, 3, 5, 6, 7)] * 12 + [(3, 3, 4, 4, 4), (2, 3, 9, 5, 3)]
            xs = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
            results = await asyncio.gather(*(runner.run(x, "FP32") for x in xs))
            for x, r in zip(xs, results, strict=True):
                assert r.output.shape == (x.shape[0], 16)
                assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
            assert max(r.batch_samples for r in results[:12]) > 1  # concurrent requests merged in the engine
            for dtype in ("FP16", "BF16"):
                x = rng.standard_normal((2, 3, 5, 5, 5), dtype=np.float32)
                wire = np.frombuffer(to_wire(x, dtype), np.float16 if dtype == "FP16" else np.uint16).reshape(x.shape)
                r = await runner.run(wire, dtype)
                rounded = (torch.from_numpy(x).half() if dtype == "FP16" else torch.from_numpy(x).bfloat16()).float()
                assert relative_error(torch.from_numpy(r.output.copy()), _ref(rounded.numpy())) <= 1e-5
            stats = engine.stats.snapshot()
            assert stats.execution_count < len(shapes) + 2
            # Copies in the front end: a wire tensor once into the arena; one already there (a shared-memory
            # read lands in the arena) none.
            x = rng.standard_normal((2, 3, 6, 6, 6), dtype=np.float32)
            copied = runner.copied_bytes
            await runner.run(x, "FP32")
            assert runner.copied_bytes - copied == x.nbytes
            in_arena = np.frombuffer(runner.arena.allocate_now(x.nbytes), np.float32).reshape(x.shape)
            assert runner.arena.offset_of(in_arena) is not None
            in_arena[...] = x
            r = await runner.run(in_arena, "FP32")
            assert runner.copied_bytes - copied == x.nbytes
            assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
            del in_arena
        assert runner.arena.in_use == 0  # every request's arena space came back after its reply

    asyncio.run(main())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_engine_reads_page_locked_arenas_in_place_and_answers_exactly(tmp_path):
    """On a GPU the engine page-locks the arena, DMAs requests from it and enqueues small executions on its
    event loop (large host copies would go to its submit thread): every answer within fp32 of float64."""
    rng = np.random.default_rng()

    async def main():
        async with engine_and_runner(tmp_path, arena_bytes=128 * MiB, device="cuda") as (engine, runner, _s, _l):
            assert engine._pinned and engine.runner.enqueue_on_loop
            pipeline = engine.runner.model.pipeline
            direct, staged = pipeline.direct_bytes, pipeline.staged_bytes
            shapes = [(1, 3, 16, 32, 32)] * 24 + [(5, 3, 16, 32, 32), (40, 3, 16, 32, 32), (2, 3, 7, 9, 11)]
            xs = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
            for _ in range(2):  # the second round finds graphs captured and slots warm
                results = await asyncio.gather(*(runner.run(x, "FP32") for x in xs))
                for x, r in zip(xs, results, strict=True):
                    assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
            assert max(r.batch_samples for r in results[:24]) > 1
            assert pipeline.direct_bytes - direct == 2 * sum(x.nbytes for x in xs)  # no host copy of any
            assert pipeline.staged_bytes == staged

    asyncio.run(main())


def test_requests_larger_than_an_arena_block_travel_in_pieces(tmp_path):
    rng = np.random.default_rng()

    async def main():
        async with engine_and_runner(tmp_path, arena_bytes=MiB) as (_engine, runner, _stop, _lost):
            x = rng.standard_normal((40, 3, 10, 10, 10), dtype=np.float32)  # 480 KB: blocks hold 512 KiB
            y = rng.standard_normal((100, 3, 10, 10, 10), dtype=np.float32)  # 1.2 MB: more than the whole arena
            rx, ry = await asyncio.gather(runner.run(x, "FP32"), runner.run(y, "FP32"))
            assert relative_error(torch.from_numpy(rx.output.copy()), _ref(x)) <= 1e-5
            assert relative_error(torch.from_numpy(ry.output.copy()), _ref(y)) <= 1e-5
            huge = np.zeros((1, 3, 64, 64, 64), np.float32)  # one sample of 3 MB: cannot be split
            with pytest.raises(ServingError) as err:
                await runner.run(huge, "FP32")
            assert err.value.code == Status.RESOURCE_EXHAUSTED
            assert "--frontend-arena-bytes" in err.value.message

    asyncio.run(main())


def test_engine_deadlines_overload_and_cancellation(tmp_path):
    rng = np.random.default_rng()
    x = rng.standard_normal((1, 3, 8, 8, 8), dtype=np.float32)

    async def main():
        async with engine_and_runner(tmp_path, max_queue_size=2) as (_engine, runner, _stop, _lost):
            with pytest.raises(ServingError) as err:
                await runner.run(x, "FP32", timeout_s=0.0)
            assert err.value.code == Status.DEADLINE_EXCEEDED
            # The engine's own queue limit (2) answers UNAVAILABLE, naming it; the others are served.
            outcomes = await asyncio.gather(*(runner.run(x, "FP32") for _ in range(40)), return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, ServingError)]
            assert refused and all(o.code == Status.UNAVAILABLE and "--max-queue-size 2" in o.message
                                   for o in refused)
            assert len(refused) < len(outcomes)
            del outcomes, refused  # (errors hold their tracebacks)
            # Cancelled while waiting: the engine is told, and the arena space waits for its answer.
            tasks = [asyncio.create_task(runner.run(x, "FP32")) for _ in range(2)]
            await asyncio.sleep(0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert all(t.cancelled() for t in tasks)
            await asyncio.wait_for(_until(lambda: runner.outstanding == 0), 10)
            gc.collect()
            assert runner.arena.in_use == 0
            r = await runner.run(x, "FP32")  # still serving
            assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5

    asyncio.run(main())


def test_front_end_loses_its_engine(tmp_path):
    x = np.zeros((1, 3, 4, 4, 4), np.float32)

    async def main():
        async with engine_and_runner(tmp_path) as (engine, runner, _stop, lost):
            await runner.run(x, "FP32")
            # The engine goes away (its process would exit): requests fail UNAVAILABLE, the front end is told.
            for task in list(engine._connections):
                task.cancel()
            await asyncio.wait_for(_until(lambda: runner.device_lost is not None), 10)
            assert lost and "engine" in lost[0]
            with pytest.raises(ServingError) as err:
                await runner.run(x, "FP32")
            assert err.value.code == Status.UNAVAILABLE and "restarted" in err.value.message

    asyncio.run(main())


def test_a_record_announcing_more_trailer_than_any_request_has_ends_the_connection(tmp_path):
    """A record's trailer length comes from the front end: one no request can have (a corrupted stream) must not
    make the engine buffer up to 4 GiB and wait for it, swallowing every later record of that front end."""
    from voxserve.server.topology import ipc

    async def main():
        async with engine_and_runner(tmp_path) as (_engine, runner, _stop, lost):
            runner.links[0].outbox.put(ipc.REQUEST.pack(ipc.CONTROL, 0, 0xFFFFFFFF, 1, 0, 0, float("nan"),
                                                        0, 0, 0, 0, 0))
            await asyncio.wait_for(_until(lambda: runner.device_lost is not None), 30)
            assert lost

    asyncio.run(main())


def test_a_registration_cancelled_through_a_front_end_is_cancelled_in_the_engine(tmp_path):
    """A client that stops waiting for its registration (a deadline, a cancel) leaves nothing registered, as in
    one process: the engine's registration is cancelled too (its mapping closed once the open returns), and the
    name stays free for the client's retry."""
    regions = tmp_path / "regions"
    regions.mkdir()
    fake = FakeDeviceMemory(1)
    gate, called = threading.Event(), threading.Event()
    opening = fake.open

    def slow_open(handle, device, nbytes=None):
        called.set()
        gate.wait(30)
        return opening(handle, device, nbytes)

    fake.open = slow_open

    async def main():
        async with engine_and_runner(tmp_path, regions_dir=str(regions), device_memory=fake) as (_e, runner, _s, _l):
            front = EngineCudaSharedMemory(runner, 8, None, str(regions))
            handle = fake.export(4096)
            task = asyncio.create_task(front.register("r", handle, 0, 4096))
            await asyncio.wait_for(asyncio.to_thread(called.wait, 30), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            await asyncio.wait_for(_until(lambda: runner.outstanding == 0 and fake.opens == 1 and fake.mapped == 0),
                                   30)
            assert not front.holds("r")
            await front.register("r", handle, 0, 4096)  # the retry
            assert front.holds("r")

    asyncio.run(main())


@contextlib.asynccontextmanager
async def two_engines_and_runner(tmp_path, regions, fake):
    """Two CPU engines sharing the regions' records and the fake device layer, and a front end's runner of both."""
    engines, servings, stop = [], [], asyncio.Event()
    for i in range(2):
        engine = Engine(Settings(device="cpu"), str(tmp_path / f"e{i}.sock"), index=i, regions_dir=str(regions),
                        device_memory=fake)
        await asyncio.to_thread(engine.load)
        engines.append(engine)
        servings.append(asyncio.create_task(engine.serve(stop)))
    runner = await asyncio.wait_for(RemoteRunner.connect(
        [e.socket_path for e in engines], Arena(16 * MiB), "test", BatchingConfig(True, 0.0, 64)), 30)
    try:
        yield engines, runner
    finally:
        await runner.close()
        stop.set()
        await asyncio.wait_for(asyncio.gather(*servings), 30)


@contextlib.contextmanager
def busier(link, requests: int = 3):
    """``link`` looks busier than an idle engine: ``requests`` pending entries that no reply will answer."""
    loop = asyncio.get_running_loop()
    for n in range(requests):
        link.pending[-1 - n] = (loop.create_future(), None)
    try:
        yield
    finally:
        for n in range(requests):
            del link.pending[-1 - n]


def test_a_region_on_a_device_no_engine_runs_on_is_served_by_the_engine_that_registered_it(tmp_path):
    """A client's region on a device none of the engines executes on (the engines on other GPUs) goes to one
    engine for its registration, its reads and its writes: a read sent to another engine would open the handle
    there, on that engine's event loop (the open and the check of the whole allocation stall every request it
    serves)."""
    regions = tmp_path / "regions"
    regions.mkdir()
    fake = FakeDeviceMemory(1)
    rng = np.random.default_rng()
    x = rng.standard_normal((1, 3, 5, 5, 5), dtype=np.float32)

    async def main():
        async with two_engines_and_runner(tmp_path, regions, fake) as (engines, runner):
            front = EngineCudaSharedMemory(runner, 8, None, str(regions))
            await front.register("r", fake.export(x.tobytes()), 0, x.nbytes)
            tensor, _ = front.read("r", 0, x.shape, np.dtype(np.float32), "input 'input'")
            owner = next(lk for lk in runner.links if lk.hello["engine"] == engines[0].index)
            with busier(owner):  # the registering engine is the busier one now
                r = await runner.run(tensor, "FP32")
            assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
            assert fake.opens == 1, fake.open_threads  # opened once, at registration, off the event loop

    asyncio.run(main())


def test_cuda_regions_are_read_by_every_engine_on_their_device_each_opening_them_off_its_event_loop(tmp_path):
    """With several engines on one GPU a region's requests go to the least busy of them, not only to the engine
    that registered it: another engine maps the region at its first request there, on a thread (its event loop
    serves on meanwhile); a request cancelled while its region opens is answered CANCELLED; an unregister closes
    every engine's mapping."""
    regions = tmp_path / "regions"
    regions.mkdir()
    fake = FakeDeviceMemory(1)
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 3, 5, 6, 7), dtype=np.float32)
    out_bytes = 2 * 16 * 4
    opening = threading.Event()
    unblock = threading.Event()
    open_fast = fake.open

    def open_slowly(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # (a second engine's first open)
            opening.set()
            unblock.wait(10)
        return open_fast(*args, **kwargs)

    async def main():
        async with two_engines_and_runner(tmp_path, regions, fake) as (_engines, runner):
            try:
                for link in runner.links:  # both engines execute on cuda:0, as two engines of one GPU do
                    link.hello["device"] = "cuda:0"
                front = EngineCudaSharedMemory(runner, 8, None, str(regions))
                handle = fake.export(x.tobytes() + bytes(out_bytes))
                await front.register("r", handle, 0, x.nbytes + out_bytes)
                owner = runner.engine_for(0)
                other = next(lk for lk in runner.links if lk is not owner)
                assert fake.opens == 1
                read, _ = front.read("r", 0, x.shape, np.dtype(np.float32), "input 'input'")
                tensor = dataclasses.replace(read, result=("r", x.nbytes))  # the output into the region too
                fake.open = open_slowly
                with busier(owner):  # the registering engine is the busier one
                    # Cancelled while the other engine opens the region: answered CANCELLED, nothing left behind.
                    first = asyncio.create_task(runner.run(tensor, "FP32"))
                    assert await asyncio.to_thread(opening.wait, 10)
                    assert len(other.pending) == 1
                    first.cancel()
                    await asyncio.wait_for(_until(lambda: not other.pending), 10)
                    unblock.set()
                    r = await runner.run(tensor, "FP32")
                assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
                written = np.frombuffer(fake.contents(handle)[x.nbytes:], np.float32).reshape(2, 16)
                np.testing.assert_array_equal(written, r.output)
                assert fake.opens == 2 and fake.mapped == 2  # one mapping in each engine
                assert all(name != threading.main_thread().name for name in fake.open_threads[1:]), fake.open_threads
                await front.unregister("r")
                await asyncio.wait_for(_until(lambda: fake.mapped == 0), 10)
            finally:
                unblock.set()

    asyncio.run(main())


def test_a_region_that_no_longer_opens_in_a_second_engine_is_refused_there_and_both_engines_serve_on(tmp_path):
    """The client frees its allocation after the registration (its handle no longer opens): the engine that did not
    register the region cannot map it, and answers its requests INVALID_ARGUMENT at once from then on (no second
    open); the engine that mapped it at registration still reads it; other regions are served by both."""
    regions = tmp_path / "regions"
    regions.mkdir()
    fake = FakeDeviceMemory(1)
    x = np.random.default_rng().standard_normal((1, 3, 5, 5, 5), dtype=np.float32)
    f32 = np.dtype(np.float32)

    async def main():
        async with two_engines_and_runner(tmp_path, regions, fake) as (_engines, runner):
            for link in runner.links:  # two engines of one GPU
                link.hello["device"] = "cuda:0"
            front = EngineCudaSharedMemory(runner, 8, None, str(regions))
            freed = fake.export(x.tobytes())
            await front.register("freed", freed, 0, x.nbytes)
            await front.register("live", fake.export(x.tobytes()), 0, x.nbytes)
            fake.free(freed)
            owner = runner.engine_for(0)
            other = next(lk for lk in runner.links if lk is not owner)
            tensor, _ = front.read("freed", 0, x.shape, f32, "input 'input'")
            with busier(owner):
                for _ in range(2):
                    with pytest.raises(ServingError) as err:
                        await runner.run(tensor, "FP32")
                    assert err.value.code == Status.INVALID_ARGUMENT, err.value
                    assert "does not open in this server process any more" in err.value.message
                opens = fake.opens
                live, _ = front.read("live", 0, x.shape, f32, "input 'input'")
                r = await runner.run(live, "FP32")  # the other engine maps the live region and serves it
                assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
                assert fake.opens == opens + 1
            # two registrations, one open of 'freed' in the other engine (failed, not tried again), one of 'live';
            # none on the event loop's thread
            assert len(fake.open_threads) == 4 and threading.main_thread().name not in fake.open_threads
            with busier(other):  # the registering engine still reads the freed allocation it mapped
                r = await runner.run(tensor, "FP32")
            assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5

    asyncio.run(main())


def _one_gpu(runner) -> None:
    for link in runner.links:  # both engines execute on cuda:0, as two engines of one GPU do
        link.hello["device"] = "cuda:0"


class _HeldOpens:
    """The fake layer's opens, held on their thread (not the event loop's) from ``arm()`` until ``release()``."""

    def __init__(self, fake: FakeDeviceMemory) -> None:
        self.fast, self.armed, self.opening, self.go = fake.open, False, threading.Event(), threading.Event()
        fake.open = self

    def __call__(self, *args, **kwargs):
        if self.armed and threading.current_thread() is not threading.main_thread():
            self.opening.set()
            self.go.wait(10)
        return self.fast(*args, **kwargs)


@contextlib.asynccontextmanager
async def _region_on_one_gpu(tmp_path, fake: FakeDeviceMemory, x: np.ndarray):
    """Two engines of one GPU, a front end's runner and CUDA registry, and region "r" holding ``x``, registered
    through the first engine (``owner``); ``tensor`` is the request's input there."""
    regions = tmp_path / "regions"
    regions.mkdir()
    async with two_engines_and_runner(tmp_path, regions, fake) as (engines, runner):
        _one_gpu(runner)
        front = EngineCudaSharedMemory(runner, 8, None, str(regions))
        await front.register("r", fake.export(x.tobytes()), 0, x.nbytes)
        tensor, _ = front.read("r", 0, x.shape, np.dtype(np.float32), "input 'input'")
        yield types.SimpleNamespace(engines=engines, runner=runner, front=front, owner=runner.engine_for(0),
                                    tensor=tensor)


def test_first_requests_in_a_second_engine_share_one_mapping_and_leave_the_loops_executor_free(tmp_path):
    """A burst of first requests for a region in the engine that did not register it: one open, on the registry's
    own thread, while the engine's default executor stays free for its other work; every request answered."""
    fake = FakeDeviceMemory(1)
    x = np.random.default_rng().standard_normal((1, 3, 5, 5, 5), dtype=np.float32)

    async def main():
        async with _region_on_one_gpu(tmp_path, fake, x) as setup:
            runner, owner, tensor = setup.runner, setup.owner, setup.tensor
            held = _HeldOpens(fake)
            held.armed = True
            try:
                with busier(owner, 100):
                    requests = [asyncio.create_task(runner.run(tensor, "FP32")) for _ in range(16)]
                    assert await asyncio.to_thread(held.opening.wait, 10)
                    await asyncio.sleep(0.1)
                    # (both engines share this test's loop: its executor is theirs)
                    await asyncio.wait_for(asyncio.to_thread(lambda: None), 2)
                    held.go.set()
                    results = await asyncio.wait_for(asyncio.gather(*requests), 30)
            finally:
                held.go.set()
            for r in results:
                assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
            assert fake.opens == 2 and fake.open_threads[-1].startswith("cuda-shm-open"), fake.open_threads

    asyncio.run(main())


def test_a_request_handed_on_after_the_mapping_is_still_cancellable(tmp_path):
    """Once its region is mapped, a request waits in the engine's queue under its own entry: a cancel then reaches
    it there (the mapping task's end must not remove that entry)."""
    fake = FakeDeviceMemory(1)
    x = np.random.default_rng().standard_normal((1, 3, 5, 5, 5), dtype=np.float32)

    async def main():
        async with _region_on_one_gpu(tmp_path, fake, x) as setup:
            runner, owner, tensor, engines = setup.runner, setup.owner, setup.tensor, setup.engines
            other = next(lk for lk in runner.links if lk is not owner)
            engine = next(e for e in engines if e.index == other.hello["engine"])
            queued: list[asyncio.Future] = []
            loop = asyncio.get_running_loop()
            engine.runner.enqueue = lambda *args, **kwargs: queued.append(loop.create_future()) or queued[-1]
            with busier(owner):
                request = asyncio.create_task(runner.run(tensor, "FP32"))
                await asyncio.wait_for(_until(lambda: queued), 10)  # mapped, then queued
                request.cancel()
                await asyncio.wait_for(_until(lambda: queued[0].cancelled() and not other.pending), 10)

    asyncio.run(main())


@pytest.mark.parametrize("change", ["unregistered", "registered again"])
def test_a_region_changed_while_a_second_engine_maps_it_is_never_opened_on_its_event_loop(tmp_path, change):
    """The client unregisters the region (and maybe registers the name again, another allocation) while the engine
    that did not register it maps it for a request: the request is answered (NOT_FOUND, or served from the new
    region), no handle is ever opened on the event loop, and nothing stays mapped for the old region."""
    fake = FakeDeviceMemory(1)
    x = np.random.default_rng().standard_normal((1, 3, 5, 5, 5), dtype=np.float32)

    async def main():
        async with _region_on_one_gpu(tmp_path, fake, x) as setup:
            runner, front, owner, tensor = setup.runner, setup.front, setup.owner, setup.tensor
            held = _HeldOpens(fake)
            try:
                with busier(owner, 3):
                    held.armed = True
                    request = asyncio.create_task(runner.run(tensor, "FP32"))
                    assert await asyncio.to_thread(held.opening.wait, 10)
                    held.armed = False
                    await front.unregister("r")
                    if change == "registered again":
                        await front.register("r", fake.export(x.tobytes()), 0, x.nbytes)
                    held.go.set()
                    if change == "unregistered":
                        with pytest.raises(ServingError) as err:
                            await asyncio.wait_for(request, 10)
                        assert err.value.code == Status.NOT_FOUND, err.value
                    else:
                        r = await asyncio.wait_for(request, 10)
                        assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
            finally:
                held.go.set()
            assert threading.main_thread().name not in fake.open_threads, fake.open_threads
            if change == "unregistered":
                await asyncio.wait_for(_until(lambda: fake.mapped == 0), 10)

    asyncio.run(main())


def test_a_region_goes_only_to_the_engines_on_its_device(tmp_path):
    """Engines on two GPUs: a region on the second goes to the engine there even when it is the busier one (the other
    engine would map it on a device it does not execute on)."""
    regions = tmp_path / "regions"
    regions.mkdir()
    fake = FakeDeviceMemory(2)
    x = np.random.default_rng().standard_normal((1, 3, 5, 5, 5), dtype=np.float32)

    async def main():
        async with two_engines_and_runner(tmp_path, regions, fake) as (_engines, runner):
            for n, link in enumerate(runner.links):
                link.hello["device"] = f"cuda:{n}"
            front = EngineCudaSharedMemory(runner, 8, None, str(regions))
            await front.register("r", fake.export(x.tobytes(), device=1), 1, x.nbytes)
            on_1 = runner.engine_for(1)
            assert on_1.hello["device"] == "cuda:1"
            tensor, _ = front.read("r", 0, x.shape, np.dtype(np.float32), "input 'input'")
            with busier(on_1):
                r = await runner.run(tensor, "FP32")
            assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
            assert fake.opens == 1  # only where it was registered

    asyncio.run(main())


def test_cuda_regions_through_a_front_end_are_mapped_read_and_written_by_the_engine(tmp_path):
    """CUDA shared memory with --frontends (the fake device layer standing in for the GPU): a registration goes to
    the engine, which opens the handle and checks it; the front end knows the region by its shared record; the
    engine reads the input where it lies and writes the output into the client's memory; an unregister frees the
    name at once and the engine unmaps once its last reader is done."""
    rng = np.random.default_rng()
    regions = tmp_path / "regions"
    regions.mkdir()
    fake = FakeDeviceMemory(2)

    async def main():
        async with engine_and_runner(tmp_path, regions_dir=str(regions), device_memory=fake) as (engine, runner,
                                                                                                   _stop, _lost):
            assert runner.cuda_devices == 2
            system = SharedMemoryRegistry(shared_dir=str(regions))
            front = EngineCudaSharedMemory(runner, 8, system, str(regions))
            system.cuda = front
            x = rng.standard_normal((3, 3, 6, 7, 8), dtype=np.float32)
            out_bytes = 3 * 16 * 4
            handle = fake.export(x.tobytes() + bytes(out_bytes))
            await front.register("r", handle, 0, x.nbytes + out_bytes)
            assert fake.opens == 1 and fake.mapped == 1  # in the engine, at registration
            assert [(r.name, r.device_id, r.byte_size) for r in front.status("")] == [("r", 0, x.nbytes + out_bytes)]
            assert front.holds("r") and system.status("") == []
            f32 = np.dtype(np.float32)
            tensor, lease = front.read("r", 0, x.shape, f32, "input 'input'")
            assert lease is None and tensor.nbytes == x.nbytes
            results = await asyncio.gather(*(runner.run(tensor, "FP32") for _ in range(4)))
            for r in results:
                assert relative_error(torch.from_numpy(r.output.copy()), _ref(x)) <= 1e-5
            assert runner.copied_bytes == 0  # nothing went through the arena
            await front.store("r", x.nbytes, results[0].output.tobytes(), "output 'output'")
            written = np.frombuffer(fake.contents(handle)[x.nbytes:], np.float32).reshape(3, 16)
            np.testing.assert_array_equal(written, results[0].output)
            # FP16 where it lies, half the bytes
            half = x.astype(np.float16)
            handle16 = fake.export(half.tobytes(), device=1)
            await front.register("h", handle16, 1, half.nbytes)
            tensor16, _ = front.read("h", 0, x.shape, np.dtype(np.float16), "input 'input'")
            r16 = await runner.run(tensor16, "FP16")
            assert relative_error(torch.from_numpy(r16.output.copy()), _ref(half.astype(np.float32))) <= 1e-5

            # What is refused, by whom: the front end (name, size, device, bounds, names taken), the engine (a
            # handle that does not open, a size beyond the allocation), with the server's codes and sentences.
            async def refused(call) -> ServingError:
                with pytest.raises(ServingError) as err:
                    await call
                return err.value

            assert (await refused(front.register("r", handle, 0, 16))).code == Status.ALREADY_EXISTS
            assert (await refused(front.register("d", handle, 2, 16))).code == Status.INVALID_ARGUMENT
            bad = await refused(front.register("g", os.urandom(64), 0, 16))
            assert bad.code == Status.INVALID_ARGUMENT and "does not open" in bad.message
            big = await refused(front.register("b", fake.export(256), 0, 257))
            assert big.code == Status.INVALID_ARGUMENT and "exceeds the 256 bytes" in big.message
            with pytest.raises(ServingError) as err:
                front.read("r", out_bytes + 4, x.shape, f32, "input 'input'")
            assert err.value.code == Status.INVALID_ARGUMENT and "outside" in err.value.message
            with pytest.raises(ServingError) as err:
                front.read("r", 2, x.shape, f32, "input 'input'")  # not on a whole element
            assert err.value.code == Status.INVALID_ARGUMENT and "multiple of 4 bytes" in err.value.message
            forged = await refused(front.register("f", fake.export(4096, inside=4), 0, 64))
            assert forged.code == Status.INVALID_ARGUMENT and "not the start of one" in forged.message
            with pytest.raises(ServingError) as err:
                front.read("nope", 0, x.shape, f32, "input 'input'")
            assert err.value.code == Status.NOT_FOUND
            assert (await refused(front.store("r", x.nbytes + 8, bytes(out_bytes), "output"))).code \
                == Status.INVALID_ARGUMENT
            assert fake.mapped == 2  # the refused registrations left nothing open

            # Unregistered while the engine still reads it: gone for new requests at once, unmapped after.
            reading = engine.cuda_shm.lease("r", 0, 64, "a reader")
            await front.unregister("r")
            assert not front.holds("r")
            assert (await refused(runner.run(tensor, "FP32"))).code == Status.NOT_FOUND  # the engine's check
            assert fake.mapped == 2
            reading.release()
            assert fake.mapped == 1
            await front.register("r", handle, 0, x.nbytes)  # the name is free again
            await front.unregister("")
            assert front.status("") == [] and fake.mapped == 0
            with pytest.raises(ServingError) as err:
                await front.unregister("r")
            assert err.value.code == Status.NOT_FOUND

    asyncio.run(main())


class _FrontEndThread(ServerThread):
    """A front end (VoxServer in the FRONTEND role) on a thread of its own, for engines already listening."""

    def __init__(self, settings: Settings, role: Role) -> None:
        self.role = role
        super().__init__(settings)

    async def _make(self) -> VoxServer:
        return VoxServer(self.settings, self.role)


@contextlib.contextmanager
def fake_layer_front_end(tmp_path, page_locker=None):
    """A front end over gRPC in front of a CPU engine whose CUDA shared memory is the fake device layer (and, with
    ``page_locker``, which reads system shared-memory segments in place, as a GPU engine does)."""
    run_dir = tmp_path / "run"
    (run_dir / "regions").mkdir(parents=True)
    (run_dir / "stats").mkdir()
    fake = FakeDeviceMemory(2)
    path = str(tmp_path / "engine.sock")
    engine = Engine(Settings(device="cpu"), path, regions_dir=str(run_dir / "regions"), device_memory=fake,
                    page_locker=page_locker)
    engine.load()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    serving = loop.create_task(engine.serve(stop))
    thread = threading.Thread(target=loop.run_until_complete, args=(serving,), daemon=True)
    thread.start()
    settings = Settings(host="127.0.0.1", grpc_port=0, http_port=-1, metrics_port=-1, device="cpu")
    front = _FrontEndThread(settings, Role(FRONTEND, str(run_dir), "0", (path,)))
    try:
        assert front.wait_ready(), front.server.load_error
        yield front, engine, fake
    finally:
        front.stop()
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def test_cuda_shared_memory_over_grpc_through_a_front_end(tmp_path):
    """The protocol's calls through a front end: tritonclient's (our client's) register, status, inference with the
    input and the output in the client's memory (written there by the engine as part of the request: the front end
    sends no second operation to store it), counted as cuda_shm bytes; FP16 too; unregister."""
    w, b = reference_weights()
    rng = np.random.default_rng()
    with fake_layer_front_end(tmp_path) as (front, engine, fake), Client(front.url) as client:
        assert "cuda_shared_memory" in client.server_metadata().extensions
        assert engine.cuda_shm is not None
        stores, store = [], engine.cuda_shm.store
        engine.cuda_shm.store = lambda *args, **kwargs: (stores.append(args[0]), store(*args, **kwargs))[1]
        counted = 0
        for datatype in ("FP32", "FP16"):
            x = rng.standard_normal((2, 3, 6, 5, 7), dtype=np.float32)
            wire = to_wire(x, datatype)
            exact = torch.from_numpy(np.frombuffer(wire, np.float16).astype(np.float32).reshape(x.shape)
                                     if datatype == "FP16" else x)
            out_bytes = 2 * 16 * 4
            handle = fake.export(wire + bytes(out_bytes), device=1)
            client.register_cuda_shared_memory("io", handle, 1, len(wire) + out_bytes)
            assert client.cuda_shared_memory_status() == {"io": (1, len(wire) + out_bytes)}
            assert engine.cuda_shm is not None and engine.cuda_shm.status("io")[0].mapping is not None
            assert client.infer_shared_memory(x.shape, "io", datatype=datatype, output_region="io",
                                              output_offset=len(wire)) is None
            y = np.frombuffer(fake.contents(handle)[len(wire):], "<f4").reshape(2, 16).copy()
            assert relative_error(torch.from_numpy(y), reference_float64(exact, w, b)) <= 1e-5
            assert stores == []  # no CONTROL "write" after the request: the engine wrote it with the request
            np.testing.assert_array_equal(client.infer_shared_memory(x.shape, "io", datatype=datatype), y)
            counted += 2 * len(wire)
            with pytest.raises(InferenceError) as err:
                client.infer_shared_memory(x.shape, "io", datatype=datatype, input_offset=out_bytes + 8)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            client.unregister_cuda_shared_memory("io")
            assert client.cuda_shared_memory_status() == {} and fake.mapped == 0
        with pytest.raises(InferenceError) as err:
            client.register_cuda_shared_memory("g", os.urandom(64), 0, 64)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "does not open" in str(err.value)
        assert front.server.metrics.registry.get_sample_value(
            "voxserve_input_bytes_total", {"model": "voxnet", "path": "cuda_shm"}) == counted
        assert front.server.metrics.registry.get_sample_value(
            "voxserve_input_bytes_total", {"model": "voxnet", "path": "wire"}) in (None, 0.0)


def test_system_shared_memory_through_a_front_end_is_read_in_place_by_the_engine(tmp_path):
    """Where the engines page-lock clients' segments (GPU engines; the fake page-locker here), a front end passes a
    system shared-memory input on by region: the engine maps the segment and reads the tensor where it lies (no
    copy in the front end, none into its arena); the checks stay the front end's and the engine's (a shrunk segment
    is INVALID_ARGUMENT and the server goes on); an unregistered region's mapping goes once nothing reads it."""
    w, b = reference_weights()
    x = np.random.default_rng().standard_normal((2, 3, 6, 5, 7), dtype=np.float32)
    locker = FakePageLocker()
    with fake_layer_front_end(tmp_path, locker) as (front, engine, _fake), Client(front.url) as client, \
            SharedMemoryBuffer(f"vox_fe_{uuid.uuid4().hex[:8]}", x.nbytes + 2 * 16 * 4) as segment:
        assert front.server.shm.by_reference and engine.shm is not None
        segment.write(x)
        client.register_system_shared_memory("sys", segment.key, segment.size)
        for _ in range(3):
            y = client.infer_shared_memory(x.shape, "sys")
            assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
        assert client.infer_shared_memory(x.shape, "sys", output_region="sys", output_offset=x.nbytes) is None
        np.testing.assert_array_equal(segment.read(np.float32, (2, 16), offset=x.nbytes), y)
        assert engine.shm.in_place_reads == 4 and engine.shm.copies == 0 and front.server.shm.copies == 0
        assert front.server.state.runner.copied_bytes == 0 and locker.locks == 1
        assert front.server.service.shm_budget.used == 0
        os.truncate("/dev/shm" + segment.key, x.nbytes // 2)  # the client shrinks its segment
        with pytest.raises(InferenceError) as err:
            client.infer_shared_memory(x.shape, "sys")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "smaller" in str(err.value)
        np.testing.assert_array_equal(client.infer(x), y)  # still serving
        client.unregister_system_shared_memory("sys")
        deadline = time.monotonic() + 10
        while engine.shm.pinned_bytes and time.monotonic() < deadline:
            engine.shm.status("")  # (the engine drops a mapping it finds unregistered)
            time.sleep(0.01)
        assert engine.shm.pinned_bytes == 0 and locker.unlocks == 1


async def _until(predicate, step: float = 0.01) -> None:
    while not predicate():
        await asyncio.sleep(step)


def test_frontends_setting_is_checked():
    validate(Settings(frontends=4))
    validate(Settings(frontends="auto"))
    for bad in (Settings(frontends=-1), Settings(frontends=65), Settings(frontends="many"),
                Settings(frontend_arena_bytes=1000)):
        with pytest.raises(ValueError, match="--frontend"):
            validate(bad)


def _parse(argv, environ=None):
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, environ or {})
    return from_namespace(parser.parse_args(argv))


def test_frontends_auto_is_read_from_the_flag_and_its_environment_twin():
    assert _parse(["--frontends", "auto"]).frontends == "auto"
    assert _parse(["--frontends", "AUTO"]).frontends == "auto"
    assert _parse(["--frontends", "3"]).frontends == 3
    assert _parse([], {"VOXSERVE_FRONTENDS": "auto"}).frontends == "auto"
    with pytest.raises(Exception, match="frontends"):
        _parse(["--frontends", "lots"])


def test_frontends_auto_sizes_to_the_cores_on_a_gpu_and_stays_in_process_on_the_cpu():
    auto = Settings(frontends="auto")
    assert resolve_frontends(auto, gpu_count=1, cpus=16) == 12
    assert resolve_frontends(auto, gpu_count=2, cpus=32, engines=2) == 24
    assert resolve_frontends(auto, gpu_count=2, cpus=32) == 16  # one engine process driving both GPUs
    assert resolve_frontends(auto, gpu_count=1, cpus=1) == 1  # never none with a GPU
    assert resolve_frontends(auto, gpu_count=1, cpus=2.5) == 1  # a fractional container quota
    assert resolve_frontends(auto, gpu_count=1, cpus=64) == 16  # at most 16 per engine (one GPU replica)
    assert resolve_frontends(auto, gpu_count=2, cpus=64, engines=2) == 32
    assert resolve_frontends(auto, gpu_count=8, cpus=224, engines=8) == 64  # the flag's own bound
    assert resolve_frontends(auto, gpu_count=0, cpus=16) == 0  # the model needs the CPU itself
    assert resolve_frontends(Settings(frontends="auto", device="cpu"), gpu_count=1, cpus=16) == 0
    assert resolve_frontends(Settings(frontends=5), gpu_count=0, cpus=2) == 5  # a number is kept as given


def test_usable_cpus_follow_the_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    here = tmp_path / "self"
    here.write_text("0::/\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(v2), str(here)) == 1.5
    assert usable_cpus(str(v2), str(here)) == min(1.5, affinity)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(v2), str(here)) is None
    assert usable_cpus(str(v2), str(here)) == affinity
    # This process's own cgroup and its ancestors: the tightest quota among them.
    (v2 / "pods" / "pod1").mkdir(parents=True)
    (v2 / "pods" / "cpu.max").write_text("300000 100000\n")
    (v2 / "pods" / "pod1" / "cpu.max").write_text("max 100000\n")
    here.write_text("0::/pods/pod1\n")
    assert cgroup_cpu_quota(str(v2), str(here)) == 3.0
    (v2 / "pods" / "pod1" / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_quota(str(v2), str(here)) == 2.5
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    here.write_text("12:cpu,cpuacct:/\n")
    assert cgroup_cpu_quota(str(tmp_path / "v1"), str(here)) == 4.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(str(tmp_path / "v1"), str(here)) is None
    assert cgroup_cpu_quota(str(tmp_path / "none"), str(tmp_path / "missing")) is None


# --- the whole server: two front ends and an engine ------------------------------------------------------


def _rest_infer(port: int, x: np.ndarray) -> tuple[int, np.ndarray]:
    body = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/voxnet/infer", body),
                                timeout=60) as response:
        doc = json.loads(response.read())
        return response.status, np.asarray(doc["outputs"][0]["data"], np.float32).reshape(doc["outputs"][0]["shape"])


def test_two_front_ends_and_an_engine_behind_one_port(tmp_path):
    rng = np.random.default_rng()
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--frontends", "2", "--frontend-arena-bytes",
                       str(MiB), "--grace-period-s", "20") as srv:
        proc, url, metrics_port = srv.proc, srv.url, srv.metrics_port
        # voxserve_model_ready is the minimum over the engine and both front ends.
        _wait_for(lambda: _metric(metrics_port, "voxserve_model_ready") == 1.0, 240, "engine and front ends ready")
        clients = [Client(url, timeout_s=60) for _ in range(12)]  # 12 connections: the kernel spreads them
        x = rng.standard_normal((2, 3, 5, 6, 7), dtype=np.float32)
        for c in clients:
            assert relative_error(torch.from_numpy(c.infer(x)), _ref(x)) <= 1e-5
        big = rng.standard_normal((30, 3, 10, 12, 10), dtype=np.float32)  # 1.4 MB: in pieces through 1 MiB arenas
        assert relative_error(torch.from_numpy(clients[0].infer(big)), _ref(big)) <= 1e-5
        # Bad input is the front end's to refuse.
        with pytest.raises(InferenceError) as err:
            clients[1].infer(rng.standard_normal((1, 4, 5, 5, 5), dtype=np.float32))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # Shared memory: the input is read straight into a front end's arena, the output written back.
        with SharedMemoryBuffer(f"vox_fe_{uuid.uuid4().hex[:8]}", x.nbytes) as seg:
            seg.write(x.view(np.uint8).reshape(-1))
            clients[0].register_system_shared_memory("fe_in", seg.key, x.nbytes)
            for c in clients:
                y = c.infer_shared_memory(x.shape, "fe_in")
                assert relative_error(torch.from_numpy(y), _ref(x)) <= 1e-5
            clients[3].unregister_system_shared_memory("fe_in")
        # REST: the front ends share the supervisor's REST port too (a connection per request here).
        for _ in range(12):
            status, y = _rest_infer(srv.http_port, x)
            assert status == 200 and relative_error(torch.from_numpy(y), _ref(x)) <= 1e-5
        expected = 2 * 2 * len(clients) + len(big) + 2 * 12
        def published() -> bool:  # executions are counted by the engine, requests by the front ends
            stats = clients[2].model_statistics()
            return stats.inference_count == expected and 0 < stats.execution_count <= expected

        _wait_for(published, 10, "every process's statistics")
        assert _metric(metrics_port, "voxserve_samples_total") == expected
        for c in clients:
            c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    text = srv.log
    assert text.count("(front end of 1 engine(s))") == 2 and "engine 0 ready on cpu" in text
    admitted = [int(n) for n in re.findall(r"stopped: (\d+) requests admitted", text)]
    assert len(admitted) == 2 and min(admitted) > 0, admitted  # both front ends served (12 connections)
    assert not os.path.exists(str(tmp_path / "engine-0.sock"))


def test_children_stop_when_the_supervisor_is_killed(tmp_path):
    """SIGKILL leaves the supervisor no chance to pass anything on: the children must notice by themselves."""
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--frontends", "1") as srv:
        proc = srv.proc
        _wait_for(lambda: _metric(srv.metrics_port, "voxserve_model_ready") == 1.0, 240, "engine and front end ready")
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", (tmp_path / "server.log").read_text())]
        assert len(pids) == 2
        proc.kill()
        proc.wait()

        def gone(pid: int) -> bool:
            try:
                return proc_stat(f"/proc/{pid}/stat")[1][0] == "Z"  # a zombie has exited
            except FileNotFoundError:
                return True

        _wait_for(lambda: all(gone(p) for p in pids), 60, "the engine and the front end to exit")


def test_frontends_auto_serves_in_process_when_the_model_runs_on_the_cpu(tmp_path):
    rng = np.random.default_rng()
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--frontends", "auto") as srv:
        with Client(srv.url, timeout_s=60) as c:
            _wait_for(c.is_ready, 120, "server ready")
            x = rng.standard_normal((1, 3, 4, 5, 6), dtype=np.float32)
            assert relative_error(torch.from_numpy(c.infer(x)), _ref(x)) <= 1e-5
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
    assert "--frontends auto: 0 front ends" in srv.log
    assert "front end 0" not in srv.log and "engine 0" not in srv.log  # no supervisor: one process serves


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_frontends_auto_starts_front_ends_for_a_gpu(tmp_path):
    """On a GPU host --frontends auto starts the front ends it logs (three quarters of the usable cores, at
    most 16 for one engine) in front of an engine on the GPU, and they answer within fp32 of float64."""
    expected = resolve_frontends(Settings(frontends="auto"), engines=1)
    rng = np.random.default_rng()
    with serve_process(tmp_path / "server.log", "--frontends", "auto", "--frontend-arena-bytes", str(16 * MiB)) as srv:
        _wait_for(lambda: _metric(srv.metrics_port, "voxserve_model_ready") == 1.0, 300, "every process ready")
        clients = [Client(srv.url, timeout_s=60) for _ in range(4)]
        x = rng.standard_normal((2, 3, 16, 32, 32), dtype=np.float32)
        for c in clients:
            assert relative_error(torch.from_numpy(c.infer(x)), _ref(x)) <= 1e-5
            c.close()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=90) == 0
    assert f"--frontends auto: {expected} front ends" in srv.log
    assert srv.log.count("(front end of 1 engine(s))") == expected and "engine 0 ready on cuda" in srv.log


def _cuda_shm_bytes(metrics_port: int) -> float:
    """voxserve_input_bytes_total on the cuda_shm path, summed over every process's series."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "voxserve_input_bytes_total" and sample.labels.get("path") == "cuda_shm")


def _cuda_round_through(url: str, exporter, x: np.ndarray, datatype: str) -> None:
    """One region of ``x`` in ``datatype``: registered through one connection, 16 requests over 8 connections
    (both front ends) writing their outputs into the region, one answered in the response, then unregistered."""
    wire = to_wire(x, datatype)
    exact = np.frombuffer(wire, np.float16).astype(np.float32).reshape(x.shape) if datatype == "FP16" else x
    out_bytes = x.shape[0] * 16 * 4
    memory = exporter.alloc(len(wire) + 16 * out_bytes, wire)
    name = f"gpu_{datatype}"
    clients = [Client(url, timeout_s=60) for _ in range(8)]
    try:
        assert "cuda_shared_memory" in clients[0].server_metadata().extensions
        clients[0].register_cuda_shared_memory(name, memory.handle, 0, memory.size)
        for c in clients:
            assert c.cuda_shared_memory_status(name) == {name: (0, memory.size)}

        def one(i: int) -> None:
            assert clients[i % 8].infer_shared_memory(x.shape, name, datatype=datatype, output_region=name,
                                                      output_offset=len(wire) + i * out_bytes) is None

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(16)))
        for i in range(16):  # (the exporter answers one question at a time)
            y = np.frombuffer(exporter.read(memory, len(wire) + i * out_bytes, out_bytes), "<f4").reshape(-1, 16)
            assert relative_error(torch.from_numpy(y.copy()), _ref(exact)) <= 1e-5
        y = clients[0].infer_shared_memory(x.shape, name, datatype=datatype)
        assert relative_error(torch.from_numpy(y), _ref(exact)) <= 1e-5
        clients[1].unregister_cuda_shared_memory(name)
        for c in clients[:4]:
            with pytest.raises(InferenceError) as err:
                c.infer_shared_memory(x.shape, name, datatype=datatype)
            assert err.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        for c in clients:
            c.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("engines", [1, 2])
def test_cuda_shared_memory_through_two_front_ends_on_a_gpu(tmp_path, engines):
    """A client process's device memory (a real CUDA IPC export) through --frontends 2: registered through one
    front end, used through every connection (the port spreads them over both front ends), the input read where it
    lies by an engine and the output written into the client's memory; FP32 and FP16 within fp32 of float64;
    requests batched; unregistered, and refused after. With two engines on the GPU both serve the region, the one
    that did not register it mapping it at its first request."""
    from ..cuda_exporter import Exporter

    x = np.random.default_rng().standard_normal((4, 3, 16, 32, 32), dtype=np.float32)
    with serve_process(tmp_path / "server.log", "--frontends", "2", "--replicas", str(engines)) as srv, \
            Exporter() as exporter:
        _wait_for(lambda: _metric(srv.metrics_port, "voxserve_model_ready") == 1.0, 300, "every process ready")
        for datatype in ("FP32", "FP16"):
            _cuda_round_through(srv.url, exporter, x, datatype)
        assert _cuda_shm_bytes(srv.metrics_port) == 17 * (x.nbytes + x.nbytes // 2)  # 17 of each datatype
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=90) == 0
    assert ("mapped here too" in srv.log) == (engines == 2), srv.log


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_system_shared_memory_through_two_front_ends_is_dmad_by_the_engine_on_a_gpu(tmp_path):
    """--frontends 2 on a GPU, whose engines page-lock clients' segments: system shared-memory inputs answered within
    fp32 of float64 over every connection (by region, read in place by the engine: the counts of that are checked
    with the fake page-locker, test_system_shared_memory_through_a_front_end_is_read_in_place_by_the_engine), no
    page-lock refused; a shrunk segment is refused and the server goes on."""
    x = np.random.default_rng().standard_normal((4, 3, 16, 32, 32), dtype=np.float32)
    with serve_process(tmp_path / "server.log", "--frontends", "2") as srv, \
            SharedMemoryBuffer(f"vox_fe_gpu_{uuid.uuid4().hex[:8]}", x.nbytes) as segment:
        _wait_for(lambda: _metric(srv.metrics_port, "voxserve_model_ready") == 1.0, 300, "every process ready")
        segment.write(x)
        clients = [Client(srv.url, timeout_s=60) for _ in range(8)]
        try:
            clients[0].register_system_shared_memory("sys", segment.key, segment.size)
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                outputs = list(pool.map(lambda i: clients[i % 8].infer_shared_memory(x.shape, "sys"), range(16)))
            for y in outputs:
                assert relative_error(torch.from_numpy(y), _ref(x)) <= 1e-5
            os.truncate("/dev/shm" + segment.key, x.nbytes // 2)
            for c in clients[:4]:
                with pytest.raises(InferenceError) as err:
                    c.infer_shared_memory(x.shape, "sys")
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert relative_error(torch.from_numpy(clients[0].infer(x)), _ref(x)) <= 1e-5
            clients[0].unregister_system_shared_memory("sys")
        finally:
            for c in clients:
                c.close()
    assert "page-locking shared-memory region" not in srv.log  # no refusal: every input was read in place


def test_region_trailers_name_the_input_and_the_output_the_engine_writes():
    assert ipc.parse_region(ipc.region_trailer("system", "seg")) == ("system", "seg", None)
    assert ipc.parse_region(ipc.region_trailer("cuda", "in")) == ("cuda", "in", None)
    trailer = ipc.region_trailer("cuda", "in put", ("out", 4096))
    assert ipc.parse_region(trailer) == ("cuda", "in put", ("out", 4096))
    assert ipc.parse_region(ipc.region_trailer("cuda", "same", ("same", 0))) == ("cuda", "same", ("same", 0))
    with pytest.raises(ValueError):
        ipc.region_trailer("system", "seg", ("out", 0))
    for cut in (trailer[:3], trailer[:1 + ipc.RESULT.size] + b"i", b"x" + trailer[1:], b""):
        with pytest.raises(ValueError):
            ipc.parse_region(cut)
