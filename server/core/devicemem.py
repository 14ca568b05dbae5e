"""Another process's device memory, opened from its CUDA IPC handle: the device layer under CUDA shared memory.

``DeviceMemory`` is the boundary; two implementations stand behind it, both tested against one contract
(tests/kernels/test_devicemem_contract.py): ``CudaDeviceMemory`` here, over the kernel library's
``voxserve_ipc_open``/``voxserve_ipc_close`` (kernels/csrc/fused.cu: plain CUDA, the same primary context as the
launches, no cuda-python in the server), and ``voxserve.testing.fake_devicemem.FakeDeviceMemory``, host memory
behind made-up handles, so that the registry and the RPCs are tested in CI without a GPU.

A handle is a capability: whoever holds its 64 bytes can map the exporter's memory. Nothing here logs or returns
one. A failure is a ``DeviceMemoryError``: a sentence for the client (never an exception's text) and CUDA's name
for the error.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE: a cudaIpcMemHandle_t, sent raw over gRPC
# cudaMalloc aligns every allocation at least this far, and a real handle maps its allocation's start; a forged one
# (its offset bytes changed) can map a misaligned address inside it, where a read faults and poisons the context.
ALLOCATION_ALIGNMENT = 256

# CUDA's errors for a handle that does not open (cuda_runtime_api.h, cudaIpcOpenMemHandle), as the client is told.
_OPEN_REASONS = {
    "cudaErrorInvalidResourceHandle": "it is not a live CUDA IPC handle: export it with cudaIpcGetMemHandle from "
                                      "another process, on memory from cudaMalloc that is still allocated",
    "cudaErrorInvalidValue": "it is not a live CUDA IPC handle: export it with cudaIpcGetMemHandle from another "
                             "process, on memory from cudaMalloc that is still allocated",
    "cudaErrorDeviceUninitialized": "the driver refuses it (invalid device context): it was exported by the "
                                    "server's own process, or by a process whose PID namespace differs (run the "
                                    "containers with --pid=host)",
    "cudaErrorAlreadyMapped": "this server already maps that memory through another handle: unregister the region "
                              "that maps it first",
    "cudaErrorMapBufferObjectFailed": "the driver could not map the memory on this device",
    "cudaErrorTooManyPeers": "the memory's device cannot be reached from this device (too many peer mappings)",
    "cudaErrorPeerAccessUnsupported": "the memory's device cannot be reached from this device (no peer access)",
    "cudaErrorNotSupported": "this device or driver does not support CUDA IPC",
    "cudaErrorInvalidDevice": "the device is not usable by this server",
}


@dataclass(frozen=True)
class Mapping:
    """One opened handle in this process. ``size``: the bytes from ``address`` to the end of the exporter's
    allocation (its real extent, whatever the client claims); ``base``: that allocation's start; ``device``: the
    memory's device as this process numbers it; ``opened_on``: the device whose context holds the mapping."""

    address: int
    size: int
    base: int
    device: int
    opened_on: int
    host: bool = False  # the memory is this process's own host memory, read and written directly (the test layer)


