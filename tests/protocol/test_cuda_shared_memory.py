"""CUDA shared memory: the protocol's messages, the region registry's rules with a fake device layer, and the three
RPCs over real gRPC (our stubs and tritonclient's) against an in-process server given that fake layer."""

from __future__ import annotations

import ast
import asyncio
import base64
import concurrent.futures
import ctypes
import dataclasses
import functools
import gc
import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from google.protobuf import descriptor_pool
from google.protobuf.message_factory import GetMessageClass

from voxserve.client import Client, InferenceError, SharedMemoryBuffer
from voxserve.client.client import build_shm_request
from voxserve.datatypes import from_wire, to_wire
from voxserve.kernels import reference_float64, reference_weights
from voxserve.proto import pb, pb_grpc
from voxserve.server.app import VoxServer
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.core.model import relative_error
from voxserve.server.protocol import shm
from voxserve.server.protocol.codec import ModelSpec, decode_request, shared_memory_input_bytes
from voxserve.server.protocol.cudashm import CudaSharedMemoryRegistry, NotMappedHere
from voxserve.server.protocol.shm import SharedMemoryRegistry
from voxserve.server.settings import Settings
from voxserve.server.topology.roles import REPLICA, Role
from voxserve.testing.fake_devicemem import FakeDeviceMemory

from ..conftest import ServerThread
from ..records import as_in_one_tick

CUDA_MESSAGES = ("CudaSharedMemoryStatusRequest", "CudaSharedMemoryStatusResponse", "CudaSharedMemoryRegisterRequest",
                 "CudaSharedMemoryRegisterResponse", "CudaSharedMemoryUnregisterRequest",
                 "CudaSharedMemoryUnregisterResponse")
CUDA_RPCS = ("CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister")
SPEC = ModelSpec("voxnet", "1", 3, 16, 3, 64)
STANDALONE_ROLE = Role()


# --- the protocol ---------------------------------------------------------------------------------------------------
# tritonclient's descriptors are read from its modules' source into a pool of their own: importing tritonclient.grpc
# would put its files in protobuf's default pool, where other tests' clients (kserve's) put files of the same names.

@functools.lru_cache(maxsize=1)
def _tritonclient_pool() -> descriptor_pool.DescriptorPool:
    spec = importlib.util.find_spec("tritonclient")
    if spec is None or spec.origin is None:
        pytest.skip("tritonclient (a test dependency) is not installed")
    pool = descriptor_pool.DescriptorPool()
    for module in ("model_config_pb2.py", "service_pb2.py"):
        tree = ast.parse((Path(spec.origin).parent / "grpc" / module).read_text())
        pool.AddSerializedFile(next(node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
                                    and getattr(node.func, "attr", "") == "AddSerializedFile"))
    return pool


def _triton(name: str):
    return GetMessageClass(_tritonclient_pool().FindMessageTypeByName(f"inference.{name}"))


def _fields(descriptor) -> list:
    """A message's fields, nested messages included, as (name, number, type, repeated) rows."""
    rows = [(f.name, f.number, f.type, f.is_repeated) for f in descriptor.fields]
    for nested in descriptor.nested_types:
        rows.append((nested.name, _fields(nested)))
    return rows


@pytest.mark.parametrize("name", CUDA_MESSAGES)
def test_messages_match_tritonclients_descriptor(name):
    assert _fields(pb.DESCRIPTOR.message_types_by_name[name]) == _fields(_triton(name).DESCRIPTOR)


def test_messages_serialise_byte_identically_to_tritonclients():
    rnd = random.Random()
    for _ in range(50):
        name = "".join(rnd.choices("abcxyz_-.0", k=rnd.randint(0, 20)))
        handle = rnd.randbytes(rnd.choice((0, 63, 64, 65)))
        device_id, byte_size = rnd.randint(-(1 << 63), (1 << 63) - 1), rnd.randint(0, (1 << 64) - 1)
        ours = pb.CudaSharedMemoryRegisterRequest(name=name, raw_handle=handle, device_id=device_id,
                                                  byte_size=byte_size)
        theirs = _triton("CudaSharedMemoryRegisterRequest")(name=name, raw_handle=handle, device_id=device_id,
                                                            byte_size=byte_size)
        assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
        status_ours, status_theirs = pb.CudaSharedMemoryStatusResponse(), _triton("CudaSharedMemoryStatusResponse")()
        for i in range(rnd.randint(0, 3)):
            region = (f"{name}{i}", rnd.randint(0, (1 << 64) - 1), byte_size)
            status_ours.regions[region[0]].CopyFrom(status_ours.RegionStatus(
                name=region[0], device_id=region[1], byte_size=region[2]))
            status_theirs.regions[region[0]].CopyFrom(status_theirs.RegionStatus(
                name=region[0], device_id=region[1], byte_size=region[2]))
        assert status_ours.SerializeToString(deterministic=True) == status_theirs.SerializeToString(deterministic=True)
        for request in ("CudaSharedMemoryStatusRequest", "CudaSharedMemoryUnregisterRequest"):
            ours_bytes = getattr(pb, request)(name=name).SerializeToString()
            assert ours_bytes == _triton(request)(name=name).SerializeToString()


def test_rpc_paths_are_tritonclients():
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = _tritonclient_pool().FindServiceByName("inference.GRPCInferenceService")
    for rpc in CUDA_RPCS:
        mine, triton_method = ours.methods_by_name[rpc], theirs.methods_by_name[rpc]
        assert (ours.full_name, mine.input_type.full_name, mine.output_type.full_name) == (
            theirs.full_name, triton_method.input_type.full_name, triton_method.output_type.full_name)


# --- the registry, with the fake device layer ------------------------------------------------------------------------

def _registry(devices: int = 2, max_regions: int = 8, system=None, shared_dir=None):
    fake = FakeDeviceMemory(devices)
    return fake, CudaSharedMemoryRegistry(fake, max_regions, system, shared_dir)


