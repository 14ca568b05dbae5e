"""Where a request's output goes when its input lies in a client's CUDA memory (codec ``_output_on_device``): the
execution writes it into the client's CUDA region (the input's ``result``) only where it can, and otherwise it is
stored after the execution; the leases of both end; a replica opens no region on the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import uuid

import grpc
import numpy as np
import pytest

from voxserve.client import Client, InferenceError, SharedMemoryBuffer
from voxserve.client.client import build_shm_request
from voxserve.server.core.devicemem import DeviceArray
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.protocol.codec import ModelSpec, decode_mapped, decode_request, shared_memory_input_bytes
from voxserve.server.protocol.cudashm import CudaSharedMemoryRegistry
from voxserve.server.protocol.shm import SharedMemoryRegistry
from voxserve.testing.fake_devicemem import FakeDeviceMemory

from .test_cuda_shared_memory import gpu_less_cuda_server  # noqa: F401 (a fixture)

SPEC = ModelSpec("voxnet", "1", 3, 16, 3, 64)
SHAPE = (2, 3, 4, 4, 4)
IN_BYTES = math.prod(SHAPE) * 4
OUT_BYTES = SHAPE[0] * SPEC.cout * 4


class DeviceLayer(FakeDeviceMemory):
    """The fake layer whose mappings are device memory, not host memory: the registry hands out DeviceArrays, as on a
    GPU (nothing here reads them)."""

    def open(self, handle, device, nbytes=None):
        return dataclasses.replace(super().open(handle, device, nbytes), host=False)


def _registries(tmp_path, devices: int = 2):
    layer = DeviceLayer(devices)
    system = SharedMemoryRegistry(shared_dir=str(tmp_path))
    cuda = CudaSharedMemoryRegistry(layer, 8, system, str(tmp_path))
    system.cuda = cuda
    return layer, system, cuda


def _request(output_region: str | None, output_offset: int = 0, input_region: str = "in"):
    return build_shm_request(SHAPE, "voxnet", "FP32", input_region, output_region=output_region,
                             output_offset=output_offset, output_byte_size=OUT_BYTES if output_region else None)


def _in_use(cuda: CudaSharedMemoryRegistry) -> dict[str, int]:
    return {name: region.in_use for name, region in cuda._regions.items()}


def test_where_the_output_goes(tmp_path):
    """On the input's device and on a whole float: written by the execution (``result``, with a lease of its own;
    overlapping the input too); not on a whole float, on another device, in a system region: stored after it (no
    output lease held); outside its region: INVALID_ARGUMENT before anything runs, the input's lease ended."""
    layer, system, cuda = _registries(tmp_path)

    async def register():
        await cuda.register("in", layer.export(IN_BYTES + OUT_BYTES + 4), 0, IN_BYTES + OUT_BYTES + 4)
        await cuda.register("other_device", layer.export(OUT_BYTES, device=1), 1, OUT_BYTES)

    asyncio.run(register())
    with SharedMemoryBuffer(f"vox_out_{uuid.uuid4().hex[:8]}", OUT_BYTES) as segment:
        system.register("sys", segment.key, 0, OUT_BYTES)
        for output, offset, on_device in (("in", IN_BYTES, True), ("in", 0, True), ("in", IN_BYTES + 2, False),
                                          ("other_device", 0, False), ("sys", 0, False)):
            decoded = decode_request(_request(output, offset), SPEC, system)
            assert isinstance(decoded.array, DeviceArray) and decoded.output_on_device == on_device, (output, offset)
            if on_device:
                assert decoded.array.result is not None and decoded.output_lease is not None
                assert decoded.array.result.address == decoded.array.address - 0 + offset
                assert decoded.array.result.shape == (SHAPE[0], SPEC.cout)
                assert _in_use(cuda) == {"in": 2, "other_device": 0}
            else:
                assert decoded.output_lease is None and _in_use(cuda) == {"in": 1, "other_device": 0}
            decoded.lease.release()
            if decoded.output_lease is not None:
                decoded.output_lease.release()
            assert _in_use(cuda) == {"in": 0, "other_device": 0}
        with pytest.raises(ServingError) as err:
            decode_request(_request("in", IN_BYTES + 8), SPEC, system)  # 4 bytes past the region's end
        assert err.value.code == Status.INVALID_ARGUMENT and "output 'output'" in err.value.message
        assert _in_use(cuda) == {"in": 0, "other_device": 0}
        system.unregister("sys")
    asyncio.run(cuda.unregister(""))
    assert layer.mapped == 0


def test_a_replicas_first_output_into_a_region_beside_an_input_it_maps_opens_it_off_the_event_loop(tmp_path):
    """In a replica that did not register the output's region, attaching the output to the input opens that region
    (a blocking open and the handle's check): that open must not run on the event loop, though its input region is
    mapped here already."""
    layer, _system_a, a = _registries(tmp_path)
    system = SharedMemoryRegistry(shared_dir=str(tmp_path))
    b = CudaSharedMemoryRegistry(layer, 8, system, str(tmp_path))  # another replica, the same host's memory
    system.cuda = b

    async def register():
        await a.register("in", layer.export(IN_BYTES), 0, IN_BYTES)
        await a.register("out", layer.export(OUT_BYTES), 0, OUT_BYTES)

    asyncio.run(register())
    b.lease("in", 0, 4, "input").release()  # an earlier request mapped the input's region in this replica
    request = _request("out")
    layer.open_threads.clear()

    async def decode() -> str:  # as InferenceService.infer decodes it
        assert shared_memory_input_bytes(request, system) is None  # (no copy to make: decoded on the loop)
        decoded = await decode_mapped(request, SPEC, system)
        assert decoded.output_on_device
        decoded.lease.release()
        decoded.output_lease.release()
        return threading.current_thread().name

    loop_thread = asyncio.run(decode())
    assert layer.open_threads and loop_thread not in layer.open_threads, layer.open_threads
    opens = len(layer.open_threads)
    asyncio.run(decode())  # both mapped here now: nothing opened again
    assert len(layer.open_threads) == opens
    asyncio.run(a.unregister(""))


def test_a_non_finite_output_in_one_process_is_invalid_argument_and_leaves_the_region_as_it_was(
        gpu_less_cuda_server):  # noqa: F811
    srv, fake = gpu_less_cuda_server
    x = np.random.default_rng().standard_normal((2, 3, 5, 5, 5), dtype=np.float32)
    x[1, 0, 0, 0, 0] = np.inf
    sentinel = b"\x11" * (2 * SPEC.cout * 4)
    handle = fake.export(x.tobytes() + sentinel)
    with Client(srv.url) as client:
        client.register_cuda_shared_memory("nonfinite", handle, 0, x.nbytes + len(sentinel))
        try:
            with pytest.raises(InferenceError) as err:
                client.infer_shared_memory(x.shape, "nonfinite", output_region="nonfinite", output_offset=x.nbytes)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sample 1" in str(err.value)
            assert fake.contents(handle)[x.nbytes:] == sentinel
        finally:
            client.unregister_cuda_shared_memory("nonfinite")
