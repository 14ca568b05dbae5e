"""CUDA shared memory, the client's side: device memory of this process, exported by CUDA IPC for a server on the
same host to read the input where it lies and write the output in place.

    with CudaBuffer(x.nbytes + out_bytes, device_id=0) as buf:       # device memory of our own (cudaMalloc)
        buf.write(x)
        client.register_cuda_region("io", buf.region)
        client.infer_shared_memory(x.shape, "io", output_region="io", output_offset=x.nbytes)
        y = buf.read(np.float32, (len(x), 16), offset=x.nbytes)

    x = torch.randn(8, 3, 16, 32, 32, device="cuda")                # or memory someone else allocated
    y = torch.empty(8, 16, device="cuda")
    ref_x, ref_y = client.register_cuda_array("x", x), client.register_cuda_array("y", y)
    client.infer_cuda(ref_x, ref_y)                                   # y now holds the answer

A server maps the whole allocation an IPC handle names (cudaIpcOpenMemHandle returns its base), so a region is an
allocation: ``region_of`` finds the allocation a pointer lies in (cuMemGetAddressRange; torch's caching allocator
hands out tensors inside larger blocks) and a tensor is referenced by its offset from the allocation's base.

Built on cuda-python's bindings (``pip install 'voxserve[cuda]'``: cuda-bindings), imported on first use: without
them, or without a CUDA device, every call raises CudaUnavailable saying which. An IPC handle is a capability
(whoever holds its bytes can map the memory): no repr or message here shows one.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from voxserve.datatypes import ITEMSIZE

HANDLE_BYTES = 64
INSTALL_HINT = "pip install 'voxserve[cuda]' (cuda-bindings, cuda-python's low-level bindings)"
# numpy's type strings (__cuda_array_interface__'s "typestr") and torch's dtypes, as the protocol names them.
_TYPESTR = {"<f4": "FP32", "<f2": "FP16"}
_TORCH_DTYPES = {"torch.float32": "FP32", "torch.float16": "FP16", "torch.bfloat16": "BF16"}


class CudaError(RuntimeError):
    """A CUDA call failed: the call's name and CUDA's name for the error."""


class CudaUnavailable(CudaError):
    """CUDA shared memory cannot work in this process: cuda-bindings is not installed, or there is no CUDA
    device (the message says which)."""


_modules: tuple[Any, Any] | None = None


def _bindings() -> tuple[Any, Any]:
    """cuda-bindings' runtime and driver modules, imported once."""
    global _modules
    if _modules is None:
        try:
            from cuda.bindings import driver, runtime
        except ImportError as exc:
            raise CudaUnavailable(f"CUDA shared memory needs cuda-bindings, which is not installed ({exc}): "
                                  f"{INSTALL_HINT}") from None
        _modules = runtime, driver
    return _modules


def _cuda(device_id: int | None = None) -> tuple[Any, Any]:
    """The bindings, once a CUDA device answers (and ``device_id``, if given, is one of them)."""
    runtime, driver = _bindings()
    err, count = runtime.cudaGetDeviceCount()
    if err != runtime.cudaError_t.cudaSuccess:
        raise CudaUnavailable(f"no CUDA device here: cudaGetDeviceCount returned {_name(runtime, err)}")
    if count == 0:
        raise CudaUnavailable("no CUDA device here: cudaGetDeviceCount returned 0 devices")
    if device_id is not None and not 0 <= device_id < count:
        raise CudaUnavailable(f"device_id {device_id} is not a device of this process (it sees {count} CUDA "
                              f"device{'s' if count != 1 else ''}: 0..{count - 1})")
    return runtime, driver


@contextlib.contextmanager
def _on_device(runtime: Any, device_id: int) -> Iterator[None]:
    """``device_id`` current (its primary context, which torch and every other runtime in this process share)
    for a few calls, then the thread's device as it was: a caller's torch keeps its own current device."""
    before = _check(runtime, runtime.cudaGetDevice(), "cudaGetDevice")
    if before != device_id:
        _check(runtime, runtime.cudaSetDevice(device_id), "cudaSetDevice")
    try:
        yield
    finally:
        if before != device_id:
            runtime.cudaSetDevice(before)


