"""System shared memory (the protocol's extension): clients on the same host register POSIX shared-memory
segments and pass tensors by region + offset instead of over the socket.

Only regular files directly under /dev/shm can be registered (a key is a name, never a path; symlinks are
refused). Every access re-checks bounds against the segment's current size, so hostile offsets and sizes
get INVALID_ARGUMENT instead of an out-of-bounds read. Segments are read and written with pread/pwrite on
the file, not through a mapping: a client that shrinks its segment while the server copies gets a short
read (INVALID_ARGUMENT), where a mapped copy would take a SIGBUS and the whole server with it.
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

import grpc

from .errors import ServingError, exhausted, invalid, not_found

SHM_DIR = "/dev/shm"
_KEY = re.compile(r"^/?([A-Za-z0-9_.-]{1,200})$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    record: tuple[int, int] | None = None  # the shared record's (inode, mtime) this region was opened from

    def close(self) -> None:
        os.close(self.fd)


class SharedMemoryRegistry:
    """The registered regions. With ``shared_dir`` (the replicas of one server, server/replicas.py), the
    registry itself lives in that directory, one small record file per region (created exclusively, so a
    name is registered once across replicas); each process opens a segment on first use and re-checks the
    record on every access, so an unregister through any replica takes effect in all of them."""

    def __init__(self, max_regions: int = 64, max_total_bytes: int = 8 * 1024**3,
                 shared_dir: str | None = None) -> None:
        self.max_regions, self.max_total_bytes = max_regions, max_total_bytes
        self._regions: dict[str, Region] = {}
        self._shared = shared_dir
        self._lock = threading.Lock()
        # Where read() puts an input: bytearray by default; a GPU server installs a pinned-memory allocator
        # so that the one copy out of the client's segment is also the one the GPU copies from.
        self.allocate: Callable[[int], memoryview] = lambda n: memoryview(bytearray(n))

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not _NAME.match(name):
            raise invalid(f"region name {name!r} must be 1-128 letters, digits, '_', '-' or '.'")
        match = _KEY.match(key)
        if not match or match.group(1) in (".", ".."):
            raise invalid(f"shared-memory key {key!r} must be a name under {SHM_DIR} ('/name' or 'name'), "
                          f"not a path")
        if byte_size <= 0:
            raise invalid(f"region {name!r}: byte_size {byte_size} must be > 0")
        if offset < 0:
            raise invalid(f"region {name!r}: offset {offset} must be >= 0")
        with self._lock:
            self._sync_all()
            if name in self._regions:
                raise ServingError(grpc.StatusCode.ALREADY_EXISTS, f"region {name!r} is already registered")
            if len(self._regions) >= self.max_regions:
                raise exhausted(f"{len(self._regions)} regions are registered, the limit (--max-shm-regions)")
            total = sum(r.byte_size for r in self._regions.values()) + byte_size
            if total > self.max_total_bytes:
                raise exhausted(f"registering {byte_size} bytes would map {total} bytes of shared memory; "
                                f"the limit is {self.max_total_bytes} (--max-shm-bytes)")
            fd = self._open_segment(name, match.group(1), key, offset, byte_size)
            record = None
            if self._shared is not None:
                try:
                    record = self._write_record(name, key, offset, byte_size)
                except BaseException:
                    os.close(fd)
                    raise
            self._regions[name] = Region(name, key, offset, byte_size, fd, record)

    @staticmethod
    def _open_segment(name: str, file: str, key: str, offset: int, byte_size: int) -> int:
        path = os.path.join(SHM_DIR, file)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise not_found(f"no shared-memory segment {key!r} ({path})") from None
        except OSError as exc:
            raise invalid(f"shared-memory key {key!r} cannot be opened: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise invalid(f"shared-memory key {key!r} is not a shared-memory segment")
            if offset + byte_size > info.st_size:
                raise invalid(f"region {name!r}: offset {offset} + byte_size {byte_size} exceeds the segment's "
                              f"{info.st_size} bytes")
        except BaseException:
            os.close(fd)
            raise
        return fd

    # --- the shared registry (replicas) ----------------------------------------------------------

    def _record_path(self, name: str) -> str:
        assert self._shared is not None
        return os.path.join(self._shared, "r-" + name)  # names never contain '/'; "r-" keeps '.' and '..' files

    def _write_record(self, name: str, key: str, offset: int, byte_size: int) -> tuple[int, int]:
        path = self._record_path(name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise ServingError(grpc.StatusCode.ALREADY_EXISTS, f"region {name!r} is already registered") from None
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "offset": offset, "byte_size": byte_size}, f)
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
        if region is not None:  # unregistered and registered again elsewhere: reopen
            self._regions.pop(name).close()
        try:
            with open(path) as f:
                data = json.load(f)
            key, offset, byte_size = str(data["key"]), int(data["offset"]), int(data["byte_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # being written or removed right now: treat as absent
        match = _KEY.match(key)
        if not match:
            return None
        fd = self._open_segment(name, match.group(1), key, offset, byte_size)
        region = Region(name, key, offset, byte_size, fd, record)
        self._regions[name] = region
        return region

    def _sync_all(self) -> None:
        if self._shared is None:
            return
        names = {f[2:] for f in os.listdir(self._shared) if f.startswith("r-")}
        for name in names | set(self._regions):
            try:
                self._sync(name)
            except ServingError:  # its segment is gone: the region is unusable, not an error here
                continue

    def unregister(self, name: str) -> None:
        """Unregister one region, or every region when name is empty."""
        with self._lock:
            if name and self._sync(name) is None:
                raise not_found(f"region {name!r} is not registered")
            if not name:
                self._sync_all()
            for key in [name] if name else list(self._regions):
                self._regions.pop(key).close()
                if self._shared is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._record_path(key))

    def status(self, name: str) -> list[Region]:
        with self._lock:
            if name:
                region = self._sync(name)
                if region is None:
                    raise not_found(f"region {name!r} is not registered")
                return [region]
            self._sync_all()
            return list(self._regions.values())

    def _slice(self, name: str, offset: int, byte_size: int, what: str) -> tuple[Region, int]:
        region = self._sync(name)
        if region is None:
            raise not_found(f"{what}: shared-memory region {name!r} is not registered")
        if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
            raise invalid(f"{what}: offset {offset} + byte_size {byte_size} is outside region {name!r} "
                          f"({region.byte_size} bytes)")
        start = region.offset + offset
        # The client may have shrunk the segment since registration: reading past its end would fault.
        if os.fstat(region.fd).st_size < start + byte_size:
            raise invalid(f"{what}: shared-memory segment {region.key!r} is now smaller than region {name!r}")
        return region, start

    def read(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        """A private copy of the bytes, in memory from ``allocate`` (the request keeps no reference into the
        client's memory). The copy runs outside the registry's lock, on a duplicate of the segment's file
        descriptor, so concurrent requests copy in parallel and an unregister meanwhile cannot pull the
        descriptor from under a read."""
        with self._lock:
            region, start = self._slice(name, offset, byte_size, what)
            fd = os.dup(region.fd)
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
        with self._lock:
            region, start = self._slice(name, offset, len(data), what)
            view = memoryview(data)
            done = 0
            while done < len(data):
                done += os.pwrite(region.fd, view[done:], start + done)

    def close(self) -> None:
        """Close this process's segments (the shared records stay: other replicas may still serve them)."""
        with self._lock:
            for region in self._regions.values():
                region.close()
            self._regions.clear()
