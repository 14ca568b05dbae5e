"""The client's CUDA shared memory (voxserve.client.cuda, Client.register_cuda_array / infer_cuda) without a GPU:
cuda-bindings replaced by tests/fake_cuda.py, whose "device memory" an in-process server maps through the fake
device layer; what the client says without cuda-bindings or without a device; handles kept out of reprs."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import numpy as np
import pytest
import torch

from voxserve.client import AsyncClient, Client, CudaBuffer, CudaError, CudaUnavailable, cuda
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.model import relative_error
from voxserve.testing.fake_devicemem import FakeDeviceMemory

from ..fake_cuda import DeviceArray, FakeCuda, FakeLayerServer


@pytest.fixture(scope="module")
def fake_layer_server():
    memory = FakeDeviceMemory(2)
    srv = FakeLayerServer(memory)
    try:
        assert srv.wait_ready(), srv.server.load_error
        yield srv, memory
    finally:
        srv.stop()


@pytest.fixture
def fake_cuda(fake_layer_server, monkeypatch):
    """cuda-bindings as the fake, over the server's fake device layer (two devices)."""
    _, memory = fake_layer_server
    fake = FakeCuda(memory, devices=2)
    monkeypatch.setattr(cuda, "_modules", fake.modules)
    return fake


@pytest.fixture
def client(fake_layer_server):
    srv, _ = fake_layer_server
    with Client(srv.url) as c:
        yield c
        c.unregister_cuda_shared_memory()


def test_a_buffer_of_our_own_round_trips_and_serves_a_request(fake_cuda, client, rng):
    w, b = reference_weights()
    x = torch.randn((3, 3, 5, 6, 7), generator=rng).numpy()
    with CudaBuffer(x.nbytes + 3 * 16 * 4, device_id=1) as buf:
        assert buf.region.device_id == 1 and buf.region.byte_size == x.nbytes + 192 and buf.region.base == buf.ptr
        buf.write(x)
        np.testing.assert_array_equal(buf.read(np.float32, x.shape), x)
        client.register_cuda_region("own", buf.region)
        assert client.cuda_shared_memory_status() == {"own": (1, x.nbytes + 192)}
        assert client.infer_shared_memory(x.shape, "own", output_region="own", output_offset=x.nbytes) is None
        y = buf.read(np.float32, (3, 16), offset=x.nbytes)
    assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
    assert buf.ptr == 0 and not fake_cuda.allocations  # freed by the context manager
    assert fake_cuda.devices_used == {1} and fake_cuda.current == 0  # on device 1; the caller's device kept
    buf.close()  # once


def test_an_array_inside_a_larger_allocation_is_registered_by_its_allocation(fake_cuda, client, rng):
    """As a torch tensor in a block of the caching allocator: the region is the whole allocation (its base, its
    size), the input and the output are referenced at their offsets in it."""
    w, b = reference_weights()
    x = torch.randn((2, 3, 4, 5, 6), generator=rng).numpy()
    block_bytes, x_at, y_at = 1 << 16, 4096, 4096 + x.nbytes + 64
    with CudaBuffer(block_bytes) as block:
        block.write(x, offset=x_at)
        ref_x = client.register_cuda_array("block", DeviceArray(block.ptr + x_at, x.shape))
        assert (ref_x.region, ref_x.offset, ref_x.byte_size, ref_x.shape, ref_x.datatype) == (
            "block", x_at, x.nbytes, x.shape, "FP32")
        assert client.cuda_shared_memory_status() == {"block": (0, block_bytes)}
        region, ref_y = cuda.locate(DeviceArray(block.ptr + y_at, (2, 16)), "block")
        assert region.base == block.ptr and ref_y.offset == y_at
        synced = fake_cuda.synchronized
        assert client.infer_cuda(ref_x, ref_y) is None
        assert fake_cuda.synchronized == synced + 1  # what the client wrote is there before the server reads it
        y = block.read(np.float32, (2, 16), offset=y_at)
        np.testing.assert_array_equal(client.infer_cuda(ref_x), y)  # or the output in the response
    assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5