def _status(fn, *args) -> tuple[Status, str]:
    with pytest.raises(ServingError) as err:
        result = fn(*args)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    return err.value.code, err.value.message


def test_register_lease_and_unregister():
    fake, reg = _registry()
    data = os.urandom(4096)
    handle = fake.export(data, device=1)
    asyncio.run(reg.register("r", handle, 1, 4000))
    assert fake.opens == 1 and fake.open_threads != [threading.current_thread().name]  # opened off the loop
    [region] = reg.status("r")
    assert (region.name, region.device_id, region.byte_size) == ("r", 1, 4000)
    lease = reg.lease("r", 100, 3900, "input")  # ends exactly at the region's end
    assert ctypes.string_at(lease.address, lease.nbytes) == data[100:4000] and lease.device == 1
    lease.release()
    lease.release()  # idempotent
    asyncio.run(reg.unregister("r"))
    assert (fake.opens, fake.closes, fake.mapped) == (1, 1, 0)
    assert reg.status("") == []
    assert _status(reg.lease, "r", 0, 1, "input")[0] == Status.NOT_FOUND


@pytest.mark.parametrize("size", [0, 1, 63, 65, 64 * 1024])
def test_a_raw_handle_must_be_64_bytes(size):
    fake, reg = _registry()
    code, message = _status(reg.register, "r", b"\x01" * size, 0, 16)
    assert code == Status.INVALID_ARGUMENT and f"raw_handle is {size} bytes" in message and "64" in message
    assert fake.opens == 0


def test_handles_that_do_not_open_get_a_sentence_and_leave_nothing_open():
    fake, reg = _registry()
    freed = fake.export(64)
    fake.free(freed)
    cases = {"unknown": os.urandom(64), "zeros": bytes(64), "freed": freed,
             "own": fake.export(64, own_process=True)}
    for what, handle in cases.items():
        code, message = _status(reg.register, what, handle, 0, 16)
        assert code == Status.INVALID_ARGUMENT, what
        assert message.startswith(f"region {what!r}: raw_handle does not open on device 0: "), message
        assert "(cudaError" in message and "Traceback" not in message
        assert handle.hex() not in message
    assert reg.status("") == [] and fake.mapped == 0


def test_byte_size_is_checked_against_the_allocations_real_extent():
    fake, reg = _registry()
    handle = fake.export(1000)
    code, message = _status(reg.register, "r", handle, 0, 1001)
    assert code == Status.INVALID_ARGUMENT and "byte_size 1001" in message and "1000 bytes" in message
    assert (fake.opens, fake.closes) == (1, 1)  # opened to be measured, closed again
    for bad in (0, -1):
        assert "must be > 0" in _status(reg.register, "r", handle, 0, bad)[1]
    asyncio.run(reg.register("r", handle, 0, 1000))


@pytest.mark.parametrize("inside", [1, 2, 4, 16, 128])
def test_a_forged_handle_that_maps_a_misaligned_address_inside_an_allocation_is_refused(inside):
    """A handle with its offset bytes changed opens (the driver maps that address inside the exporter's allocation,
    seen on an H200), and a read at a misaligned address faults the kernel and poisons the device for every client.
    A real handle maps its allocation's start, which cudaMalloc aligns to 256 bytes: anything else is refused."""
    fake, reg = _registry()
    code, message = _status(reg.register, "r", fake.export(4096, inside=inside), 0, 64)
    assert code == Status.INVALID_ARGUMENT and f"{inside} bytes into a device allocation" in message, message
    assert reg.status("") == [] and fake.mapped == 0  # opened to be looked at, closed again
    asyncio.run(reg.register("r", fake.export(4096, inside=256), 0, 64))  # aligned: the client's own memory


@pytest.mark.parametrize(("dtype", "offset", "refused"), [
    (np.float32, 2, True), (np.float32, 6, True), (np.float32, 4, False),
    (np.float16, 1, True), (np.float16, 2, False), (np.uint16, 3, True)])
def test_tensors_in_a_region_start_on_a_whole_element(dtype, offset, refused):
    fake, reg = _registry()
    asyncio.run(reg.register("r", fake.export(4096), 0, 4096))
    dtype = np.dtype(dtype)
    if refused:
        code, message = _status(reg.read, "r", offset, (1, 3, 4, 4, 4), dtype, "input 'input'")
        assert code == Status.INVALID_ARGUMENT and f"offset {offset}" in message
        assert f"multiple of {dtype.itemsize} bytes" in message
    else:
        tensor, lease = reg.read("r", offset, (1, 3, 4, 4, 4), dtype, "input 'input'")
        assert tensor.ctypes.data % dtype.itemsize == 0
        lease.release()


@pytest.mark.parametrize("device_id", [-1, 2, 3, (1 << 63) - 1, -(1 << 63)])
def test_device_ids_out_of_range(device_id):
    fake, reg = _registry(devices=2)
    code, message = _status(reg.register, "r", fake.export(64), device_id, 16)
    assert code == Status.INVALID_ARGUMENT and f"device_id {device_id}" in message and "2 CUDA devices" in message
    assert fake.opens == 0


@pytest.mark.parametrize("name", ["", "a/b", "../x", "x\n", "é", "n" * 129, "sp ace"])
def test_region_names_follow_system_shared_memorys_rules(name):
    fake, reg = _registry()
    code, message = _status(reg.register, name, fake.export(64), 0, 16)
    assert code == Status.INVALID_ARGUMENT and "must be 1-128 letters" in message
    assert len(message) < 200


