"""The engine of --frontends and the output a request's INFER_REGION record names (server/topology/engine.py
``_request``, ``_Reply``, ``_Store``; ipc.py ``region_trailer``/``parse_region``): leases, hostile trailers, what the
client's region holds afterwards."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import time
import types
import uuid

import grpc
import numpy as np
import pytest

from voxserve.client import Client, InferenceError
from voxserve.server.core.batching import DynamicBatcher
from voxserve.server.core.devicemem import DeviceArray
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.settings import Settings
from voxserve.server.topology import ipc
from voxserve.server.topology.engine import Engine
from voxserve.testing.fake_devicemem import FakeDeviceMemory

from .test_frontends import fake_layer_front_end

COUT = 16
SHAPE = (6, 3, 4, 4, 4)  # three chunks of two samples where max_batch is 2


class DeviceLayer(FakeDeviceMemory):
    """The fake layer whose mappings are device memory (not host memory): the registry hands out DeviceArrays, as on
    a GPU, and the engine attaches the output as the input's ``result``. Nothing here reads them."""

    def open(self, handle, device, nbytes=None):
        return dataclasses.replace(super().open(handle, device, nbytes), host=False)


class Outbox:
    def __init__(self) -> None:
        self.records: list[tuple[tuple, bytes]] = []

    def put(self, record: bytes) -> None:
        header = ipc.REPLY.unpack_from(record)
        self.records.append((header, record[ipc.REPLY.size:]))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """An engine's model, loaded once (each test gives it a registry of its own)."""
    tmp = tmp_path_factory.mktemp("engine")
    engine = Engine(Settings(device="cpu"), str(tmp / "e.sock"), regions_dir=str(tmp), device_memory=FakeDeviceMemory())
    engine.load()
    return engine


def _engine(loaded, tmp_path, layer) -> Engine:
    """An engine (the loaded one's model) whose CUDA regions are ``layer``'s, recorded in ``tmp_path``."""
    engine = Engine(Settings(device="cpu"), str(tmp_path / "e.sock"), regions_dir=str(tmp_path), device_memory=layer)
    engine._models, engine.hello = loaded._models, dict(loaded.hello)
    from voxserve.server.protocol.cudashm import CudaSharedMemoryRegistry

    engine.cuda_shm = CudaSharedMemoryRegistry(layer, 8, shared_dir=str(tmp_path))
    return engine


def _record(shape, trailer: bytes, req_id: int = 1, offset: int = 0, nbytes: int | None = None,
            deadline: float = float("nan")) -> tuple:
    nbytes = math.prod(shape) * 4 if nbytes is None else nbytes
    return ipc.REQUEST.unpack(ipc.REQUEST.pack(ipc.INFER_REGION, 0, len(trailer), req_id, offset, nbytes, deadline,
                                               *shape))


class _Chunks:
    """An executor for a DynamicBatcher whose executions are held until the test lets each go (``release(i)``; with
    ``fail``, that one raises): two run at once, as on a GPU with a pipeline of two slots."""

    def __init__(self) -> None:
        self.started: list[tuple[list, asyncio.Event, list]] = []

    async def execute(self, arrays: list, datatype: str) -> np.ndarray:
        go, outcome = asyncio.Event(), []
        self.started.append((arrays, go, outcome))
        await go.wait()
        if outcome and outcome[0] == "fail":
            raise ServingError(Status.INTERNAL, "the execution failed")
        return np.zeros((sum(int(a.shape[0]) for a in arrays), COUT), np.float32)

    def release(self, index: int, fail: bool = False) -> None:
        _arrays, go, outcome = self.started[index]
        if fail:
            outcome.append("fail")
        go.set()


