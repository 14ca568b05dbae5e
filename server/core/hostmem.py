"""Client host memory the GPU reads in place: a read-only mapping of a shared-memory segment, page-locked, so that
the copy engine DMAs a request's input straight from the client's pages (no host copy in between).

``PageLocker`` is the boundary; ``CudaPageLocker`` (cudaHostRegister through the CUDA runtime torch loaded) and
``voxserve.testing.fake_hostmem.FakePageLocker`` (which only counts, and can refuse) stand behind it, so that the
registry's rules (server/protocol/shm.py) are tested in CI without a GPU. The mapping itself (``map_segment``) is a
real one in both cases.

Such a mapping must never be read by the CPU: a client that truncates its segment would make any CPU read a SIGBUS
(the whole server), while the GPU's DMA keeps reading the pages page-locked at registration, with no error
(bench/results/cuda-ipc-probe-h200.md). The pipeline only DMAs it (``pipeline.register_page_locked(...,
dma_only=True)``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# cudaHostRegister's flags (cuda_runtime_api.h)
HOST_REGISTER_PORTABLE = 0x01  # page-locked for every CUDA context, not only the current device's
HOST_REGISTER_READ_ONLY = 0x08  # the device only reads it: a PROT_READ mapping can be registered
# cudaDeviceAttr values (driver_types.h)
_ATTR_HOST_REGISTER_SUPPORTED = 99
_ATTR_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES = 100


class HostMemoryError(Exception):
    """A page-lock that CUDA (or the system: RLIMIT_MEMLOCK, a mapping that fails) refuses; ``reason`` a sentence
    for the log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PageLocker(Protocol):
    """What the system shared-memory registry needs to let the GPU read a client's segment in place. ``lock`` may
    take milliseconds per GiB: call it off the event loop."""

    def lock(self, address: int, nbytes: int, read_only: bool) -> None:
        """Page-lock [address, address + nbytes) (a mapping of this process) for every device, for the GPU to DMA
        and for nothing else to read; ``read_only``: the mapping is PROT_READ. HostMemoryError when refused (then
        nothing stays locked, and no CUDA error lingers for the next call on this thread to be blamed for)."""

    def unlock(self, address: int, nbytes: int) -> None:
        """Undo ``lock`` (once per lock, when nothing reads the range any more); HostMemoryError if refused."""


@dataclass(frozen=True)
class SegmentMap:
    """A mapping of part of a segment: ``base``/``length`` as mmap returned them (page-aligned), ``address`` where
    the registered span starts in it, ``nbytes`` the span's size; ``read_only``: mapped PROT_READ."""

    base: int
    length: int
    address: int
    nbytes: int
    read_only: bool


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_segment(fd: int, offset: int, nbytes: int, read_only: bool = True) -> SegmentMap:
    """Map ``nbytes`` at ``offset`` of the file ``fd`` shared (the client's own pages), PROT_READ unless
    ``read_only`` is False. Through libc, not Python's mmap: its address is needed, and its unmapping must wait
    for the GPU's last read, whatever still references it. HostMemoryError when the system refuses."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    length = offset + nbytes - start
    prot = mmap.PROT_READ | (0 if read_only else mmap.PROT_WRITE)
    base = _libc.mmap(None, length, prot, mmap.MAP_SHARED, fd, start)
    if base is None or base == _MAP_FAILED:
        err = ctypes.get_errno()
        raise HostMemoryError(f"mmap of {length} bytes failed: {os.strerror(err)}")
    return SegmentMap(base, length, base + offset - start, nbytes, read_only)


def unmap_segment(mapping: SegmentMap) -> None:
    """Unmap what ``map_segment`` returned (once it is unlocked and nothing reads it)."""
    _libc.munmap(mapping.base, mapping.length)


def _loaded_cudart() -> str:
    """The CUDA runtime torch loaded (its calls then share torch's CUDA state: one primary context per device)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        path = parts[-1] if len(parts) >= 6 else ""
        if "libcudart.so" in Path(path).name:
            return path
    raise OSError("torch has loaded no CUDA runtime (libcudart)")


class CudaPageLocker:
    """PageLocker through the CUDA runtime: cudaHostRegister (portable, read-only where the mapping is) and
    cudaHostUnregister; a locked range is registered with the pipeline as page-locked and DMA-only (it DMAs
    requests from it in place, and refuses to copy from it on the CPU). The runtime is the one torch loaded; the
    last-error a refusal records is cleared here (torch checks cudaGetLastError after its launches, and would
    blame the next one on this thread).

    It refuses every lock (the registry then copies) on a device that cannot register host memory, or that reads
    registered memory through the host's page tables (there cudaHostRegister pins nothing, and a segment truncated
    under a DMA would fault the device instead of leaving it the pages locked at registration)."""

    def __init__(self) -> None:
        import torch

        from . import pipeline

        torch.cuda.init()
        self._pipeline = pipeline
        self._rt = ctypes.CDLL(_loaded_cudart())
        self._rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        self._rt.cudaGetErrorName.restype = ctypes.c_char_p
        self._rt.cudaGetErrorName.argtypes = [ctypes.c_int]
        self._rt.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self.refusal = ""  # why every lock is refused ('' when none is)
        for device in range(torch.cuda.device_count()):
            if not self._attribute(_ATTR_HOST_REGISTER_SUPPORTED, device):
                self.refusal = f"device {device} cannot register host memory (cudaDevAttrHostRegisterSupported 0)"
            elif self._attribute(_ATTR_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES, device):
                self.refusal = (f"device {device} reads host memory through the host's page tables "
                                f"(cudaDevAttrPageableMemoryAccessUsesHostPageTables): nothing would be page-locked")

    def _attribute(self, attribute: int, device: int) -> int:
        value = ctypes.c_int(0)
        if self._rt.cudaDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0:
            self._rt.cudaGetLastError()
            return 0
        return value.value

    def _name(self, code: int) -> str:
        return f"{self._rt.cudaGetErrorName(code).decode()} ({code})"

    def lock(self, address: int, nbytes: int, read_only: bool) -> None:
        if self.refusal:
            raise HostMemoryError(self.refusal)
        flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
        code = self._rt.cudaHostRegister(address, nbytes, flags)
        if code != 0:
            self._rt.cudaGetLastError()
            raise HostMemoryError(f"cudaHostRegister of {nbytes} bytes refused: {self._name(code)}")
        self._pipeline.register_page_locked(address, nbytes, dma_only=True)

    def unlock(self, address: int, nbytes: int) -> None:
        self._pipeline.unregister_page_locked(address, nbytes)
        code = self._rt.cudaHostUnregister(address)
        if code != 0:
            self._rt.cudaGetLastError()
            raise HostMemoryError(f"cudaHostUnregister refused: {self._name(code)}")