def test_names_are_one_namespace_with_system_shared_memory():
    system = SharedMemoryRegistry()
    fake, reg = _registry(system=system)
    system.cuda = reg
    with SharedMemoryBuffer(f"vox_cuda_{uuid.uuid4().hex[:8]}", 64) as segment:
        system.register("sys", segment.key, 0, 64)
        code, message = _status(reg.register, "sys", fake.export(64), 0, 16)
        assert code == Status.ALREADY_EXISTS and "system shared memory" in message
        asyncio.run(reg.register("gpu", fake.export(64), 0, 16))
        code, message = _status(system.register, "gpu", segment.key, 0, 64)
        assert code == Status.ALREADY_EXISTS and "CUDA shared memory" in message
        assert _status(reg.register, "gpu", fake.export(64), 0, 16)[0] == Status.ALREADY_EXISTS
        system.unregister("")
    assert (fake.opens, fake.closes) == (1, 0)  # the refused registrations never opened their handles


def test_the_region_limit():
    fake, reg = _registry(max_regions=2)
    for name in ("a", "b"):
        asyncio.run(reg.register(name, fake.export(64), 0, 64))
    code, message = _status(reg.register, "c", fake.export(64), 0, 64)
    assert code == Status.RESOURCE_EXHAUSTED and "--max-cuda-shm-regions" in message
    asyncio.run(reg.unregister("a"))
    asyncio.run(reg.register("c", fake.export(64), 0, 64))


@pytest.mark.parametrize(("offset", "size"), [(0, 101), (1, 100), (100, 1), (-1, 1), (0, -1), ((1 << 63) - 1, 1),
                                              (0, (1 << 64) - 1), ((1 << 64) - 1, (1 << 64) - 1)])
def test_lease_bounds_are_exact(offset, size):
    fake, reg = _registry()
    asyncio.run(reg.register("r", fake.export(4096), 0, 100))
    code, message = _status(reg.lease, "r", offset, size, "input 'input'")
    assert code == Status.INVALID_ARGUMENT and "outside CUDA shared-memory region 'r' (100 bytes)" in message
    for ok in ((0, 100), (99, 1), (100, 0)):
        reg.lease("r", *ok, "input").release()


def test_unregister_while_leased_defers_the_close_to_the_last_release():
    fake, reg = _registry()
    asyncio.run(reg.register("r", fake.export(256), 0, 256))
    leases = [reg.lease("r", 0, 256, "input") for _ in range(3)]
    asyncio.run(reg.unregister("r"))
    assert _status(reg.lease, "r", 0, 1, "input")[0] == Status.NOT_FOUND  # the name is gone at once
    assert reg.status("") == [] and reg.draining == 1 and fake.closes == 0
    asyncio.run(reg.register("r", fake.export(256), 0, 256))  # and can be registered again
    leases[0].release()
    leases[1].release()
    assert fake.closes == 0
    del leases[2]  # dropped without release (a cancelled request): the finalizer releases it
    gc.collect()
    assert fake.closes == 1 and reg.draining == 0
    asyncio.run(reg.unregister(""))
    assert (fake.opens, fake.closes, fake.mapped) == (2, 2, 0)


def test_unregister_all_and_unknown_names():
    fake, reg = _registry()
    for name in ("a", "b", "c"):
        asyncio.run(reg.register(name, fake.export(64), 0, 64))
    held = reg.lease("b", 0, 64, "input")
    assert _status(reg.unregister, "zz")[0] == Status.NOT_FOUND
    assert _status(reg.status, "zz")[0] == Status.NOT_FOUND
    asyncio.run(reg.unregister(""))
    assert reg.status("") == [] and fake.closes == 2 and reg.draining == 1
    held.release()
    assert fake.closes == 3 and fake.mapped == 0


def test_a_close_that_fails_is_logged_not_raised(caplog):
    fake, reg = _registry()
    asyncio.run(reg.register("r", fake.export(64), 0, 64))
    asyncio.run(reg.register("s", fake.export(64), 0, 64))
    lease = reg.lease("s", 0, 64, "input")
    fake.fail_close = True
    with caplog.at_level(logging.WARNING):
        asyncio.run(reg.unregister("r"))
        asyncio.run(reg.unregister("s"))
        lease.release()
    assert sum("closing its mapping failed" in r.getMessage() for r in caplog.records) == 2
    assert reg.status("") == []


def test_close_unmaps_everything_of_this_process():
    fake, reg = _registry()
    asyncio.run(reg.register("r", fake.export(64), 0, 64))
    asyncio.run(reg.register("s", fake.export(64), 0, 64))
    lease = reg.lease("s", 0, 64, "input")  # held past the stop (an execution the server no longer waits for)
    asyncio.run(reg.unregister("s"))
    assert reg.draining == 1 and fake.mapped == 2
    reg.close()
    assert fake.mapped == 0
    lease.release()  # after close(): nothing left to do, and no error (it raised ValueError before)
    assert fake.mapped == 0 and fake.closes == 2


def test_a_lease_collected_while_its_registry_is_locked_does_not_deadlock():
    """A lease's finalizer may run on a thread inside one of the registry's own calls (a cycle collected there):
    the lock is not reentrant, so the release is queued and done as the call lets go (it deadlocked before)."""
    fake, reg = _registry()
    asyncio.run(reg.register("r", fake.export(64), 0, 64))
    lease = reg.lease("r", 0, 64, "input")
    asyncio.run(reg.unregister("r"))
    done = threading.Event()

    def inside() -> None:
        with reg._locked():
            lease.release()  # as a finalizer would, while this thread holds the lock
        done.set()

    thread = threading.Thread(target=inside, daemon=True)
    thread.start()
    assert done.wait(10), "deadlocked"
    assert fake.mapped == 0 and reg.draining == 0


def test_regions_waiting_for_their_last_lease_count_against_the_limit():
    fake, reg = _registry(max_regions=2)
    leases = []
    for i in range(2):
        asyncio.run(reg.register(f"r{i}", fake.export(64), 0, 64))
        leases.append(reg.lease(f"r{i}", 0, 64, "input"))
        asyncio.run(reg.unregister(f"r{i}"))
    assert _status(asyncio.run, reg.register("r9", fake.export(64), 0, 64))[0] == Status.RESOURCE_EXHAUSTED
    for lease in leases:
        lease.release()
    asyncio.run(reg.register("r9", fake.export(64), 0, 64))
    assert fake.mapped == 1


