"""A DeviceMemory (server/core/devicemem.py) without a GPU: "device memory" is host memory, a handle is 64 random
bytes bound to it by ``export``. It refuses what the CUDA driver refuses, with the errors CUDA names (unknown or
freed memory, a handle of the importing process itself, a device it does not have), and counts every open and
close, so tests of the CUDA shared-memory registry and RPCs run in CI and can see that nothing leaks.

The addresses are the buffers' real addresses: code that reads a mapping through them (a numpy view) reads what
the test exported.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

from voxserve.server.core.devicemem import ALLOCATION_ALIGNMENT as ALIGNMENT
from voxserve.server.core.devicemem import HANDLE_BYTES, DeviceMemoryError, Mapping


@dataclass
class _Export:
    buffer: ctypes.Array  # the "allocation": ``size`` bytes from ``start`` (aligned as cudaMalloc aligns)
    start: int
    size: int
    device: int
    own_process: bool  # exported by the importing process itself: the driver refuses those
    inside: int = 0  # a forged handle's: it maps this many bytes past the allocation's start
    freed: bool = False


class FakeDeviceMemory:
    """DeviceMemory over host buffers. ``devices``: how many devices it pretends to have."""

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.opens = 0
        self.closes = 0
        self.writes = 0  # outputs written into a mapping
        self.fail_close = False  # make close raise (a test of what the registry does then)
        self.open_threads: list[str] = []  # the threads open ran on (the registry must keep it off the loop)
        self._exports: dict[bytes, _Export] = {}
        self._open: dict[int, int] = {}  # address -> mappings open on it
        self._lock = threading.Lock()

    # --- the exporter's side ---------------------------------------------------------------------

    def export(self, data: bytes | int, device: int = 0, own_process: bool = False, inside: int = 0) -> bytes:
        """A handle of a new allocation holding ``data`` (or that many zero bytes) on ``device``, starting on a
        ``ALIGNMENT`` boundary as cudaMalloc's do. ``inside``: a forged handle (its offset field changed) that maps
        that many bytes into the allocation, as the driver does with one."""
        size = len(data) if isinstance(data, bytes) else data
        buffer = ctypes.create_string_buffer(size + ALIGNMENT)
        start = -ctypes.addressof(buffer) % ALIGNMENT
        if isinstance(data, bytes):
            ctypes.memmove(ctypes.addressof(buffer) + start, data, size)
        handle = os.urandom(HANDLE_BYTES)
        with self._lock:
            self._exports[handle] = _Export(buffer, start, size, device, own_process, inside)
        return handle

    def free(self, handle: bytes) -> None:
        """The exporter frees the allocation: its handle no longer opens (mappings already open stay readable, as
        the driver keeps the memory while it is mapped)."""
        with self._lock:
            self._exports[handle].freed = True

    def contents(self, handle: bytes) -> bytes:
        """What the allocation holds now."""
        export = self._exports[handle]
        return export.buffer.raw[export.start : export.start + export.size]

    @property
    def mapped(self) -> int:
        """Mappings open now."""
        with self._lock:
            return sum(self._open.values())

    # --- DeviceMemory ----------------------------------------------------------------------------

    def device_count(self) -> int:
        return self.devices

    def open(self, handle: bytes, device: int, nbytes: int | None = None) -> Mapping:
        self.open_threads.append(threading.current_thread().name)
        if not 0 <= device < self.devices:
            raise DeviceMemoryError("the device is not usable by this server", "cudaErrorInvalidDevice")
        with self._lock:
            export = self._exports.get(bytes(handle)) if len(handle) == HANDLE_BYTES else None
            if export is None or export.freed:
                raise DeviceMemoryError("it is not a live CUDA IPC handle", "cudaErrorInvalidResourceHandle")
            if export.own_process:
                raise DeviceMemoryError("it was exported by the server's own process", "cudaErrorDeviceUninitialized")
            base = ctypes.addressof(export.buffer) + export.start
            address = base + export.inside
            self._open[address] = self._open.get(address, 0) + 1
            self.opens += 1
        return Mapping(address, export.size - export.inside, base, export.device, device, host=True)

    def close(self, mapping: Mapping) -> None:
        with self._lock:
            if self._open.get(mapping.address, 0) == 0:
                raise DeviceMemoryError("it is not mapped", "cudaErrorInvalidValue")
            if self.fail_close:
                raise DeviceMemoryError("CUDA could not unmap it", "cudaErrorInvalidValue")
            self._open[mapping.address] -= 1
            self.closes += 1

    def write(self, address: int, data: bytes, device: int) -> None:
        ctypes.memmove(address, data, len(data))
        self.writes += 1
