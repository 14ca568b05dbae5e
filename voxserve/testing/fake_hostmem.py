"""A PageLocker (server/core/hostmem.py) without a GPU: it page-locks nothing, but keeps the ranges "locked" as
CUDA would (each once, unlocked once), can refuse as cudaHostRegister does (``refuse``, or ``limit_bytes``, as
RLIMIT_MEMLOCK would), and counts, so that the system shared-memory registry's in-place path is tested in CI.
"""

from __future__ import annotations

import threading

from voxserve.server.core.hostmem import HostMemoryError


class FakePageLocker:
    """PageLocker that records ranges. ``read_only_supported``: whether it accepts read-only mappings (a device
    without cudaDevAttrHostRegisterReadOnlySupported refuses them)."""

    def __init__(self, limit_bytes: int | None = None, read_only_supported: bool = True) -> None:
        self.limit_bytes = limit_bytes
        self.read_only_supported = read_only_supported
        self.refuse = False  # refuse every lock from now on
        self.locks = 0
        self.unlocks = 0
        self.locked: dict[int, tuple[int, bool]] = {}  # address -> (bytes, read_only)
        self._lock = threading.Lock()

    @property
    def locked_bytes(self) -> int:
        with self._lock:
            return sum(n for n, _ in self.locked.values())

    def lock(self, address: int, nbytes: int, read_only: bool) -> None:
        with self._lock:
            if self.refuse:
                raise HostMemoryError("cudaHostRegister of the range refused: cudaErrorNotSupported (801)")
            if read_only and not self.read_only_supported:
                raise HostMemoryError("cudaHostRegister of the range refused: cudaErrorInvalidValue (1)")
            if address in self.locked:
                raise HostMemoryError("cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered (712)")
            total = sum(n for n, _ in self.locked.values()) + nbytes
            if self.limit_bytes is not None and total > self.limit_bytes:
                raise HostMemoryError("cudaHostRegister refused: cudaErrorMemoryAllocation (2): RLIMIT_MEMLOCK")
            self.locked[address] = (nbytes, read_only)
            self.locks += 1

    def unlock(self, address: int, nbytes: int) -> None:
        with self._lock:
            if self.locked.get(address, (None,))[0] != nbytes:
                raise HostMemoryError("cudaHostUnregister: cudaErrorHostMemoryNotRegistered (713)")
            del self.locked[address]
            self.unlocks += 1