def test_what_is_not_a_contiguous_float_device_array_is_refused(fake_cuda, client):
    with CudaBuffer(4096) as buf:
        with pytest.raises(TypeError, match="not a CUDA array"):
            client.register_cuda_array("x", np.zeros(4, np.float32))
        with pytest.raises(ValueError, match=r"type '<f8'"):
            client.register_cuda_array("x", DeviceArray(buf.ptr, (4,), "<f8"))
        with pytest.raises(ValueError, match="not C-contiguous"):
            client.register_cuda_array("x", DeviceArray(buf.ptr, (4, 4), "<f4", strides=(4, 16)))
        assert cuda.describe(DeviceArray(buf.ptr, (4, 4), "<f2", strides=(8, 2)))[1:] == ((4, 4), "FP16")
        host = np.zeros(16, np.float32)
        with pytest.raises(CudaError, match="is not device memory"):
            client.register_cuda_array("x", DeviceArray(host.ctypes.data, (16,)))
        with pytest.raises(ValueError, match="do not fit"):
            buf.write(np.zeros(1025, np.float32))
        with pytest.raises(ValueError, match="do not fit"):
            buf.read(np.float32, (4,), offset=4090)
        ref = client.register_cuda_array("x", DeviceArray(buf.ptr, (4,)))
        with pytest.raises(ValueError, match="output is FP32"):
            client.infer_cuda(ref, dataclasses.replace(ref, datatype="FP16"))
    assert client.cuda_shared_memory_status() == {"x": (0, 4096)}
    with pytest.raises(ValueError, match="freed"):
        buf.write(np.zeros(1, np.float32))


def test_torch_tensors_are_described_without_cuda_array_interface():
    """BF16 has no numpy type string: a torch tensor is read by its data_ptr and dtype (here a CPU one, refused
    for where it is)."""
    with pytest.raises(ValueError, match="is on cpu, not on a CUDA device"):
        cuda.describe(torch.zeros(2, dtype=torch.bfloat16))


def test_handles_are_never_in_a_repr(fake_cuda):
    with CudaBuffer(256) as buf:
        raw = buf.region.raw_handle
        assert len(raw) == cuda.HANDLE_BYTES
        for text in (repr(buf), repr(buf.region), str(buf.region)):
            assert raw.hex() not in text and repr(raw) not in text and "raw_handle" not in text
        assert repr(buf) == "CudaBuffer(256 bytes on device 0)"


def test_without_cuda_bindings_every_call_says_what_to_install(monkeypatch):
    monkeypatch.setattr(cuda, "_modules", None)
    monkeypatch.setitem(sys.modules, "cuda", None)  # import cuda.bindings fails as when it is not installed
    for call in (lambda: CudaBuffer(16), lambda: cuda.region_of(0x1000), lambda: cuda.synchronize(0)):
        with pytest.raises(CudaUnavailable, match=r"needs cuda-bindings.*pip install 'voxserve\[cuda\]'"):
            call()


def test_without_a_device_the_reason_is_cudas(fake_layer_server, monkeypatch):
    _, memory = fake_layer_server
    monkeypatch.setattr(cuda, "_modules", FakeCuda(memory, devices=0).modules)
    with pytest.raises(CudaUnavailable, match="no CUDA device here: cudaGetDeviceCount returned "
                                              "cudaErrorInsufficientDriver"):
        CudaBuffer(16)
    monkeypatch.setattr(cuda, "_modules", FakeCuda(memory, devices=1).modules)
    with pytest.raises(CudaUnavailable, match=r"device_id 3 is not a device of this process \(it sees 1 CUDA "
                                              r"device: 0..0\)"):
        CudaBuffer(16, device_id=3)
    with pytest.raises(ValueError, match="byte_size 0 must be > 0"):
        CudaBuffer(0)


def test_the_asyncio_client_has_the_same_cuda_calls(fake_cuda, fake_layer_server, rng):
    """AsyncClient: register an array's allocation, status, infer with the output in the region or in the response,
    unregister; the same answers as float64."""
    srv, _ = fake_layer_server
    w, b = reference_weights()
    x = torch.randn((2, 3, 4, 5, 6), generator=rng).numpy()

    async def main() -> np.ndarray:
        async with AsyncClient(srv.url) as c:
            with CudaBuffer(x.nbytes + 2 * 16 * 4) as buf:
                buf.write(x)
                ref_x = await c.register_cuda_array("async", DeviceArray(buf.ptr, x.shape))
                assert await c.cuda_shared_memory_status() == {"async": (0, buf.byte_size)}
                _, ref_y = cuda.locate(DeviceArray(buf.ptr + x.nbytes, (2, 16)), "async")
                assert await c.infer_cuda(ref_x, ref_y) is None
                y = buf.read(np.float32, (2, 16), offset=x.nbytes)
                np.testing.assert_array_equal(await c.infer_cuda(ref_x), y)
                np.testing.assert_array_equal(await c.infer_shared_memory(x.shape, "async"), y)
                await c.unregister_cuda_shared_memory("async")
                assert await c.cuda_shared_memory_status() == {}
                return y

    y = asyncio.run(main())
    assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