def test_a_registration_cancelled_while_its_handle_opens_leaves_nothing_open():
    fake, reg = _registry()
    started, proceed = threading.Event(), threading.Event()
    real_open = fake.open

    def slow_open(handle, device, nbytes=None):
        started.set()
        proceed.wait(10)
        return real_open(handle, device, nbytes)

    fake.open = slow_open  # type: ignore[method-assign]

    async def scenario():
        task = asyncio.create_task(reg.register("r", fake.export(64), 0, 64))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        proceed.set()
        while fake.closes == 0:  # the late close runs on the executor
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert (fake.opens, fake.closes) == (1, 1) and reg.status("") == []
    asyncio.run(reg.register("r", fake.export(64), 0, 64))  # the name was given back


def test_registrations_waiting_for_their_handles_leave_the_event_loops_threads_to_the_other_work():
    """Opening a handle waits for the handle's check (one at a time, each a read of a whole allocation): a burst
    of registrations (up to --max-cuda-shm-regions of them, one allocation's handle under many names) must not
    take every thread of the event loop's default executor, on which system shared-memory inputs are copied and
    mappings closed."""
    fake, reg = _registry(max_regions=8)
    gate, started = threading.Event(), threading.Event()
    real_open = fake.open

    def slow_open(handle, device, nbytes=None):
        started.set()
        gate.wait(30)
        return real_open(handle, device, nbytes)

    fake.open = slow_open  # type: ignore[method-assign]
    handle = fake.export(64)

    async def scenario():
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(2))
        registering = [asyncio.create_task(reg.register(f"r{i}", handle, 0, 64)) for i in range(4)]
        await asyncio.sleep(0)
        started.wait(30)
        try:
            assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), 10) == 7
        finally:
            gate.set()
            await asyncio.gather(*registering)

    asyncio.run(scenario())
    assert len(reg.status("")) == 4 and fake.mapped == 4


def test_replicas_share_names_and_open_their_own_mappings(tmp_path):
    fake_a, a = _registry(shared_dir=str(tmp_path))
    fake_b, b = _registry(shared_dir=str(tmp_path))
    b.devices = fake_a  # one host: the same exporter's handles (two "processes" of one fake)
    data = os.urandom(128)
    handle = fake_a.export(data)
    asyncio.run(a.register("r", handle, 0, 128))
    assert [r.name for r in b.status("")] == ["r"] and fake_a.opens == 1  # seen through the record, not opened
    assert _status(b.register, "r", fake_a.export(64), 0, 64)[0] == Status.ALREADY_EXISTS
    lease = b.lease("r", 8, 16, "input")  # opened lazily in b
    assert ctypes.string_at(lease.address, 16) == data[8:24] and fake_a.opens == 2
    record = tmp_path / "r-r"  # it holds the handle: readable by the server's user only
    assert '"kind": "cuda"' in record.read_text() and record.stat().st_mode & 0o777 == 0o600
    asyncio.run(a.unregister("r"))
    assert _status(b.lease, "r", 0, 1, "input")[0] == Status.NOT_FOUND  # gone for b too ...
    assert fake_a.closes == 1
    lease.release()  # ... and b's mapping closes after its last lease
    assert fake_a.closes == 2 and fake_a.mapped == 0
    # one namespace with system regions across replicas too: the record file is the name
    system = SharedMemoryRegistry(shared_dir=str(tmp_path))
    asyncio.run(b.register("x", fake_a.export(64), 0, 64))
    with SharedMemoryBuffer(f"vox_cuda_{uuid.uuid4().hex[:8]}", 64) as segment:
        assert _status(system.register, "x", segment.key, 0, 64)[0] == Status.ALREADY_EXISTS
        assert system.status("") == []
    asyncio.run(b.unregister(""))
    assert fake_b.opens == 0


def test_a_replicas_first_use_of_a_region_opens_it_outside_the_lock_and_off_the_event_loop(tmp_path):
    """In a replica that did not register a region, a request decoded on the event loop opens nothing there (the
    open is a blocking CUDA call): NotMappedHere, nothing held; the open (map_here's, or a lease's off the loop) does
    not hold the registry's lock; once mapped, the request decodes there. Nothing is budgeted as a copy either way."""
    fake, a = _registry(shared_dir=str(tmp_path))
    _, b = _registry(shared_dir=str(tmp_path))
    b.devices = fake
    x = np.ones((1, 3, 3, 3, 3), np.float32)
    asyncio.run(a.register("r", fake.export(x.tobytes()), 0, x.nbytes))
    system = SharedMemoryRegistry(shared_dir=str(tmp_path))
    system.cuda = b
    request = build_shm_request(x.shape, "voxnet", "FP32", "r")
    assert b.status("r")[0].mapping is None and shared_memory_input_bytes(request, system) is None  # nothing to copy
    opens = fake.opens
    with pytest.raises(NotMappedHere):
        decode_request(request, SPEC, system, open_here=False)
    assert fake.opens == opens and b.status("r")[0].mapping is None and b.status("r")[0].in_use == 0
    locked_while_opening = []
    opening = fake.open

    def open_and_look(handle, device, nbytes=None):
        locked_while_opening.append(b._lock.locked())
        return opening(handle, device, nbytes)

    fake.open = open_and_look
    b.lease("r", 0, 4, "input").release()
    assert locked_while_opening == [False]
    decoded = decode_request(request, SPEC, system, open_here=False)  # mapped here now: decoded on the loop
    np.testing.assert_array_equal(np.asarray(decoded.array), x)
    assert decoded.lease is not None
    decoded.lease.release()
    asyncio.run(a.unregister(""))


