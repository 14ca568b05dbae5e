"""cuda-bindings' runtime and driver, as far as voxserve.client.cuda calls them, without a GPU: "device memory" is
host memory that a FakeDeviceMemory (voxserve.testing.fake_devicemem) exports, so an in-process server given that
layer maps what the client allocates. Results are (error, *values) tuples as the real bindings return them."""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from types import SimpleNamespace

from voxserve.server.app import VoxServer
from voxserve.server.settings import Settings
from voxserve.testing.fake_devicemem import FakeDeviceMemory

from .conftest import ServerThread

cudaError_t = enum.IntEnum("cudaError_t", {"cudaSuccess": 0, "cudaErrorInvalidValue": 1,
                                           "cudaErrorInsufficientDriver": 35, "cudaErrorInvalidDevice": 101})
CUresult = enum.IntEnum("CUresult", {"CUDA_SUCCESS": 0, "CUDA_ERROR_NOT_FOUND": 500})
cudaMemoryType = enum.IntEnum("cudaMemoryType", {"cudaMemoryTypeUnregistered": 0, "cudaMemoryTypeHost": 1,
                                                 "cudaMemoryTypeDevice": 2})
cudaMemcpyKind = enum.IntEnum("cudaMemcpyKind", {"cudaMemcpyHostToDevice": 1, "cudaMemcpyDeviceToHost": 2})


@dataclass
class _Allocation:
    address: int
    size: int
    device: int
    handle: bytes


class _Handle:
    """cudaIpcMemHandle_t: 64 bytes at getPtr()."""

    def __init__(self, raw: bytes) -> None:
        self._buffer = ctypes.create_string_buffer(raw, len(raw))

    def getPtr(self) -> int:
        return ctypes.addressof(self._buffer)


class FakeCuda:
    """``runtime`` and ``driver``: the two modules; ``devices``: 0 behaves as a machine without a driver."""

    def __init__(self, memory: FakeDeviceMemory, devices: int = 1) -> None:
        self.memory = memory
        self.devices = devices
        self.current = 0  # the thread's current device
        self.devices_used: set[int] = set()  # the devices memory was allocated or synchronized on
        self.allocations: dict[int, _Allocation] = {}
        self.synchronized = 0
        self.runtime = SimpleNamespace(
            cudaError_t=cudaError_t, cudaMemoryType=cudaMemoryType, cudaMemcpyKind=cudaMemcpyKind,
            cudaGetErrorName=lambda err: (cudaError_t.cudaSuccess, cudaError_t(err).name.encode()),
            cudaGetDeviceCount=self.device_count, cudaSetDevice=self.set_device,
            cudaGetDevice=lambda: (cudaError_t.cudaSuccess, self.current), cudaMalloc=self.malloc,
            cudaFree=self.free, cudaIpcGetMemHandle=self.ipc_handle, cudaMemcpy=self.memcpy,
            cudaPointerGetAttributes=self.attributes, cudaDeviceSynchronize=self.synchronize)
        self.driver = SimpleNamespace(
            CUresult=CUresult, cuGetErrorName=lambda err: (CUresult.CUDA_SUCCESS, CUresult(err).name.encode()),
            cuMemGetAddressRange=self.address_range)

    @property
    def modules(self) -> tuple[SimpleNamespace, SimpleNamespace]:
        return self.runtime, self.driver

    def _find(self, ptr: int) -> _Allocation | None:
        return next((a for a in self.allocations.values() if a.address <= ptr < a.address + a.size), None)

    def device_count(self):
        if self.devices == 0:
            return cudaError_t.cudaErrorInsufficientDriver, 0
        return cudaError_t.cudaSuccess, self.devices

    def set_device(self, device: int):
        if not 0 <= device < self.devices:
            return (cudaError_t.cudaErrorInvalidDevice,)
        self.current = device
        return (cudaError_t.cudaSuccess,)

    def malloc(self, size: int):
        handle = self.memory.export(size, device=self.current)
        mapping = self.memory.open(handle, self.current)  # (only to learn the buffer's address)
        self.memory.close(mapping)
        self.allocations[mapping.address] = _Allocation(mapping.address, size, self.current, handle)
        self.devices_used.add(self.current)
        return cudaError_t.cudaSuccess, mapping.address

    def free(self, ptr: int):
        allocation = self.allocations.pop(ptr, None)
        if allocation is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        self.memory.free(allocation.handle)
        return (cudaError_t.cudaSuccess,)

    def ipc_handle(self, ptr: int):
        allocation = self._find(ptr)
        if allocation is None:
            return cudaError_t.cudaErrorInvalidValue, None
        return cudaError_t.cudaSuccess, _Handle(allocation.handle)

    def memcpy(self, dst: int, src: int, count: int, kind):
        device = dst if kind == cudaMemcpyKind.cudaMemcpyHostToDevice else src
        allocation = self._find(device)
        if allocation is None or device + count > allocation.address + allocation.size:
            return (cudaError_t.cudaErrorInvalidValue,)
        ctypes.memmove(dst, src, count)
        return (cudaError_t.cudaSuccess,)

    def attributes(self, ptr: int):
        allocation = self._find(ptr)
        kind = cudaMemoryType.cudaMemoryTypeDevice if allocation else cudaMemoryType.cudaMemoryTypeUnregistered
        return cudaError_t.cudaSuccess, SimpleNamespace(type=kind, device=allocation.device if allocation else -2)

    def address_range(self, ptr: int):
        allocation = self._find(ptr)
        if allocation is None:
            return CUresult.CUDA_ERROR_NOT_FOUND, 0, 0
        return CUresult.CUDA_SUCCESS, allocation.address, allocation.size

    def synchronize(self):
        self.synchronized += 1
        return (cudaError_t.cudaSuccess,)


class DeviceArray:
    """A C-contiguous float32/float16 array in fake device memory, at ``ptr``: what a CuPy or torch array shows
    through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str = "<f4", strides: tuple[int, ...] | None = None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": strides}


class FakeLayerServer(ServerThread):
    """An in-process CPU server whose CUDA shared memory goes through ``memory`` (a FakeDeviceMemory)."""

    def __init__(self, memory: FakeDeviceMemory) -> None:
        self.memory = memory
        super().__init__(Settings(host="127.0.0.1", grpc_port=0, http_port=0, metrics_port=-1, device="cpu"))

    async def _make(self) -> VoxServer:
        return VoxServer(self.settings, device_memory=self.memory)