async def _until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("ending", ["a chunk fails", "the deadline passes between chunks"])
def test_a_large_request_that_fails_is_answered_once_its_running_chunks_are_over(loaded, tmp_path, ending):
    """A request of more than max_batch samples runs as chunks, several in flight at once; when one fails (or its
    deadline passes before its last chunk forms) while another chunk is still executing (reading the input in the
    client's region and writing its output rows there on the device), the request is answered only once that chunk
    is over: an unregistered region stays mapped under the execution, and closes as the answer goes out."""
    layer = DeviceLayer(1)
    engine = _engine(loaded, tmp_path, layer)
    chunks = _Chunks()

    async def main():
        batcher = DynamicBatcher(chunks.execute, max_batch=2, max_delay_s=0.0, max_queue=64, max_inflight=2)
        engine.runner = types.SimpleNamespace(enqueue=batcher.enqueue, max_batch=2)
        in_bytes, out_bytes = math.prod(SHAPE) * 4, SHAPE[0] * COUT * 4
        await engine.cuda_shm.register("io", layer.export(in_bytes + out_bytes), 0, in_bytes + out_bytes)
        outbox, pending = Outbox(), {}
        deadline = time.monotonic() + (2.0 if ending != "a chunk fails" else 3600.0)
        trailer = ipc.region_trailer("cuda", "io", ("io", in_bytes))
        engine._request(_record(SHAPE, trailer, deadline=deadline), trailer, np.zeros(0, np.uint8), pending, outbox)
        await _until(lambda: len(chunks.started) == 2)  # chunks 0 and 1 execute, chunk 2 waits for a slot
        first = chunks.started[1][0][0]
        assert isinstance(first, DeviceArray) and first.result is not None  # the output is written with it
        del first
        await engine.cuda_shm.unregister("io")  # the client unregisters: the mapping waits for its last lease
        assert layer.mapped == 1 and engine.cuda_shm.draining == 1
        if ending == "a chunk fails":
            chunks.release(0, fail=True)
        else:
            await _until(lambda: time.monotonic() > deadline + 0.01)
            chunks.release(0)
        await asyncio.sleep(0.05)
        # chunk 1 is still executing: no answer yet, and its input and output still mapped
        assert outbox.records == [] and len(chunks.started) == 2  # (and chunk 2 never starts)
        assert layer.mapped == 1 and layer.closes == 0, "the region was unmapped under a running execution"
        chunks.release(1)
        await _until(lambda: outbox.records)
        [(header, _message)] = outbox.records
        assert header[0] == ipc.ERROR
        assert Status.of(header[1]) == (Status.INTERNAL if ending == "a chunk fails" else Status.DEADLINE_EXCEEDED)
        chunks.started.clear()
        await _until(lambda: layer.mapped == 0)  # ... unmapped with the answer, no collection needed
        assert engine.cuda_shm.draining == 0 and len(chunks.started) == 0
        await batcher.close()

    asyncio.run(main())


def test_every_lease_of_a_request_ends_on_each_path(loaded, tmp_path):
    """Success, an error after the input was leased (the output's span refused), a cancellation while queued, a
    deadline passed in the queue, a queue that refuses it: with the region unregistered after each, nothing stays
    mapped."""
    layer = DeviceLayer(1)
    engine = _engine(loaded, tmp_path, layer)
    shape = (2, 3, 4, 4, 4)
    in_bytes, out_bytes = math.prod(shape) * 4, shape[0] * COUT * 4
    size = in_bytes + out_bytes

    async def one(name: str, path: str) -> tuple:
        chunks = _Chunks()
        batcher = DynamicBatcher(chunks.execute, max_batch=8, max_delay_s=0.0, max_queue=0 if path == "full" else 8)
        engine.runner = types.SimpleNamespace(enqueue=batcher.enqueue, max_batch=8)
        await engine.cuda_shm.register(name, layer.export(size), 0, size)
        outbox, pending = Outbox(), {}
        out_at = size - out_bytes + 4 if path == "output outside" else in_bytes
        trailer = ipc.region_trailer("cuda", name, (name, out_at))
        deadline = time.monotonic() - 1 if path == "expired" else float("nan")
        engine._request(_record(shape, trailer, deadline=deadline), trailer, np.zeros(0, np.uint8), pending, outbox)
        if path == "cancelled":
            pending[1].cancel()
        if path in ("ok", "failed"):
            await _until(lambda: chunks.started)
            chunks.release(0, fail=path == "failed")
        await _until(lambda: outbox.records or (path == "cancelled" and not pending))
        await _until(lambda: not batcher._running)
        await batcher.close()
        await engine.cuda_shm.unregister(name)
        chunks.started.clear()
        gc.collect()
        return tuple(outbox.records[0][0][:2]) if outbox.records else None, layer.mapped, engine.cuda_shm.draining

    async def main():
        for n, path in enumerate(("ok", "failed", "output outside", "cancelled", "expired", "full")):
            header, mapped, draining = await one(f"r{n}", path)
            assert (mapped, draining) == (0, 0), path
            if path == "ok":
                assert header[0] == ipc.OK
            elif path != "cancelled":
                assert header[0] == ipc.ERROR, path

    asyncio.run(main())


# --- hostile trailers: a corrupt front-end stream must not take the engine down, nor make it touch memory ------------


