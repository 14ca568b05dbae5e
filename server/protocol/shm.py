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
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..core.errors import ServingError, Status, exhausted, invalid, not_found, shown

if TYPE_CHECKING:
    from .cudashm import CudaSharedMemoryRegistry

SHM_DIR = "/dev/shm"
_KEY = re.compile(r"/?([A-Za-z0-9_.-]{1,200})")  # used with fullmatch: '$' would let a trailing newline through
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    file: tuple[int, int]  # (st_dev, st_ino) of the segment registered: a recreated segment is another file
    fd: int | None = None  # opened on first use in a replica that did not register it
    record: tuple[int, int] | None = None  # the shared record's (inode, mtime) this region was opened from

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.key.lstrip("/"))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


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
                 shared_dir: str | None = None) -> None:
        self.max_regions, self.max_total_bytes = max_regions, max_total_bytes
        self._regions: dict[str, Region] = {}
        self._shared = shared_dir
        self._lock = threading.Lock()
        # Where read() puts an input: numpy memory by default (whose release the budget of copies in flight sees,
        # server/protocol/inference.py); a GPU server installs a pinned-memory allocator
        # so that the one copy out of the client's segment is also the one the GPU copies from.
        self.allocate: Callable[[int], memoryview] = lambda n: np.empty(n, np.uint8).data
        # The CUDA regions (cudashm.py), when the server has them: one namespace with this registry's.
        self.cuda: CudaSharedMemoryRegistry | None = None

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
        with self._lock:
            self._sync_all()
            if name in self._regions:
                raise ServingError(Status.ALREADY_EXISTS, f"region {name!r} is already registered")
            if len(self._regions) >= self.max_regions:
                raise exhausted(f"{len(self._regions)} regions are registered, the limit (--max-shm-regions)")
            total = sum(r.byte_size for r in self._regions.values()) + byte_size
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

    def _write_record(self, region: Region) -> tuple[int, int]:
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
        return info.st_ino, info.st_mtime_ns

    def _sync(self, name: str) -> Region | None:
        """This process's view of region ``name`` brought in line with the shared record (no-op unshared)."""
        region = self._regions.get(name)
        if self._shared is None:
            return region
        path = self._record_path(name)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            if region is not None:  # unregistered through another replica
                self._regions.pop(name).close()
            return None
        record = (info.st_ino, info.st_mtime_ns)
        if region is not None and region.record == record:
            return region
        if region is not None:  # unregistered and registered again elsewhere: open anew on first use
            self._regions.pop(name).close()
        try:
            with open(path) as f:
                data = json.load(f)
            key, offset, byte_size = str(data["key"]), int(data["offset"]), int(data["byte_size"])
            file = (int(data["dev"]), int(data["ino"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # being written or removed right now: treat as absent
        if not _KEY.fullmatch(key):
            return None
        region = Region(name, key, offset, byte_size, file, None, record)
        self._regions[name] = region
        return region

    def _sync_all(self) -> None:
        sync_all(self._shared, self._regions, self._sync)

    def unregister(self, name: str) -> None:
        """Unregister one region, or every region when name is empty."""
        with self._lock:
            if name and self._sync(name) is None:
                raise not_found(f"region {shown(name)!r} is not registered")
            if not name:
                self._sync_all()
            for key in [name] if name else list(self._regions):
                self._regions.pop(key).close()
                if self._shared is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._record_path(key))

    def status(self, name: str) -> list[Region]:
        """Region ``name``, or every region when name is empty (registrations, whatever their segments' state)."""
        with self._lock:
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
        """A private copy of the bytes, in memory from ``allocate`` (the request keeps no reference into the
        client's memory). The copy runs outside the registry's lock, on a duplicate of the segment's file
        descriptor, so concurrent requests copy in parallel and an unregister meanwhile cannot pull the
        descriptor from under a read."""
        with self._lock:
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
            return view
        finally:
            os.close(fd)

    def write(self, name: str, offset: int, data: bytes, what: str) -> None:
        """Write ``data`` at ``offset`` of region ``name``."""
        with self._lock:
            _, fd, start = self._slice(name, offset, len(data), what)
            view = memoryview(data)
            done = 0
            while done < len(data):
                done += os.pwrite(fd, view[done:], start + done)

    def close(self) -> None:
        """Close this process's segments (the shared records stay: other replicas may still serve them)."""
        with self._lock:
            for region in self._regions.values():
                region.close()
            self._regions.clear()