def test_a_region_registered_anew_between_a_requests_checks_is_not_opened_on_the_event_loop(tmp_path):
    """The attack on a replica's check-then-read: the region it has mapped is registered anew (another allocation,
    through another replica) between the request's first look at it and its decode. The new allocation's handle is
    opened off the event loop (a blocking CUDA call would stall every request of the replica), and the request reads
    the new allocation's bytes."""
    fake = FakeDeviceMemory(2)
    settings = dataclasses.replace(Settings(host="127.0.0.1", grpc_port=0, http_port=0, metrics_port=-1, device="cpu"),
                                   max_cuda_shm_regions=4)
    srv = _FakeLayerServer(settings, fake, Role(kind=REPLICA, run_dir=str(tmp_path)))
    (tmp_path / "regions").mkdir(exist_ok=True)
    other = CudaSharedMemoryRegistry(fake, 4, shared_dir=str(tmp_path / "regions"))  # another replica
    rng = np.random.default_rng()
    first, second = (rng.standard_normal((1, 3, 3, 3, 3), dtype=np.float32) for _ in range(2))
    try:
        assert srv.wait_ready(), srv.server.load_error
        registry = srv.server.cuda_shm
        assert registry is not None
        with Client(srv.url) as client:
            asyncio.run(other.register("r", fake.export(first.tobytes()), 0, first.nbytes))
            np.testing.assert_array_equal(client.infer_shared_memory(first.shape, "r"), _infer(srv, first))
            assert registry.status("r")[0].mapping is not None  # mapped here by that first request
            holds, armed = registry.holds, [True]

            def holds_then_registered_anew(name: str) -> bool:
                held = holds(name)
                if armed[0] and name == "r":  # just after the request's first look: another allocation, same name
                    armed[0] = False
                    _elsewhere(other.unregister("r"))  # (this runs on the server's event loop)
                    _elsewhere(other.register("r", fake.export(second.tobytes()), 0, second.nbytes))
                return held

            registry.holds = holds_then_registered_anew
            fake.open_threads.clear()
            np.testing.assert_array_equal(client.infer_shared_memory(second.shape, "r"), _infer(srv, second))
            assert not armed[0] and fake.open_threads and srv._thread.name not in fake.open_threads, \
                fake.open_threads
            registry.holds = holds
    finally:
        asyncio.run(other.unregister(""))
        srv.stop()


def test_a_replicas_first_output_into_a_region_opens_it_off_the_event_loop(tmp_path):
    """An output into a region another replica registered (its input on the wire, or in another region) is this
    replica's first use of it: the open (and the handle's check, a read of the whole allocation) must not run on
    the event loop, which every request of the replica waits on; it runs on the registry's one opening thread, so
    outputs that wait for it hold that thread, not a share of the default executor's."""
    fake, a = _registry(shared_dir=str(tmp_path))
    _, b = _registry(shared_dir=str(tmp_path))
    b.devices = fake
    handle = fake.export(64)
    asyncio.run(a.register("out", handle, 0, 64))
    fake.open_threads.clear()

    async def store() -> str:
        await b.store("out", 0, b"y" * 64, "output 'output'")
        return threading.current_thread().name

    loop_thread = asyncio.run(store())
    assert fake.contents(handle) == b"y" * 64 and fake.open_threads and loop_thread not in fake.open_threads
    assert all(name.startswith("cuda-shm-open") for name in fake.open_threads), fake.open_threads
    asyncio.run(store())  # mapped here now: written inline
    asyncio.run(a.unregister(""))


def test_a_record_written_anew_within_a_tick_of_the_clock_is_read_again(tmp_path, monkeypatch):
    """With coarse file timestamps a region unregistered and registered again within one tick can leave a record
    with the old one's inode, size and mtime. Seen that soon after its mtime, the identity vouches for nothing: the
    other replica reads the record again and serves the new registration, not the allocation it mapped before."""
    monkeypatch.setattr(shm, "RACY_NS", 1 << 62)  # every record unsettled, however slow this run
    fake, a = _registry(shared_dir=str(tmp_path))
    _, b = _registry(shared_dir=str(tmp_path))
    b.devices = fake
    asyncio.run(a.register("r", fake.export(64), 0, 64))
    (first,) = b.status("r")
    path = a._record_path("r")
    old = os.stat(path)
    asyncio.run(a.unregister("r"))
    asyncio.run(a.register("r", fake.export(128), 1, 100))
    as_in_one_tick(monkeypatch, path, old)  # the new record, with the old one's identity
    (again,) = b.status("r")
    assert (again.token, again.device_id, again.byte_size) != (first.token, first.device_id, first.byte_size)
    assert (again.device_id, again.byte_size) == (1, 100)
    asyncio.run(a.unregister(""))


def test_a_record_that_cannot_be_read_again_right_now_keeps_its_region(tmp_path, monkeypatch):
    """Read again while its identity cannot vouch for it yet, an unchanged record that fails to read (a passing
    error) leaves the region as it was, mapped: not dropped as if unregistered."""
    monkeypatch.setattr(shm, "RACY_NS", 1 << 62)  # every record unsettled, however slow this run
    fake, a = _registry(shared_dir=str(tmp_path))
    _, b = _registry(shared_dir=str(tmp_path))
    b.devices = fake
    asyncio.run(a.register("r", fake.export(64), 0, 64))
    b.lease("r", 0, 8, "input").release()  # mapped in b
    monkeypatch.setattr(b, "_read_record", lambda name: None)
    assert b.holds("r") and b.status("r")[0].mapping is not None and fake.closes == 0
    asyncio.run(a.unregister(""))


# --- the RPCs over real gRPC, against an in-process server given the fake layer ---------------------------------------

class _FakeLayerServer(ServerThread):
    def __init__(self, settings, devices, role: Role = STANDALONE_ROLE) -> None:
        self.devices, self.role = devices, role
        super().__init__(settings)

    async def _make(self) -> VoxServer:
        return VoxServer(self.settings, self.role, device_memory=self.devices)


def _elsewhere(coroutine) -> None:
    """Run ``coroutine`` to its end on an event loop of its own in another thread, and wait for it."""
    worker = threading.Thread(target=asyncio.run, args=(coroutine,))
    worker.start()
    worker.join(30)


