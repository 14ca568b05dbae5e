"""CUDA shared memory (the protocol's extension): clients on the same host register device memory of their own by
its CUDA IPC handle and pass tensors by region + offset, as for system shared memory (``shm.py``).

A handle is opened once, at registration, through the server's device layer (``core/devicemem.py``; off the event
loop: it can take milliseconds), in the context of the device the client names. The client's ``byte_size`` is
checked against the real extent of the allocation the handle maps, so no later access can reach beyond the
client's own memory whatever it claims; every access is bounded again by the region (``lease``). A handle is a
capability (its bytes map the client's memory): no status, log line or error message contains one.

Names are one namespace with system shared-memory regions (as in Triton): a name held by either kind is
ALREADY_EXISTS for both.

A region in use is not unmapped under its users: ``lease`` pins the mapping until the lease is released (after the
GPU's last read or write of it), and ``unregister`` frees the name at once (new requests get NOT_FOUND; the name
can be registered again) while the mapping is closed when its last lease is released, as Triton defers it.

With ``shared_dir`` (the replicas of one server) the registrations live in that directory, one record per region,
in the same files as system shared memory's (``shm.py``: ``r-<name>``, created exclusively), so that a name is taken
once across replicas and across both kinds: a CUDA record has ``"kind": "cuda"`` and the base64 handle, and
``shm.py`` reads it as no system region of its own. Every process opens its own mapping (IPC mappings are per
process): the registering one at registration, the others on first use; a record that is gone, or that now carries
another ``token`` (unregistered and registered again), drops this process's mapping (once its leases are released).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import functools
import json
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..core import leases
from ..core.devicemem import (
    ALLOCATION_ALIGNMENT,
    HANDLE_BYTES,
    DeviceArray,
    DeviceMemory,
    DeviceMemoryError,
    Mapping,
    RegionTensor,
    host_view,
)
from ..core.errors import ServingError, Status, exhausted, invalid, not_found, shown
from .shm import _NAME, SharedMemoryRegistry, settled, sync_all

log = logging.getLogger(__name__)
KIND = "cuda"  # a record's "kind" (system regions' records have none)
# How many times one request maps a region in this process before it is refused (it was registered anew each time).
MAP_ROUNDS = 3
FOREIGN = "foreign"  # _read_record's answer for a record of a system region


@dataclass(eq=False)  # identity: two registrations are never the same region
class CudaRegion:
    """A registered region. ``device_id``: as the client gave it (the device whose context opened the handle);
    ``mapping``: this process's, None until it is opened here (in a replica that did not register it)."""

    name: str
    handle: bytes = field(repr=False)  # a capability: never in a repr, a log or a message
    device_id: int
    byte_size: int
    mapping: Mapping | None
    token: str = ""  # the shared record's: a registration's identity across replicas
    in_use: int = 0  # leases not yet released
    unregistered: bool = False  # the name is gone; the mapping closes when in_use reaches 0
    opening: threading.Lock = field(default_factory=threading.Lock, repr=False)  # held while it opens here
    unusable: str = ""  # why it did not open here (a replica's first use): refused at once from then on


class Lease(leases.Lease):
    """``nbytes`` of a region at ``address`` on ``device``, kept mapped until ``release()`` (idempotent; also run
    when the lease is garbage-collected, so a lease dropped by a cancelled request is never lost)."""

    __slots__ = ("address", "device", "host", "nbytes", "region")

    def __init__(self, registry: CudaSharedMemoryRegistry, region: CudaRegion, offset: int, nbytes: int) -> None:
        assert region.mapping is not None
        super().__init__(functools.partial(registry._releases.end, region))
        self.region = region.name
        self.address = region.mapping.address + offset
        self.nbytes = nbytes
        self.device = region.mapping.device
        self.host = region.mapping.host