class DeviceMemoryError(Exception):
    """A handle that does not open (or a mapping that does not close): ``reason`` is a sentence that can be shown to
    the client; ``cuda_error`` CUDA's name for the error ('' when CUDA was not asked)."""

    def __init__(self, reason: str, cuda_error: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.cuda_error = cuda_error

    def __repr__(self) -> str:
        return f"DeviceMemoryError({self.reason!r}, {self.cuda_error!r})"


class DeviceArray:
    """A request's tensor where it lies in a client's registered CUDA memory: its address, shape, wire dtype and
    device, and what keeps the mapping open (``keep``: a lease, held as long as this array or a tensor made from
    it is alive, so that an execution still reading it outlives the request that brought it). Slicing the first
    axis gives another view of the same memory, as numpy's does (a request run in pieces).

    ``result``: where the request's (N, Cout) FP32 output goes, when that is device memory on the same device too
    (a DeviceArray of its own, with its own lease): the execution writes it there on the device, and sliced along
    with this array, each piece of a request run in pieces writes its own rows."""

    __slots__ = ("address", "device", "dtype", "keep", "result", "shape")

    def __init__(self, address: int, shape: tuple[int, ...], dtype: np.dtype, device: int, keep: Any,
                 result: DeviceArray | None = None) -> None:
        self.address, self.shape, self.dtype, self.device, self.keep = address, tuple(shape), dtype, device, keep
        self.result = result

    @property
    def place(self) -> str:
        """Where the tensor lies (the batcher merges only tensors of one place)."""
        return f"cuda:{self.device}"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __getitem__(self, index: slice) -> DeviceArray:
        start, stop, step = index.indices(self.shape[0])
        if step != 1:
            raise IndexError("a device array is sliced along its first axis in steps of 1")
        row = self.nbytes // max(self.shape[0], 1)
        stop = max(start, stop)
        return DeviceArray(self.address + start * row, (stop - start, *self.shape[1:]), self.dtype, self.device,
                           self.keep, None if self.result is None else self.result[start:stop])

    @property
    def __cuda_array_interface__(self) -> dict:
        # bfloat16 has no typestr: its bits (uint16 on the wire) are read as int16, and viewed as bfloat16 after.
        typestr = "<i2" if self.dtype == np.dtype("<u2") else self.dtype.str
        # (read-only False: torch accepts no other; the kernel only reads it)
        return {"shape": self.shape, "typestr": typestr, "data": (self.address, False), "version": 3,
                "strides": None}


@dataclass(frozen=True)
class RegionTensor:
    """A request's tensor where it lies in a client's region, known by the region's name rather than by an address: a
    front end's (its engine maps the region and reads the tensor there); ``device_id``: the device a CUDA region was
    registered on."""

    region: str
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    device_id: int  # (a system region's: -1, no device)
    kind: str = "cuda"  # or "system": a client's system shared-memory segment, which the engine DMAs in place
    # a CUDA input's: the CUDA region and offset its (N, Cout) FP32 output goes to, written by the engine (as a
    # DeviceArray's ``result``), or None
    result: tuple[str, int] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def host_view(address: int, shape: tuple[int, ...], dtype: np.dtype, keep: Any) -> np.ndarray:
    """A numpy view of ``shape`` at ``address`` in this process's memory (a host mapping), keeping ``keep`` (its
    lease) alive as long as the view or any view of it is."""
    count = math.prod(shape) * dtype.itemsize
    buffer = (ctypes.c_char * count).from_address(address)
    buffer.keep = keep  # type: ignore[attr-defined]  # numpy's view holds the buffer, the buffer the lease
    return np.frombuffer(memoryview(buffer), dtype=dtype).reshape(shape)


class DeviceMemory(Protocol):
    """What the CUDA shared-memory registry needs of the devices. ``open`` and ``close`` may take milliseconds:
    call them off the event loop."""

    def device_count(self) -> int:
        """The CUDA devices this process sees (a request's device_id is checked against it)."""

    def open(self, handle: bytes, device: int, nbytes: int | None = None) -> Mapping:
        """Map the memory the ``HANDLE_BYTES``-byte ``handle`` names, in ``device``'s context; DeviceMemoryError
        if it does not open (then nothing stays mapped). ``nbytes``: how much of it, from the mapped address, the
        caller will access (a region's byte_size; None: all of it): what must be known to read safely first."""

    def close(self, mapping: Mapping) -> None:
        """Unmap what ``open`` returned (once per open); DeviceMemoryError if CUDA refuses."""

    def write(self, address: int, data: bytes, device: int) -> None:
        """Copy ``data`` to ``address``, inside a mapping opened on ``device``; complete when this returns (the
        response that says so follows it)."""


class CudaDeviceMemory:
    """DeviceMemory on the CUDA devices, through the kernel library (which is built or loaded on first use)."""

    def __init__(self, checker: Any = None) -> None:
        import torch

        from voxserve.kernels import cuda

        from .ipccheck import HandleChecker

        self._cuda = cuda
        self._count = torch.cuda.device_count()
        self._streams: dict[int, torch.cuda.Stream] = {}  # the outputs' copies, per device
        # Every mapping is read whole by another process before this one may read it (ipccheck.py).
        self.checker = checker if checker is not None else HandleChecker()

    def device_count(self) -> int:
        return self._count

    def open(self, handle: bytes, device: int, nbytes: int | None = None) -> Mapping:
        if len(handle) != HANDLE_BYTES:  # the library reads exactly HANDLE_BYTES
            raise DeviceMemoryError(f"a CUDA IPC handle is {HANDLE_BYTES} bytes, not {len(handle)}")
        try:
            address, base, size, ordinal = self._cuda.ipc_open(handle, device)
        except self._cuda.IpcError as exc:
            raise DeviceMemoryError(_OPEN_REASONS.get(exc.name, f"CUDA refuses it ({exc.name})"), exc.name) from None
        mapping = Mapping(address, base + size - address, base, ordinal, device)
        try:  # opened, not yet read: a mapping the exporter's memory does not back is found in another process
            extent = self.checker.check(handle, device, nbytes)
            if extent != mapping.size:
                raise DeviceMemoryError(f"it maps {mapping.size} bytes here and {extent} in another process")
        except BaseException:
            self.close(mapping)
            raise
        return mapping

    def close(self, mapping: Mapping) -> None:
        try:
            self._cuda.ipc_close(mapping.address, mapping.opened_on)
        except self._cuda.IpcError as exc:
            raise DeviceMemoryError(f"CUDA could not unmap it ({exc.name})", exc.name) from None

    def write(self, address: int, data: bytes, device: int) -> None:
        import torch

        target = torch.as_tensor(DeviceArray(address, (len(data),), np.dtype(np.uint8), device, None),
                                 device=f"cuda:{device}")
        # On a stream of its own: waiting for it waits for this copy only, not for executions on the device.
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            target.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8), non_blocking=False)
        stream.synchronize()