def _name(module: Any, err: Any) -> str:
    """CUDA's name for an error of the runtime or of the driver."""
    try:
        if hasattr(module, "cudaGetErrorName"):
            _, name = module.cudaGetErrorName(err)
        else:
            _, name = module.cuGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # a name is a courtesy: the number is still right
        return str(err)


def _check(module: Any, result: Any, what: str) -> Any:
    """The values of a binding's (error, *values) result; CudaError naming the call unless it succeeded."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaError(f"{what}: {_name(module, err)}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


@dataclass(frozen=True)
class CudaRegion:
    """A device allocation of this process and its IPC handle: what a server registers. ``base``: the
    allocation's first byte (a device pointer); a tensor inside it is referenced by its offset from there."""

    base: int
    byte_size: int
    device_id: int
    raw_handle: bytes = field(repr=False)  # the cudaIpcMemHandle_t's 64 bytes: a capability


def region_of(ptr: int) -> CudaRegion:
    """The allocation that device pointer ``ptr`` lies in (its base and size, from cuMemGetAddressRange) and its
    IPC handle. CudaError for a pointer that is not device memory, or for memory CUDA IPC cannot export (from
    cuMemCreate, as torch's ``expandable_segments`` allocates: cudaIpcGetMemHandle refuses it)."""
    runtime, driver = _cuda()
    attributes = _check(runtime, runtime.cudaPointerGetAttributes(ptr), "cudaPointerGetAttributes")
    if attributes.type != runtime.cudaMemoryType.cudaMemoryTypeDevice:
        raise CudaError(f"pointer {ptr:#x} is not device memory (CUDA says {attributes.type.name}): CUDA shared "
                        "memory exports device memory only")
    device_id = int(attributes.device)
    with _on_device(runtime, device_id):
        base, size = _check(driver, driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        base = int(base)
        try:
            handle = _check(runtime, runtime.cudaIpcGetMemHandle(base), "cudaIpcGetMemHandle")
        except CudaError as exc:
            raise CudaError(f"{exc} (CUDA IPC exports memory from cudaMalloc; memory from cuMemCreate, such as "
                            "torch's with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, cannot be exported)"
                            ) from None
    return CudaRegion(base, int(size), device_id, ctypes.string_at(handle.getPtr(), HANDLE_BYTES))


@dataclass(frozen=True)
class CudaArray:
    """Where a registered array lies: its region's name and offset, its size, shape, datatype and device; what
    ``Client.infer_cuda`` sends for an input or an output."""

    region: str
    offset: int
    byte_size: int
    shape: tuple[int, ...]
    datatype: str
    device_id: int


def describe(array: Any) -> tuple[int, tuple[int, ...], str]:
    """(device pointer, shape, datatype) of a C-contiguous device array: anything with
    ``__cuda_array_interface__`` (CuPy, Numba, torch), or a torch CUDA tensor (also BF16, which the interface
    cannot name)."""
    dtype = str(getattr(array, "dtype", ""))
    if dtype in _TORCH_DTYPES and hasattr(array, "data_ptr"):  # torch, without importing it
        if not array.is_cuda:
            raise ValueError(f"the tensor is on {array.device}, not on a CUDA device")
        if not array.is_contiguous():
            raise ValueError("the tensor is not contiguous: call .contiguous() first")
        return int(array.data_ptr()), tuple(int(n) for n in array.shape), _TORCH_DTYPES[dtype]
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is None:
        raise TypeError(f"{type(array).__name__} is not a CUDA array (no __cuda_array_interface__)")
    shape = tuple(int(n) for n in interface["shape"])
    typestr = interface["typestr"]
    if typestr not in _TYPESTR:
        raise ValueError(f"array of type {typestr!r}: the model takes float32 ('<f4') or float16 ('<f2'), or a torch "
                         f"bfloat16 tensor")
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, ITEMSIZE[_TYPESTR[typestr]]):
        raise ValueError(f"the array is not C-contiguous (strides {tuple(strides)})")
    return int(interface["data"][0]), shape, _TYPESTR[typestr]


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def locate(array: Any, name: str) -> tuple[CudaRegion, CudaArray]:
    """The allocation ``array`` lies in, and where the array lies in it once that is registered as region
    ``name``. Arrays of one allocation (``region.base`` the same) can share one registration."""
    ptr, shape, datatype = describe(array)
    region = region_of(ptr)
    where = CudaArray(name, ptr - region.base, int(np.prod(shape)) * ITEMSIZE[datatype], shape, datatype,
                      region.device_id)
    return region, where


