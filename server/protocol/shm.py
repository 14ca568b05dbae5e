"""System shared memory (the protocol's extension): clients on the same host register POSIX shared-memory
segments and pass tensors by region + offset instead of over the socket.

Only regular files directly under /dev/shm can be registered (a key is a name, never a path; symlinks are
refused). Every access re-checks bounds against the segment's current size, so hostile offsets and sizes
get INVALID_ARGUMENT instead of an out-of-bounds read. Segments are read and written with pread/pwrite on
the file, not through a mapping: a client that shrinks its segment while the server copies gets a short
read (INVALID_ARGUMENT), where a mapped copy would take a SIGBUS and the whole server with it.

A region is bound to the segment's file, its (device, inode), at registration. Every access looks the name up
again (one lstat, which also gives the current size): if the name was removed, or now names another file (the
client unlinked the segment and created it again), the access is refused with INVALID_ARGUMENT until the
region is registered again. The process that registered the region still holds the old file open and every
other replica opens the name on first use, so without this check they would serve different data.

On a GPU server (``locker``: server/core/hostmem.py), an input is not copied at all: on first use in each process
the registered span is mapped read-only and page-locked, and a request's input is a read-only view of that mapping
which the pipeline only DMAs (server/core/pipeline.py: registered DMA-only; the CPU never reads it: after a
truncation a CPU read would be a SIGBUS, while the DMA reads the pages locked at registration). The checks above
still run on every access, so a shrunk or recreated segment is refused as before; a client that truncates its
segment while its request is in flight gets its own stale bytes. A view holds a lease on the mapping: an unregister
frees the name at once, and the mapping is unlocked and unmapped when the last request reading it is done.
Page-locked bytes are registered bytes: --max-shm-bytes bounds them (with those of unregistered regions still
read). Where page-locking is refused (RLIMIT_MEMLOCK, CUDA), the region is copied as without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..core.devicemem import RegionTensor
from ..core.errors import ServingError, Status, exhausted, invalid, not_found, shown
from ..core.hostmem import HostMemoryError, PageLocker, SegmentMap, map_segment, unmap_segment
from ..core.leases import Lease, Releases

if TYPE_CHECKING:
    from .cudashm import CudaSharedMemoryRegistry

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# A shared record's identity (inode, mtime, size) vouches for what was read from it only once the record was seen a
# while after its mtime: one removed and written anew within a tick of the file system's clock can come back with
# the same inode, size and mtime (git's "racily clean" entries). Until then it is read again (a few hundred bytes).
RACY_NS = 1_000_000_000


def settled(mtime_ns: int, stat_ns: int) -> bool:
    """Whether a record whose mtime is ``mtime_ns``, stat-ed at ``stat_ns`` (the wall clock, taken before the stat),
    is old enough for its identity to vouch for its contents."""
    return stat_ns - mtime_ns >= RACY_NS

_KEY = re.compile(r"/?([A-Za-z0-9_.-]{1,200})")  # used with fullmatch: '$' would let a trailing newline through
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(eq=False)  # identity: two mappings are never the same
class Pinned:
    """This process's page-locked, read-only mapping of a region's span, and the views of it still in use."""

    region: str
    map: SegmentMap
    in_use: int = 0  # leases not yet ended
    dropped: bool = False  # its region is gone from this process: unlocked and unmapped when in_use reaches 0


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    file: tuple[int, int]  # (st_dev, st_ino) of the segment registered: a recreated segment is another file
    fd: int | None = None  # opened on first use in a replica that did not register it
    record: tuple[int, int, int] | None = None  # the shared record's (inode, mtime, size) it was opened from
    stat_ns: int = 0  # when that record was last stat-ed and read here (settled(): no need to read it again)
    pinned: Pinned | None = None  # this process's page-locked mapping, once made
    copied: bool = False  # page-locking was refused here: inputs are copied

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.key.lstrip("/"))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Pages:
    """``nbytes`` at ``address`` of a page-locked mapping, as numpy takes them (read-only): the array made from it
    keeps it, and with it the lease on the mapping, as long as the array or any view of it is alive."""

    __slots__ = ("__array_interface__", "lease")

    def __init__(self, address: int, nbytes: int, lease: Lease) -> None:
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, True), "version": 3}
        self.lease = lease


def sync_all(shared_dir: str | None, regions: dict, sync: Callable[[str], object]) -> None:
    """Bring every region in line with the shared records (``sync`` one name): those recorded by any process and
    those this one knows. Nothing to do without a shared directory."""
    if shared_dir is None:
        return
    names = {f[2:] for f in os.listdir(shared_dir) if f.startswith("r-")}
    for name in names | set(regions):
        sync(name)


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _replaced(region: Region, what: str, change: str) -> ServingError:
    return invalid(f"{what}: shared-memory segment {region.key!r} was {change} after region {region.name!r} was "
                   f"registered; register the region again")


class SharedMemoryRegistry:
    """The registered regions. With ``shared_dir`` (the replicas of one server, server/topology/supervisor.py), the
    registry itself lives in that directory, one small record file per region (created exclusively, so a
    name is registered once across replicas), which carries the segment's file identity; each process opens
    a segment on first use, checks it is the registered file, and re-checks the record on every access, so
    an unregister through any replica takes effect in all of them."""

    def __init__(self, max_regions: int = 64, max_total_bytes: int = 8 * 1024**3,
                 shared_dir: str | None = None, locker: PageLocker | None = None) -> None:
        self.max_regions, self.max_total_bytes = max_regions, max_total_bytes
        self._regions: dict[str, Region] = {}
        self._shared = shared_dir
        self._lock = threading.Lock()
        # With a page-locker (a GPU server), inputs are read in place by the GPU (see the module's text).
        self.locker = locker
        self._draining: list[Pinned] = []  # mappings of regions gone, still read by a request
        self._releases: Releases[Pinned] = Releases(self._lock, self._lease_ended, self._unpin)
        self._warned = False  # a refused page-lock is logged once
        # Inputs by how they were read, ever (the copy-count tests read them): private copies, views in place.
        self.copies = self.copied_bytes = 0
        self.in_place_reads = self.in_place_bytes = 0
        # Where read() puts an input: numpy memory by default (whose release the budget of copies in flight sees,
        # server/protocol/inference.py); a GPU server installs a pinned-memory allocator
        # so that the one copy out of the client's segment is also the one the GPU copies from.
        self.allocate: Callable[[int], memoryview] = lambda n: np.empty(n, np.uint8).data
        # The CUDA regions (cudashm.py), when the server has them: one namespace with this registry's.
        self.cuda: CudaSharedMemoryRegistry | None = None
        # A front end whose engines read the clients' segments themselves (page-locked in place): inputs are passed
        # on by region (read_tensor), this process reads none.
        self.by_reference = False

    def read_tensor(self, name: str, offset: int, shape: tuple[int, ...], dtype: np.dtype,
                    what: str) -> np.ndarray | RegionTensor:
        """An input of ``shape`` and ``dtype``: ``read``'s bytes as an array, or (``by_reference``) the tensor by
        region for the engine to read, once ``read``'s checks pass here."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.by_reference:
            with self._releases.locked():
                self._slice(name, offset, nbytes, what)
            return RegionTensor(name, offset, tuple(shape), dtype, -1, "system")
        return np.frombuffer(self.read(name, offset, nbytes, what), dtype=dtype).reshape(shape)

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register ``byte_size`` bytes at ``offset`` of segment ``key`` as region ``name``, bound to the file
        that ``key`` names now."""
        if not _NAME.fullmatch(name):
            raise invalid(f"region name {shown(name)!r} must be 1-128 letters, digits, '_', '-' or '.'")
        match = _KEY.fullmatch(key)
        if not match or match.group(1) in (".", ".."):
            raise invalid(f"shared-memory key {shown(key)!r} must be a name under {SHM_DIR} ('/name' or 'name'), "
                          f"not a path")
        if byte_size <= 0:
            raise invalid(f"region {name!r}: byte_size {byte_size} must be > 0")
        if offset < 0:
            raise invalid(f"region {name!r}: offset {offset} must be >= 0")
        if self.cuda is not None and self.cuda.holds(name):
            raise ServingError(Status.ALREADY_EXISTS, f"region {name!r} is already registered (as CUDA shared memory)")
        with self._releases.locked():
            self._sync_all()
            if name in self._regions:
                raise ServingError(Status.ALREADY_EXISTS, f"region {name!r} is already registered")
            if len(self._regions) >= self.max_regions:
                raise exhausted(f"{len(self._regions)} regions are registered, the limit (--max-shm-regions)")
            # Mappings of unregistered regions that requests still read stay page-locked: they count until unlocked.
            total = (sum(r.byte_size for r in self._regions.values()) + sum(p.map.nbytes for p in self._draining)
                     + byte_size)
            if total > self.max_total_bytes:
                raise exhausted(f"registering {byte_size} bytes would map {total} bytes of shared memory; "
                                f"the limit is {self.max_total_bytes} (--max-shm-bytes)")
            fd, info = self._open_segment(key)
            try:
                if offset + byte_size > info.st_size:
                    raise invalid(f"region {name!r}: offset {offset} + byte_size {byte_size} exceeds the "
                                  f"segment's {info.st_size} bytes")
                region = Region(name, key, offset, byte_size, _identity(info), fd)
                if self._shared is not None:
                    region.record = self._write_record(region)
            except BaseException:
                os.close(fd)
                raise
            self._regions[name] = region

    @staticmethod
    def _open_segment(key: str) -> tuple[int, os.stat_result]:
        """The segment's file, opened read-write, and its fstat; refused unless it is a regular file."""
        path = os.path.join(SHM_DIR, key.lstrip("/"))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise not_found(f"no shared-memory segment {shown(key)!r} ({shown(path)})") from None
        except OSError as exc:
            raise invalid(f"shared-memory key {shown(key)!r} cannot be opened: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise invalid(f"shared-memory key {shown(key)!r} is not a shared-memory segment")
        except BaseException:
            os.close(fd)
            raise
        return fd, info

    # --- the shared registry (replicas) ----------------------------------------------------------

    def _record_path(self, name: str) -> str:
        assert self._shared is not None
        return os.path.join(self._shared, "r-" + name)  # names never contain '/'; "r-" keeps '.' and '..' files

    def _write_record(self, region: Region) -> tuple[int, int, int]:
        path = self._record_path(region.name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise ServingError(Status.ALREADY_EXISTS,
                               f"region {region.name!r} is already registered") from None
        with os.fdopen(fd, "w") as f:
            json.dump({"key": region.key, "offset": region.offset, "byte_size": region.byte_size,
                       "dev": region.file[0], "ino": region.file[1]}, f)
        info = os.stat(path)
        return info.st_ino, info.st_mtime_ns, info.st_size

    def _sync(self, name: str) -> Region | None:
        """This process's view of region ``name`` brought in line with the shared record (no-op unshared)."""
        region = self._regions.get(name)
        if self._shared is None:
            return region
        path = self._record_path(name)
        stat_ns = time.time_ns()
        try:
            info = os.stat(path)
        except FileNotFoundError:
            if region is not None:  # unregistered through another replica
                self._drop(name)
            return None
        record = (info.st_ino, info.st_mtime_ns, info.st_size)
        if region is not None and region.record == record and settled(info.st_mtime_ns, region.stat_ns):
            return region
        try:
            with open(path) as f:
                data = json.load(f)
            key, offset, byte_size = str(data["key"]), int(data["offset"]), int(data["byte_size"])
            file = (int(data["dev"]), int(data["ino"]))
        except (OSError, ValueError, KeyError, TypeError):  # being written or removed right now
            if region is not None and region.record == record:
                return region  # as last read (it cannot be read again now)
            if region is not None:  # unregistered and registered again elsewhere
                self._drop(name)
            return None  # treat as absent
        if region is not None and region.record == record and (key, offset, byte_size, file) == (
                region.key, region.offset, region.byte_size, region.file):
            region.stat_ns = stat_ns  # the same record, read again while its identity could not vouch for it
            return region
        if region is not None:  # unregistered and registered again elsewhere: open anew on first use
            self._drop(name)
        if not _KEY.fullmatch(key):
            return None
        region = Region(name, key, offset, byte_size, file, None, record, stat_ns)
        self._regions[name] = region
        return region

    def _sync_all(self) -> None:
        sync_all(self._shared, self._regions, self._sync)

    def _drop(self, name: str) -> None:
        """Forget region ``name`` in this process (under the lock): its descriptor closed, its mapping unlocked and
        unmapped now, or by the end of the last lease on it."""
        region = self._regions.pop(name)
        region.close()
        pinned, region.pinned = region.pinned, None
        if pinned is not None:
            pinned.dropped = True
            if pinned.in_use > 0:
                self._draining.append(pinned)
            else:
                self._unpin(pinned)

    def unregister(self, name: str) -> None:
        """Unregister one region, or every region when name is empty."""
        with self._releases.locked():
            if name and self._sync(name) is None:
                raise not_found(f"region {shown(name)!r} is not registered")
            if not name:
                self._sync_all()
            for key in [name] if name else list(self._regions):
                self._drop(key)
                if self._shared is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._record_path(key))

    def status(self, name: str) -> list[Region]:
        """Region ``name``, or every region when name is empty (registrations, whatever their segments' state)."""
        with self._releases.locked():
            if name:
                region = self._sync(name)
                if region is None:
                    raise not_found(f"region {shown(name)!r} is not registered")
                return [region]
            self._sync_all()
            return list(self._regions.values())

    def _slice(self, name: str, offset: int, byte_size: int, what: str) -> tuple[Region, int, int]:
        """The region, its file descriptor and the segment offset of the slice, once the slice is inside the
        region, the segment's name still names the registered file, and that file is large enough."""
        region = self._sync(name)
        if region is None:
            raise not_found(f"{what}: shared-memory region {shown(name)!r} is not registered")
        if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
            raise invalid(f"{what}: offset {offset} + byte_size {byte_size} is outside region {name!r} "
                          f"({region.byte_size} bytes)")
        start = region.offset + offset
        try:
            info = os.lstat(region.path)
        except FileNotFoundError:
            raise _replaced(region, what, "removed") from None
        if _identity(info) != region.file:
            raise _replaced(region, what, "recreated")
        fd = region.fd
        if fd is None:
            fd, opened = self._open_segment(region.key)
            if _identity(opened) != region.file:  # recreated between the lstat and the open
                os.close(fd)
                raise _replaced(region, what, "recreated")
            region.fd = fd
        # The client may have shrunk the segment since registration: reading past its end would fault.
        if info.st_size < start + byte_size:
            raise invalid(f"{what}: shared-memory segment {region.key!r} is now smaller than region {name!r}")
        return region, fd, start

    def read(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        """The bytes of an input: on a GPU server, a read-only view of the region's page-locked mapping, for the
        GPU to DMA and for nothing else to read (it holds its lease: see ``pinned``); otherwise, or where the
        page-lock was refused, a private copy, in memory from ``allocate`` (the request keeps no reference into
        the client's memory). The copy runs outside the registry's lock, on a duplicate of the segment's file
        descriptor, so concurrent requests copy in parallel and an unregister meanwhile cannot pull the
        descriptor from under a read."""
        got = self.pinned(name, offset, byte_size, what)
        if got is not None:
            return got[0].data
        with self._releases.locked():
            region, fd, start = self._slice(name, offset, byte_size, what)
            fd = os.dup(fd)
        try:
            view = self.allocate(byte_size)
            done = 0
            while done < byte_size:  # one pread normally; a loop for reads the kernel splits
                n = os.preadv(fd, [view[done:]], start + done)
                if n == 0:
                    raise invalid(f"{what}: shared-memory segment {region.key!r} shrank while it was being read")
                done += n
            with self._releases.locked():
                self.copies += 1
                self.copied_bytes += byte_size
            return view
        finally:
            os.close(fd)

    def pinned(self, name: str, offset: int, byte_size: int, what: str) -> tuple[np.ndarray, Lease] | None:
        """``byte_size`` bytes at ``offset`` of region ``name`` where they lie in the client's segment: a read-only
        uint8 view of the region's page-locked mapping (made here on first use in this process), and the lease
        that keeps the mapping locked and mapped while the view, or anything made from it, is alive (or until
        released). None when this server does not page-lock (no ``locker``) or it was refused for this region:
        copy it instead (``read``). The checks are ``read``'s: NOT_FOUND, INVALID_ARGUMENT for a slice outside the
        region or a segment shrunk, removed or recreated since registration.

        THE VIEW IS FOR THE GPU'S DMA ONLY (server/core/pipeline.py, which is told so): a CPU read of it faults,
        and takes the server down, once the client has truncated its segment. The first use blocks on mmap and
        cudaHostRegister: call it off the event loop."""
        if self.locker is None:
            return None
        with self._releases.locked():
            region, _, start = self._slice(name, offset, byte_size, what)
            if region.copied:
                return None
            pinned = region.pinned
            if pinned is None:
                pinned = region.pinned = self._pin(region)
                if pinned is None:
                    return None
            pinned.in_use += 1
            self.in_place_reads += 1
            self.in_place_bytes += byte_size
        lease = Lease(functools.partial(self._releases.end, pinned))
        return np.asarray(_Pages(pinned.map.address + start - region.offset, byte_size, lease)), lease

    def _pin(self, region: Region) -> Pinned | None:
        """Map region's span read-only and page-lock it (under the lock); None, and the region copied from now on
        in this process, when that is refused (logged once per process)."""
        assert self.locker is not None and region.fd is not None
        if os.fstat(region.fd).st_size < region.offset + region.byte_size:
            # Pages past the end cannot be locked: refuse this request, lock the region once it is whole again.
            raise invalid(f"shared-memory segment {region.key!r} is now smaller than region {region.name!r}")
        reason = ""
        for read_only in (True, False):  # a device without read-only registration locks a writable mapping
            mapping: SegmentMap | None = None
            try:
                mapping = map_segment(region.fd, region.offset, region.byte_size, read_only)
                self.locker.lock(mapping.base, mapping.length, read_only)  # whole pages
                return Pinned(region.name, mapping)
            except HostMemoryError as exc:
                if mapping is not None:
                    unmap_segment(mapping)
                reason = exc.reason
        region.copied = True
        if not self._warned:
            self._warned = True
            log.warning("page-locking shared-memory region %r (%d bytes) for the GPU to read in place failed: %s; "
                        "its inputs, and those of any other region refused in this process, are copied first "
                        "(RLIMIT_MEMLOCK and --max-shm-bytes bound what can be locked)", region.name,
                        region.byte_size, reason)
        else:
            log.debug("page-locking shared-memory region %r failed: %s", region.name, reason)
        return None

    def _lease_ended(self, pinned: Pinned) -> Pinned | None:
        """Account for one lease's end (under the lock): the mapping to unpin now, if it was its last and the
        region is gone."""
        pinned.in_use -= 1
        if pinned.dropped and pinned.in_use == 0 and pinned in self._draining:
            self._draining.remove(pinned)  # (not there once close() has unpinned everything)
            return pinned
        return None

    def _unpin(self, pinned: Pinned) -> None:
        """Unlock and unmap a mapping nothing reads any more; a failure is logged, never raised (this also runs
        from a lease's finalizer)."""
        try:
            assert self.locker is not None
            self.locker.unlock(pinned.map.base, pinned.map.length)
        except HostMemoryError as exc:
            log.warning("shared-memory region %r: unlocking its mapping failed: %s", pinned.region, exc.reason)
        except Exception:
            log.exception("shared-memory region %r: unlocking its mapping failed", pinned.region)
        finally:
            unmap_segment(pinned.map)

    def in_place(self, array: object) -> bool:
        """Whether ``array`` lies in one of this process's page-locked mappings, or is passed on by region: an input
        read in place, not a copy (the budget of copies in flight, server/protocol/inference.py, has nothing to
        bound for it)."""
        if isinstance(array, RegionTensor):
            return True
        if self.locker is None or not isinstance(array, np.ndarray):
            return False
        address = array.__array_interface__["data"][0]
        with self._releases.locked():
            maps = [r.pinned.map for r in self._regions.values() if r.pinned is not None]
            maps += [p.map for p in self._draining]
        return any(m.base <= address < m.base + m.length for m in maps)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of client segments page-locked in this process now (registered, or unregistered and still read;
        a region's span from the start of the page it begins in)."""
        with self._releases.locked():
            live = sum(r.pinned.map.length for r in self._regions.values() if r.pinned is not None)
            return live + sum(p.map.length for p in self._draining)

    @property
    def draining(self) -> int:
        """Mappings of unregistered regions that wait for the last request reading them."""
        with self._releases.locked():
            return len(self._draining)

    def write(self, name: str, offset: int, data: bytes, what: str) -> None:
        """Write ``data`` at ``offset`` of region ``name``."""
        with self._releases.locked():
            _, fd, start = self._slice(name, offset, len(data), what)
            view = memoryview(data)
            done = 0
            while done < len(data):
                done += os.pwrite(fd, view[done:], start + done)

    def close(self) -> None:
        """Close this process's segments and unlock every mapping, read or not (the server is stopping: its
        executions are over); the shared records stay: other replicas may still serve them."""
        with self._releases.locked():
            for region in self._regions.values():
                region.close()
                if region.pinned is not None:
                    self._unpin(region.pinned)
                    region.pinned = None
            self._regions.clear()
            for pinned in self._draining:
                self._unpin(pinned)
            self._draining.clear()