def _infer(srv: ServerThread, x: np.ndarray) -> np.ndarray:
    """The server's answer for ``x`` on the wire."""
    with Client(srv.url) as client:
        return client.infer(x)


@pytest.fixture(scope="module")
def gpu_less_cuda_server():
    """A CPU server whose CUDA shared memory goes through the fake device layer (two devices)."""
    fake = FakeDeviceMemory(2)
    srv = _FakeLayerServer(dataclasses.replace(Settings(host="127.0.0.1", grpc_port=0, http_port=0, metrics_port=-1,
                                                        device="cpu"), max_cuda_shm_regions=4), fake)
    try:
        assert srv.wait_ready(), srv.server.load_error
        yield srv, fake
    finally:
        srv.stop()


@pytest.fixture
def stub(gpu_less_cuda_server):
    srv, _ = gpu_less_cuda_server
    with grpc.insecure_channel(srv.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        yield stub
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest())
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())


def _rpc_error(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    return err.value.code(), err.value.details()


def test_the_rpcs_over_grpc(gpu_less_cuda_server, stub):
    _, fake = gpu_less_cuda_server
    assert "cuda_shared_memory" in stub.ServerMetadata(pb.ServerMetadataRequest()).extensions
    handle = fake.export(os.urandom(1 << 16), device=1)
    stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(name="in", raw_handle=handle, device_id=1,
                                                                     byte_size=1 << 16))
    response = stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest())
    assert {k: (v.name, v.device_id, v.byte_size) for k, v in response.regions.items()} == {
        "in": ("in", 1, 1 << 16)}
    assert handle not in response.SerializeToString()  # never the handle
    assert stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(name="in")).regions["in"].device_id == 1
    code, message = _rpc_error(stub.CudaSharedMemoryRegister, pb.CudaSharedMemoryRegisterRequest(
        name="in", raw_handle=fake.export(16), device_id=0, byte_size=16))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    code, message = _rpc_error(stub.CudaSharedMemoryRegister, pb.CudaSharedMemoryRegisterRequest(
        name="short", raw_handle=handle[:63], device_id=0, byte_size=16))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "raw_handle is 63 bytes" in message
    code, message = _rpc_error(stub.CudaSharedMemoryRegister, pb.CudaSharedMemoryRegisterRequest(
        name="big", raw_handle=fake.export(100), device_id=0, byte_size=101))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "byte_size 101 exceeds the 100 bytes" in message
    code, message = _rpc_error(stub.CudaSharedMemoryRegister, pb.CudaSharedMemoryRegisterRequest(
        name="dev", raw_handle=fake.export(100), device_id=2, byte_size=100))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "device_id 2" in message
    code, _ = _rpc_error(stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest(name="nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(name="in"))
    assert not stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest()).regions
    code, _ = _rpc_error(stub.CudaSharedMemoryUnregister, pb.CudaSharedMemoryUnregisterRequest(name="in"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert fake.mapped == 0


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_inference_reads_the_input_where_it_lies_and_writes_the_output_into_the_clients_region(
        gpu_less_cuda_server, stub, rng, datatype):
    """The whole protocol path through the fake layer (host memory): the input is read in the client's region
    (no copy), the output written into the client's region; the answers are float64's, and gRPC's over the wire."""
    srv, fake = gpu_less_cuda_server
    w, b = reference_weights()
    x = torch.randn((3, 3, 5, 6, 7), generator=rng).numpy()
    wire = to_wire(x, datatype)
    exact = torch.from_numpy(from_wire(wire, datatype, x.shape).copy())
    out_bytes = 3 * 16 * 4
    handle = fake.export(wire + bytes(out_bytes), device=1)
    writes = fake.writes
    with Client(srv.url) as client:
        client.register_cuda_shared_memory("gpu_io", handle, 1, len(wire) + out_bytes)
        assert client.cuda_shared_memory_status("gpu_io") == {"gpu_io": (1, len(wire) + out_bytes)}
        assert client.infer_shared_memory(x.shape, "gpu_io", datatype=datatype, output_region="gpu_io",
                                          output_offset=len(wire)) is None
        y = np.frombuffer(fake.contents(handle)[len(wire):], "<f4").reshape(3, 16).copy()
        assert fake.writes == writes + 1
        assert relative_error(torch.from_numpy(y), reference_float64(exact, w, b)) <= 1e-5
        np.testing.assert_array_equal(y, client.infer(exact.numpy(), datatype=datatype))
        # Input there, output in the response
        np.testing.assert_array_equal(client.infer_shared_memory(x.shape, "gpu_io", datatype=datatype), y)
        client.unregister_cuda_shared_memory("gpu_io")
        assert client.cuda_shared_memory_status() == {}


def test_input_bytes_are_counted_by_the_path_they_took(gpu_less_cuda_server):
    """voxserve_input_bytes_total{path}: wire, system_shm (copied from the segment), cuda_shm (read in place)."""
    srv, fake = gpu_less_cuda_server
    x = np.random.default_rng().standard_normal((2, 3, 4, 5, 6), dtype=np.float32)

    def counted(path: str) -> float:
        return srv.server.metrics.registry.get_sample_value("voxserve_input_bytes_total",
                                                            {"model": "voxnet", "path": path}) or 0.0

    before = {p: counted(p) for p in ("wire", "system_shm", "cuda_shm")}
    with Client(srv.url) as client:
        client.infer(x)
        with SharedMemoryBuffer(f"vox_path_{uuid.uuid4().hex[:8]}", x.nbytes) as segment:
            segment.write(x)
            client.register_system_shared_memory("sys_path", segment.key, x.nbytes)
            client.infer_shared_memory(x.shape, "sys_path")
            client.infer_shared_memory(x.shape, "sys_path")
            client.unregister_system_shared_memory("sys_path")
        client.register_cuda_shared_memory("gpu_path", fake.export(x.tobytes()), 0, x.nbytes)
        for _ in range(3):
            client.infer_shared_memory(x.shape, "gpu_path")
        client.unregister_cuda_shared_memory("gpu_path")
    assert {p: counted(p) - before[p] for p in before} == {"wire": x.nbytes, "system_shm": 2 * x.nbytes,
                                                           "cuda_shm": 3 * x.nbytes}


def test_cuda_region_bounds_and_sizes_in_a_request(gpu_less_cuda_server, stub):
    srv, fake = gpu_less_cuda_server
    shape = (1, 3, 4, 4, 4)
    nbytes = 4 * 3 * 4 * 4 * 4
    mapped = fake.mapped
    stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(name="small", raw_handle=fake.export(nbytes),
                                                                     device_id=0, byte_size=nbytes))
    with Client(srv.url) as client:
        with pytest.raises(InferenceError) as err:
            client.infer_shared_memory(shape, "small", input_offset=4)  # past the region's end by 4 bytes
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "outside CUDA shared-memory region" in \
            err.value.message
        with pytest.raises(InferenceError) as err:
            client.infer_shared_memory(shape, "small", output_region="small", output_offset=nbytes - 8)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(InferenceError) as err:
            client.infer_shared_memory(shape, "absent")
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        # The request whose output could not be written read its input; its lease ended with it (a failure's
        # traceback kept the tensor, and the client's memory mapped, until a garbage collection before).
        client.unregister_cuda_shared_memory("small")
        assert fake.mapped == mapped


def test_an_unregister_while_an_execution_reads_the_region_waits_for_it(gpu_less_cuda_server, stub):
    """The lease travels with the tensor: unregistering during an inference frees the name at once and unmaps
    the memory only once the execution has let go of it."""
    srv, fake = gpu_less_cuda_server
    shape = (2, 3, 6, 6, 6)
    nbytes = 4 * int(np.prod(shape))
    stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(
        name="busy", raw_handle=fake.export(np.ones(shape, np.float32).tobytes()), device_id=0, byte_size=nbytes))
    mapped = fake.mapped
    with Client(srv.url) as client:
        answers = [client.infer_shared_memory(shape, "busy") for _ in range(2)]
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(name="busy"))
        np.testing.assert_array_equal(answers[0], answers[1])
    deadline = time.monotonic() + 10
    while fake.mapped != mapped - 1 and time.monotonic() < deadline:  # the last lease goes with its tensor
        time.sleep(0.01)
    assert fake.mapped == mapped - 1