def check_aligned(offset: int, dtype: np.dtype, what: str) -> None:
    """A tensor in device memory starts on a whole element (regions start on ALLOCATION_ALIGNMENT): the kernel's
    loads of a misaligned element fault, and that error would end every request on the device."""
    if offset % dtype.itemsize:
        raise invalid(f"{what}: offset {offset} in a CUDA shared-memory region is not a multiple of {dtype.itemsize} "
                      f"bytes, the size of one element")


class NotMappedHere(Exception):
    """A region registered through another replica and not mapped in this process yet, from a ``lease`` that was
    not to open it (``open_here=False``: on an event loop, which must not wait for an open)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def remapped_too_often(self) -> ServingError:
        """The answer once a request has mapped the region MAP_ROUNDS times and it is still not mapped here."""
        return ServingError(Status.UNAVAILABLE, f"CUDA shared-memory region {self.name!r} was registered again while "
                                                f"this server mapped it; retry")


class CudaSharedMemoryRegistry:
    """The registered CUDA regions of this process (with ``shared_dir``: of every replica; see the module's text).

    ``devices``: the device layer that opens and closes handles; ``system``: the system shared-memory registry,
    whose names this one's must not take (and which asks ``holds`` the other way round).
    """

    def __init__(self, devices: DeviceMemory, max_regions: int = 64, system: SharedMemoryRegistry | None = None,
                 shared_dir: str | None = None) -> None:
        self.devices = devices
        self.max_regions = max_regions
        self.system = system
        self._shared = shared_dir
        self._regions: dict[str, CudaRegion] = {}
        # shared records' identities (inode, mtime, size) when read, and when they were stat-ed then (shm.settled)
        self._seen: dict[str, tuple[tuple[int, int, int], int]] = {}
        self._pending: set[str] = set()  # names whose handle is being opened
        self._draining: list[CudaRegion] = []  # unregistered, still leased
        self._lock = threading.Lock()
        self._opener: concurrent.futures.ThreadPoolExecutor | None = None  # where registrations open handles
        # Leases' ends, from wherever their last reference went (a finalizer may run inside one of this registry's
        # own locked calls: the lock is not reentrant), accounted whenever the lock is free.
        self._releases: leases.Releases[CudaRegion] = leases.Releases(self._lock, self._ended, self._close_drained)

    # --- registration ---------------------------------------------------------------------------

    async def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Register the device memory ``raw_handle`` names (a cudaIpcMemHandle_t's 64 raw bytes, exported by
        another process) as region ``name`` of ``byte_size`` bytes, opened on device ``device_id`` of this server.

        INVALID_ARGUMENT for a bad name, handle length, size or device, for a handle that does not open and for a
        ``byte_size`` beyond the allocation; ALREADY_EXISTS for a name taken by either kind of region;
        RESOURCE_EXHAUSTED past ``max_regions``."""
        self.check_new(name, raw_handle, device_id, byte_size)
        with self._locked():
            self._sync_all()
            if name in self._regions or name in self._pending:
                raise ServingError(Status.ALREADY_EXISTS, f"region {name!r} is already registered")
            # Regions unregistered but still read by a request keep their mapping: they count until it closes.
            taken = len(self._regions) + len(self._pending) + len(self._draining)
            if taken >= self.max_regions:
                raise exhausted(f"{taken} CUDA shared-memory regions are registered, the limit "
                                f"(--max-cuda-shm-regions)")
            self._pending.add(name)
        try:
            mapping = await self._open(name, bytes(raw_handle), device_id, byte_size)
            try:
                if mapping.address % ALLOCATION_ALIGNMENT:
                    raise invalid(f"region {name!r}: raw_handle maps an address {mapping.address - mapping.base} "
                                  f"bytes into a device allocation, not the start of one (not a handle "
                                  f"cudaIpcGetMemHandle gives)")
                if byte_size > mapping.size:
                    raise invalid(f"region {name!r}: byte_size {byte_size} exceeds the {mapping.size} bytes of the "
                                  f"device allocation that raw_handle maps")
                region = CudaRegion(name, bytes(raw_handle), device_id, byte_size, mapping, secrets.token_hex(8))
                with self._locked():
                    if self._shared is not None:
                        self._write_record(region)
                    self._regions[name] = region
            except BaseException:
                await asyncio.to_thread(self._close, name, mapping)
                raise
        finally:
            with self._locked():
                self._pending.discard(name)

    def check_new(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """What a registration can be refused for before its handle is opened (``register``'s errors but the
        handle's, the extent's and the limit's)."""
        if not _NAME.fullmatch(name):
            raise invalid(f"region name {shown(name)!r} must be 1-128 letters, digits, '_', '-' or '.'")
        if len(raw_handle) != HANDLE_BYTES:
            raise invalid(f"region {name!r}: raw_handle is {len(raw_handle)} bytes; a CUDA IPC handle "
                          f"(cudaIpcGetMemHandle) is {HANDLE_BYTES} raw bytes (not base64)")
        if byte_size <= 0:
            raise invalid(f"region {name!r}: byte_size {byte_size} must be > 0")
        count = self.devices.device_count()
        if not 0 <= device_id < count:
            raise invalid(f"region {name!r}: device_id {device_id} is not a device of this server "
                          f"(it sees {count} CUDA device{'s' if count != 1 else ''}: 0..{count - 1})")
        # The other kind first, outside this registry's lock (the system registry asks ``holds`` under its own);
        # both run on the event loop's thread, so nothing registers in between.
        if self._system_holds(name):
            raise ServingError(Status.ALREADY_EXISTS, f"region {name!r} is already registered (as system shared "
                                                      f"memory)")

    def _system_holds(self, name: str) -> bool:
        if self.system is None:
            return False
        try:
            self.system.status(name)
        except ServingError:
            return False
        return True

    async def _open(self, name: str, handle: bytes, device_id: int, nbytes: int) -> Mapping:
        """The handle opened off the event loop; a registration cancelled meanwhile closes what the open returns."""
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(self._opening_thread(), self.devices.open, handle, device_id, nbytes)
        try:
            return await asyncio.shield(opening)
        except DeviceMemoryError as exc:
            cuda = f" ({exc.cuda_error})" if exc.cuda_error else ""
            raise invalid(f"region {name!r}: raw_handle does not open on device {device_id}: {exc.reason}"
                          f"{cuda}") from None
        except asyncio.CancelledError:
            def close_late(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    loop.run_in_executor(None, self._close, name, done.result())

            opening.add_done_callback(close_late)
            raise

    def _opening_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """A thread of the registry's own for opening handles: opens wait on the handle's check, one at a time
        (ipccheck.py), and a burst of them must not take the default executor's threads from the loop's other work."""
        with self._lock:
            if self._opener is None:
                self._opener = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cuda-shm-open")
            return self._opener

    def holds(self, name: str) -> bool:
        """Whether ``name`` is a CUDA region (registered or being registered): the system registry's check."""
        with self._locked():
            return name in self._pending or self._sync(name) is not None

    # --- use --------------------------------------------------------------------------------------

    def lease(self, name: str, offset: int, byte_size: int, what: str, open_here: bool = True) -> Lease:
        """``byte_size`` bytes at ``offset`` of region ``name``, mapped until the lease is released. NOT_FOUND for
        an unknown name; INVALID_ARGUMENT unless the bytes lie inside the region (exact integers: no overflow);
        in a replica that did not register the region, its handle is opened here first (a blocking CUDA call:
        call this off the event loop), or, with ``open_here`` false, NotMappedHere is raised instead."""
        with self._locked():
            region = self._slice(name, offset, byte_size, what)
            if region.mapping is not None:
                region.in_use += 1
                return Lease(self, region, offset, byte_size)
            if not open_here and not region.unusable:
                raise NotMappedHere(name)
        # Not mapped in this process yet: opened outside the registry's lock (other regions' requests go on), by one
        # caller per region.
        with region.opening:
            mapping = self._open_here(region, what) if region.mapping is None else None
            with self._locked():
                if self._regions.get(name) is region:
                    if mapping is not None:
                        region.mapping = mapping
                    region.in_use += 1
                    return Lease(self, region, offset, byte_size)
        if mapping is not None:  # unregistered while it opened
            self._close(name, mapping)
        raise not_found(f"{what}: CUDA shared-memory region {shown(name)!r} is not registered")

    async def map_here(self, name: str, what: str) -> None:
        """Map region ``name`` in this process now, if it is not yet, on the registry's opening thread (a burst of
        first uses waits there, not in the loop's executor); errors as ``lease``'s."""
        await asyncio.get_running_loop().run_in_executor(self._opening_thread(),
                                                          lambda: self.lease(name, 0, 0, what).release())

    def _slice(self, name: str, offset: int, byte_size: int, what: str) -> CudaRegion:
        """Region ``name`` once ``byte_size`` bytes at ``offset`` lie inside it (under the lock)."""
        region = self._sync(name)
        if region is None:
            raise not_found(f"{what}: CUDA shared-memory region {shown(name)!r} is not registered")
        if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
            raise invalid(f"{what}: offset {offset} + byte_size {byte_size} is outside CUDA shared-memory "
                          f"region {name!r} ({region.byte_size} bytes)")
        return region

    def read(self, name: str, offset: int, shape: tuple[int, ...], dtype: np.dtype, what: str,
             open_here: bool = True) -> tuple[np.ndarray | DeviceArray | RegionTensor, Lease | None]:
        """The tensor of ``shape`` and ``dtype`` at ``offset`` of region ``name``, where it lies (no copy): a
        DeviceArray, or a numpy view for host memory; and its lease. The tensor holds the lease: the mapping stays
        open while the tensor, or an execution reading it, is alive, or until the lease is released (once
        nothing reads the tensor any more). Errors as ``lease``'s."""
        nbytes = math.prod(shape) * dtype.itemsize  # exact: Python integers
        check_aligned(offset, dtype, what)
        lease = self.lease(name, offset, nbytes, what, open_here)
        if lease.host:
            return host_view(lease.address, shape, dtype, lease), lease
        return DeviceArray(lease.address, shape, dtype, lease.device, lease), lease

    def attach_result(self, array: DeviceArray | np.ndarray, name: str, offset: int, cout: int,
                      what: str, open_here: bool = True) -> Lease | None:
        """Make the (N, ``cout``) FP32 span at ``offset`` of region ``name`` the ``result`` of the input ``array`` (its
        execution writes the output there, on the device) and return the span's lease, where both lie in device
        memory on one device; None otherwise, nothing held (the output is then written after the execution, from
        the host). The span is checked either way; errors as ``read``'s (a span not on a whole float among them)."""
        target, lease = self.read(name, offset, (array.shape[0], cout), np.dtype("<f4"), what, open_here)
        if isinstance(array, DeviceArray) and isinstance(target, DeviceArray) and target.device == array.device:
            array.result = target
            return lease
        if lease is not None:
            lease.release()
        return None

    def write(self, name: str, offset: int, data: bytes, what: str, open_here: bool = True) -> None:
        """Copy ``data`` to ``offset`` of region ``name`` (an output), complete when this returns. Errors as
        ``lease``'s; a copy the device refuses is INTERNAL, naming CUDA's error."""
        lease = self.lease(name, offset, len(data), what, open_here)
        try:
            self.devices.write(lease.address, data, lease.device)
        except DeviceMemoryError as exc:
            log.error("writing %d bytes into CUDA shared-memory region %r failed: %s", len(data), name, exc)
            raise ServingError(Status.INTERNAL, f"{what}: the output could not be written into CUDA shared-memory "
                                                f"region {shown(name)!r} ({exc.cuda_error or exc.reason})") from None
        finally:
            lease.release()

    async def store(self, name: str, offset: int, data: bytes, what: str) -> None:
        """``write``, for the inference path (a front end's registry sends it to the engine instead); when the region
        is yet to be opened in this process (a blocking open, and the handle's check), on the thread that opens
        handles: off the event loop, and the outputs of many requests waiting for one open hold one thread, not
        the default executor's (which reads shared-memory segments)."""
        try:
            self.write(name, offset, data, what, open_here=False)
        except NotMappedHere:
            await asyncio.get_running_loop().run_in_executor(self._opening_thread(), self.write, name, offset, data,
                                                             what)

    def _open_here(self, region: CudaRegion, what: str) -> Mapping:
        """Open a region registered by another replica (under the region's ``opening`` lock: one open per region and
        process). A handle that does not open (or maps other memory now) is remembered: later requests are refused
        at once, without opening and checking it again, until the region is registered again."""
        if region.unusable:
            raise invalid(f"{what}: {region.unusable}")
        try:
            mapping = self.devices.open(region.handle, region.device_id, region.byte_size)
        except DeviceMemoryError as exc:
            region.unusable = (f"CUDA shared-memory region {region.name!r} does not open in this server process any "
                               f"more: {exc.reason}; register it again")
            raise invalid(f"{what}: {region.unusable}") from None
        # Checked at registration, in another process: the memory changed.
        if mapping.address % ALLOCATION_ALIGNMENT or region.byte_size > mapping.size:
            self._close(region.name, mapping)
            region.unusable = (f"CUDA shared-memory region {region.name!r} now maps {mapping.size} bytes at "
                               f"{mapping.address - mapping.base} bytes into an allocation, not the "
                               f"{region.byte_size} bytes at its start it was registered with; register it again")
            raise invalid(f"{what}: {region.unusable}")
        return mapping

    def _locked(self):
        """The registry's lock; on the way out, the leases released meanwhile are accounted."""
        return self._releases.locked()

    def _ended(self, region: CudaRegion) -> CudaRegion | None:
        """One lease of ``region`` ended (under the lock): the region to unmap now, if that was its last and it is
        unregistered."""
        region.in_use -= 1
        if region.unregistered and region.in_use == 0 and region in self._draining:
            self._draining.remove(region)  # (not there once close() has closed everything)
            return region
        return None

    def _close_drained(self, region: CudaRegion) -> None:
        if region.mapping is not None:
            self._close(region.name, region.mapping)

    # --- unregistration and status ----------------------------------------------------------------

    async def unregister(self, name: str) -> None:
        """Unregister region ``name``, or every CUDA region when ``name`` is empty. The name is free at once; each
        mapping is closed now (off the event loop), or when its last lease is released."""
        with self._locked():
            if name and self._sync(name) is None:
                raise not_found(f"CUDA shared-memory region {shown(name)!r} is not registered")
            if not name:
                self._sync_all()
            closing = []
            for key in [name] if name else list(self._regions):
                region = self._forget(key)
                if self._shared is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._record_path(key))
                if region is not None:
                    closing.append(region)
        if closing:
            await asyncio.to_thread(self._close_all, closing)

    def _forget(self, name: str) -> CudaRegion | None:
        """Drop ``name`` from this process's regions (under the lock): the region to close now, or None when there
        is nothing to close now (never opened here, or leased: its last lease closes it)."""
        region = self._regions.pop(name)
        region.unregistered = True
        if region.mapping is None:
            return None
        if region.in_use > 0:
            self._draining.append(region)
            return None
        return region

    def status(self, name: str) -> list[CudaRegion]:
        """Region ``name``, or every CUDA region when name is empty (the caller shows name, device_id and
        byte_size: never the handle)."""
        with self._locked():
            if name:
                region = self._sync(name)
                if region is None:
                    raise not_found(f"CUDA shared-memory region {shown(name)!r} is not registered")
                return [region]
            self._sync_all()
            return list(self._regions.values())

    @property
    def draining(self) -> int:
        """Unregistered regions whose mapping waits for its last lease."""
        with self._locked():
            return len(self._draining)

    def close(self) -> None:
        """Close every mapping of this process, leased or not (the server is stopping: its executions are over);
        the shared records stay, other replicas may still serve them."""
        with self._locked():
            regions = [*self._regions.values(), *self._draining]
            self._regions.clear()
            self._draining.clear()
            if self._opener is not None:
                self._opener.shutdown(wait=False)
                self._opener = None
        self._close_all([r for r in regions if r.mapping is not None])

    def _close_all(self, regions: list[CudaRegion]) -> None:
        for region in regions:
            assert region.mapping is not None
            self._close(region.name, region.mapping)

    def _close(self, name: str, mapping: Mapping) -> None:
        """Close a mapping; a failure is logged (the client has nothing to do about it), never raised."""
        try:
            self.devices.close(mapping)
        except DeviceMemoryError as exc:
            log.warning("CUDA shared-memory region %r: closing its mapping failed: %s (%s)", name, exc.reason,
                        exc.cuda_error or "no CUDA error")
        except Exception:  # also reached from a lease's finalizer, where nothing may escape
            log.exception("CUDA shared-memory region %r: closing its mapping failed", name)

    # --- the shared registry (replicas) ---------------------------------------------------------

    def _record_path(self, name: str) -> str:
        assert self._shared is not None
        return os.path.join(self._shared, "r-" + name)  # shm.py's files: one namespace for both kinds

    def _write_record(self, region: CudaRegion) -> None:
        try:
            fd = os.open(self._record_path(region.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise ServingError(Status.ALREADY_EXISTS, f"region {region.name!r} is already registered") from None
        with os.fdopen(fd, "w") as f:
            json.dump({"kind": KIND, "handle": base64.b64encode(region.handle).decode(),
                       "device_id": region.device_id, "byte_size": region.byte_size, "token": region.token}, f)

    def _read_record(self, name: str) -> tuple[bytes, int, int, str] | str | None:
        """A CUDA record's (handle, device_id, byte_size, token); FOREIGN for a system region's; None when there is
        none (or it cannot be read whole now)."""
        try:
            with open(self._record_path(name)) as f:
                data = json.load(f)
            if not isinstance(data, dict):
                return None
            if data.get("kind") != KIND:
                return FOREIGN
            handle = base64.b64decode(data["handle"], validate=True)
            fields = int(data["device_id"]), int(data["byte_size"]), str(data["token"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, being written or removed right now: treat as absent
        if len(handle) != HANDLE_BYTES:
            return None
        return handle, *fields

    def _sync(self, name: str) -> CudaRegion | None:
        """This process's view of region ``name`` brought in line with the shared record (no-op unshared)."""
        region = self._regions.get(name)
        if self._shared is None:
            return region
        # A record is written once, at its creation: a file whose identity is the one last read here, once settled,
        # says nothing new (one stat instead of a read and a parse on every request; as shm.py does).
        stat_ns = time.time_ns()
        try:
            info = os.stat(self._record_path(name))
            identity: tuple[int, int, int] | None = (info.st_ino, info.st_mtime_ns, info.st_size)
        except FileNotFoundError:
            identity = None
        seen = self._seen.get(name)
        unchanged = seen is not None and identity is not None and seen[0] == identity
        if seen is not None and unchanged and settled(seen[0][1], seen[1]):
            return region
        got = self._read_record(name) if identity is not None else None
        if got is None and unchanged:
            return region  # as last read (it cannot be read again now)
        self._seen.pop(name, None)
        if got is not None and identity is not None:  # read whole: a CUDA region's record, or another kind's
            self._seen[name] = (identity, stat_ns)
        record = got if isinstance(got, tuple) else None
        if region is not None and (record is None or record[3] != region.token):
            dropped = self._forget(name)  # unregistered (and maybe registered again) through another replica
            if dropped is not None and dropped.mapping is not None:
                self._close(name, dropped.mapping)
            region = None
        if region is None and record is not None:
            handle, device_id, byte_size, token = record
            region = CudaRegion(name, handle, device_id, byte_size, None, token)
            self._regions[name] = region
        return region

    def _sync_all(self) -> None:
        sync_all(self._shared, self._regions, self._sync)