class CudaBuffer:
    """Device memory this process allocates (cudaMalloc on ``device_id``) and frees; written from numpy, read back
    to numpy, exported by ``region``.

        with CudaBuffer(x.nbytes, device_id=0) as buf:
            buf.write(x)
            client.register_cuda_region("in", buf.region)
    """

    def __init__(self, byte_size: int, device_id: int = 0) -> None:
        if byte_size <= 0:
            raise ValueError(f"byte_size {byte_size} must be > 0")
        self._runtime, _ = _cuda(device_id)
        self.byte_size = byte_size
        self.device_id = device_id
        rt = self._runtime
        with _on_device(rt, device_id):
            self.ptr: int = int(_check(rt, rt.cudaMalloc(byte_size), "cudaMalloc"))
            try:
                handle = _check(rt, rt.cudaIpcGetMemHandle(self.ptr), "cudaIpcGetMemHandle")
            except BaseException:
                rt.cudaFree(self.ptr)
                raise
        self.region = CudaRegion(self.ptr, byte_size, device_id, ctypes.string_at(handle.getPtr(), HANDLE_BYTES))

    def __repr__(self) -> str:
        state = "freed" if self.ptr == 0 else f"{self.byte_size} bytes on device {self.device_id}"
        return f"CudaBuffer({state})"

    def _span(self, offset: int, nbytes: int) -> int:
        if self.ptr == 0:
            raise ValueError("the CUDA buffer is freed")
        if offset < 0 or offset + nbytes > self.byte_size:
            raise ValueError(f"{nbytes} bytes at offset {offset} do not fit the buffer's {self.byte_size} bytes")
        return self.ptr + offset

    def write(self, array: np.ndarray, offset: int = 0) -> None:
        """Copy ``array``'s bytes (C order) to the buffer at ``offset``; returns once they are there."""
        data = np.ascontiguousarray(array)
        rt = self._runtime
        with _on_device(rt, self.device_id):
            _check(rt, rt.cudaMemcpy(self._span(offset, data.nbytes), data.ctypes.data, data.nbytes,
                                     rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy")

    def read(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """A new numpy array of ``dtype`` and ``shape`` copied from the buffer at ``offset``."""
        out = np.empty(shape, dtype=dtype)
        rt = self._runtime
        with _on_device(rt, self.device_id):
            _check(rt, rt.cudaMemcpy(out.ctypes.data, self._span(offset, out.nbytes), out.nbytes,
                                     rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
        return out

    def close(self) -> None:
        """Free the memory (once; a server that still maps it keeps it alive until it unmaps it)."""
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            with _on_device(self._runtime, self.device_id):
                _check(self._runtime, self._runtime.cudaFree(ptr), "cudaFree")

    def __enter__(self) -> CudaBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def require_device(device_id: int = 0) -> None:
    """CudaUnavailable unless cuda-bindings is installed and CUDA device ``device_id`` answers."""
    _cuda(device_id)


def synchronize(device_id: int) -> None:
    """Wait for all work on the device (every stream of this process): what the client wrote into a region is
    there before a server reads it."""
    runtime, _ = _cuda(device_id)
    with _on_device(runtime, device_id):
        _check(runtime, runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