# tritonclient.grpc in a process of its own (as tests/e2e/test_tritonclient.py runs it): see _tritonclient_pool.
_TRITONCLIENT_GRPC = """
import base64, json, sys
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
url, handle, garbage = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
client = grpcclient.InferenceServerClient(url)
report = {}
# tritonclient takes cuda_shared_memory.get_raw_handle()'s base64 and sends the raw bytes
client.register_cuda_shared_memory("t", base64.b64encode(handle), 1, 4096)
report["status"] = client.get_cuda_shared_memory_status(as_json=True)
report["one"] = [r.name for r in client.get_cuda_shared_memory_status("t").regions.values()]
try:
    client.register_cuda_shared_memory("u", base64.b64encode(garbage), 0, 16)
except InferenceServerException as exc:
    report["garbage"] = [exc.status(), exc.message()]
report["extensions"] = client.get_server_metadata(as_json=True)["extensions"]
client.unregister_cuda_shared_memory("t")
report["after"] = client.get_cuda_shared_memory_status(as_json=True)
client.unregister_cuda_shared_memory()
client.close()
print(json.dumps(report))
"""


def test_tritonclients_cuda_shared_memory_calls(gpu_less_cuda_server):
    if importlib.util.find_spec("tritonclient") is None:
        pytest.skip("tritonclient (a test dependency) is not installed")
    srv, fake = gpu_less_cuda_server
    handle = fake.export(4096, device=1)
    proc = subprocess.run([sys.executable, "-c", _TRITONCLIENT_GRPC, srv.url, handle.hex(), os.urandom(64).hex()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"]["regions"]["t"] == {"name": "t", "device_id": "1", "byte_size": "4096"}
    assert report["one"] == ["t"]
    assert report["garbage"][0] == "StatusCode.INVALID_ARGUMENT" and "does not open" in report["garbage"][1]
    assert "cuda_shared_memory" in report["extensions"]
    assert report["after"] == {}
    assert fake.mapped == 0


def test_a_server_without_a_device_layer_does_not_offer_cuda_shared_memory(server):
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert "cuda_shared_memory" not in stub.ServerMetadata(pb.ServerMetadataRequest()).extensions
        for call, request in ((stub.CudaSharedMemoryRegister, pb.CudaSharedMemoryRegisterRequest(
                name="r", raw_handle=bytes(64), device_id=0, byte_size=16)),
                (stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest()),
                (stub.CudaSharedMemoryUnregister, pb.CudaSharedMemoryUnregisterRequest())):
            code, message = _rpc_error(call, request)
            assert code == grpc.StatusCode.UNIMPLEMENTED and "does not offer CUDA shared memory" in message


def test_the_rest_routes_with_tritonclient_http(gpu_less_cuda_server):
    tritonclient_http = pytest.importorskip("tritonclient.http")
    tritonclient_utils = pytest.importorskip("tritonclient.utils")
    srv, fake = gpu_less_cuda_server
    handle = fake.export(2048, device=1)
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{srv.server.http_port}")
    try:
        client.register_cuda_shared_memory("h", base64.b64encode(handle), 1, 2000)  # get_raw_handle's form
        assert client.get_cuda_shared_memory_status() == [{"name": "h", "device_id": 1, "byte_size": 2000}]
        assert client.get_cuda_shared_memory_status("h") == [{"name": "h", "device_id": 1, "byte_size": 2000}]
        with pytest.raises(tritonclient_utils.InferenceServerException) as err:
            client.register_cuda_shared_memory("h2", base64.b64encode(handle[:32]), 1, 16)
        assert "raw_handle is 32 bytes" in err.value.message()
        with pytest.raises(tritonclient_utils.InferenceServerException) as err:
            client.register_cuda_shared_memory("h", base64.b64encode(fake.export(16)), 0, 16)
        assert "already registered" in err.value.message()
        client.unregister_cuda_shared_memory("h")
        assert client.get_cuda_shared_memory_status() == []
        client.unregister_cuda_shared_memory()
    finally:
        client.close()
    assert fake.mapped == 0


@pytest.mark.parametrize("body", [{}, {"raw_handle": "abc", "byte_size": 16},
                                  {"raw_handle": {"b64": "!!"}, "byte_size": 16},
                                  {"raw_handle": {"b64": "AAAA"}, "byte_size": -1},
                                  {"raw_handle": {"b64": "AAAA"}, "byte_size": 16, "device_id": True}])
def test_rest_register_bodies_that_are_refused(gpu_less_cuda_server, body):
    srv, _ = gpu_less_cuda_server
    request = urllib.request.Request(f"http://127.0.0.1:{srv.server.http_port}/v2/cudasharedmemory/region/r/register",
                                     data=json.dumps(body).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400 and "register body" in json.loads(err.value.read())["error"]


def test_cuda_inputs_take_nothing_from_the_budget_of_shared_memory_copies():
    """A CUDA region's input is read where it lies: --max-shm-inflight-bytes (the private copies of system
    shared-memory inputs) neither limits nor counts it."""
    fake = FakeDeviceMemory(1)
    settings = dataclasses.replace(Settings(host="127.0.0.1", grpc_port=0, http_port=-1, metrics_port=-1,
                                            device="cpu"), max_shm_inflight_bytes=1024)
    srv = _FakeLayerServer(settings, fake)
    try:
        assert srv.wait_ready(), srv.server.load_error
        x = np.random.default_rng().standard_normal((2, 3, 6, 6, 6), dtype=np.float32)  # 5 KB: over the budget
        with Client(srv.url) as client:
            client.register_cuda_shared_memory("big", fake.export(x.tobytes()), 0, x.nbytes)
            y = client.infer_shared_memory(x.shape, "big")
            w, b = reference_weights()
            assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
            assert srv.server.service.shm_budget.used == 0
            client.unregister_cuda_shared_memory()
    finally:
        srv.stop()


def test_the_device_layer_is_told_the_bytes_a_region_may_access(tmp_path):
    """Registration and a replica's first use open the handle for the region's byte_size (the device layer checks
    that many bytes before the server may read them: server/core/ipccheck.py)."""
    fake, a = _registry(shared_dir=str(tmp_path))
    _, b = _registry(shared_dir=str(tmp_path))
    b.devices = fake
    asked = []
    opening = fake.open

    def recording_open(handle, device, nbytes=None):
        asked.append(nbytes)
        return opening(handle, device, nbytes)

    fake.open = recording_open  # type: ignore[method-assign]
    asyncio.run(a.register("r", fake.export(4096), 0, 1000))
    b.lease("r", 0, 8, "input").release()  # opened in the other replica on first use
    assert asked == [1000, 1000]
    asyncio.run(a.unregister(""))


def test_a_replica_does_not_open_a_region_again_after_it_failed_to(tmp_path):
    """A region that does not open in a replica (its exporter freed it, or its check fails there) is refused at once
    from then on, without opening and checking its handle on every request; registered again, it is tried again."""
    fake, a = _registry(shared_dir=str(tmp_path))
    _, b = _registry(shared_dir=str(tmp_path))
    b.devices = fake
    handle = fake.export(256)
    asyncio.run(a.register("r", handle, 0, 256))
    fake.free(handle)  # the fake refuses a freed handle's new opens
    attempts = len(fake.open_threads)  # every open asked of the device layer, refused or not
    for what in ("input 'input'", "output 'output'", "input 'input'"):
        code, message = _status(b.lease, "r", 0, 8, what)
        assert code == Status.INVALID_ARGUMENT and message.startswith(f"{what}: ") and "does not open" in message
    assert len(fake.open_threads) == attempts + 1  # tried once
    asyncio.run(a.unregister("r"))
    again = fake.export(256)
    asyncio.run(a.register("r", again, 0, 256))
    b.lease("r", 0, 8, "input").release()  # a new registration: opened
    asyncio.run(a.unregister(""))


def test_a_replica_reads_a_shared_record_once_until_it_changes(tmp_path, monkeypatch):
    """Names are looked up on every request (holds, read, store): a record whose file is as last read (and settled:
    its mtime a while before that read) is not read and parsed again, a CUDA region's or a system region's alike;
    one unregistered and registered again is."""
    real_clock = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real_clock() + 2 * shm.RACY_NS)  # every record settled
    fake, a = _registry(shared_dir=str(tmp_path))
    _, b = _registry(shared_dir=str(tmp_path))
    b.devices = fake
    system = SharedMemoryRegistry(shared_dir=str(tmp_path))
    reads = []
    read_record = b._read_record
    monkeypatch.setattr(b, "_read_record", lambda name: reads.append(name) or read_record(name))
    asyncio.run(a.register("r", fake.export(64), 0, 64))
    with SharedMemoryBuffer(f"vox_rec_{uuid.uuid4().hex[:8]}", 64) as segment:
        system.register("sys", segment.key, 0, 64)
        for _ in range(5):
            assert b.holds("r") and not b.holds("sys") and not b.holds("none")
        assert sorted(reads) == ["r", "sys"]  # (a name with no record costs a stat, no read)
        token = b.status("r")[0].token
        asyncio.run(a.unregister("r"))
        assert not b.holds("r")
        asyncio.run(a.register("r", fake.export(32), 0, 32))
        (again,) = b.status("r")
        assert again.token != token and again.byte_size == 32
        system.unregister("")
    asyncio.run(a.unregister(""))