def _hostile_trailers(name: str, in_bytes: int, size: int) -> dict[str, bytes]:
    raw = name.encode()
    result = ipc.WITH_RESULT

    def with_result(length: int, offset: int, names: bytes) -> bytes:
        return result + ipc.RESULT.pack(length, offset) + names

    return {
        "output past the end": ipc.region_trailer("cuda", name, (name, size - 4)),
        "output offset 2**64 - 4": with_result(len(raw), 2**64 - 4, raw + raw),
        "output offset not on a float": with_result(len(raw), in_bytes + 2, raw + raw),
        "no output name": with_result(len(raw), in_bytes, raw),
        "no input name": with_result(0, in_bytes, raw),
        "input name longer than the names": with_result(0xFFFF, in_bytes, raw + raw),
        "names cut short": result + b"\x01",
        "undecodable output name": with_result(len(raw), in_bytes, raw + b"\xff\xfe"),
        "output name with a NUL": with_result(len(raw), in_bytes, raw + b"o\x00"),
        "output name climbing out of the run directory": with_result(len(raw), in_bytes, raw + b"../../etc/passwd"),
        "unknown kind": b"z" + raw,
        "empty": b"",
    }


def test_hostile_trailers_are_answered_with_an_error_and_leave_nothing_leased_or_written(loaded, tmp_path):
    layer = DeviceLayer(1)
    engine = _engine(loaded, tmp_path, layer)
    shape = (2, 3, 4, 4, 4)
    in_bytes, out_bytes = math.prod(shape) * 4, shape[0] * COUT * 4
    size = in_bytes + out_bytes
    enqueued = []

    async def main():
        loop = asyncio.get_running_loop()
        engine.runner = types.SimpleNamespace(enqueue=lambda *args: (enqueued.append(args), loop.create_future())[1],
                                              max_batch=8)
        handle = layer.export(b"\x5a" * size)
        await engine.cuda_shm.register("io", handle, 0, size)
        outbox, pending = Outbox(), {}
        for n, (case, trailer) in enumerate(_hostile_trailers("io", in_bytes, size).items()):
            engine._request(_record(shape, trailer, req_id=n), trailer, np.zeros(0, np.uint8), pending, outbox)
            assert not enqueued and len(outbox.records) == n + 1, case
            header = outbox.records[-1][0]
            assert header[0] == ipc.ERROR and header[3] == n, case
            assert Status.of(header[1]) in (Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.INTERNAL), case
        # still serving: a good record is enqueued, with its output attached
        trailer = ipc.region_trailer("cuda", "io", ("io", in_bytes))
        engine._request(_record(shape, trailer, req_id=99), trailer, np.zeros(0, np.uint8), pending, outbox)
        assert enqueued and enqueued[-1][0].result is not None
        pending[99].cancel()  # (never executed: the leases go with the tensor)
        await asyncio.sleep(0)
        enqueued.clear()
        gc.collect()
        assert layer.contents(handle) == b"\x5a" * size  # nothing written anywhere
        await engine.cuda_shm.unregister("")
        gc.collect()
        assert layer.mapped == 0 and engine.cuda_shm.draining == 0

    asyncio.run(main())


# --- what the client's region holds after a request that fails -------------------------------------------------------


def test_a_non_finite_output_is_invalid_argument_and_is_not_stored_into_the_clients_region(tmp_path):
    """Through a front end, as in one process: a sample whose output is not finite fails the request with
    INVALID_ARGUMENT, and the output region is left as it was (the engine stores the output after the execution,
    where the execution could not write it: it must not store what the front end will refuse)."""
    x = np.random.default_rng().standard_normal((2, 3, 5, 5, 5), dtype=np.float32)
    x[1, 0, 0, 0, 0] = np.nan
    out_bytes = 2 * COUT * 4
    sentinel = b"\x11" * out_bytes
    with fake_layer_front_end(tmp_path) as (front, _, fake), Client(front.url) as client:
        handle = fake.export(x.tobytes() + sentinel, device=0)
        name = f"nan{uuid.uuid4().hex[:6]}"
        client.register_cuda_shared_memory(name, handle, 0, x.nbytes + out_bytes)
        with pytest.raises(InferenceError) as err:
            client.infer_shared_memory(x.shape, name, output_region=name, output_offset=x.nbytes)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sample 1" in str(err.value)
        assert fake.contents(handle)[x.nbytes:] == sentinel
        client.unregister_cuda_shared_memory(name)
