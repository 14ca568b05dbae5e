"""A front end's runner (``--frontends``): the Runner's interface, served by engine processes.

``RemoteRunner.run`` puts a request's tensor in this process's staging arena (unless a shared-memory read
already put it there), sends the engine with the fewest requests outstanding a record naming it, and waits
for the reply (ipc.py, engine.py). Batching, deadlines in the queue and executions are the engine's; queue
limits hold per front end here and per engine there. A cancelled request is cancelled in the engine too, and
its arena space stays reserved until the engine has answered, so it is never reused while the engine may
still read it.

A tensor in a client's CUDA shared memory does not pass through the arena: it is a ``RegionTensor`` (region name,
offset), sent to the engine on the region's device, which maps the region (``EngineCudaSharedMemory``, below). Nor,
where the engines page-lock clients' segments (GPU engines: ``reads_segments``), does one in system shared memory:
the engine maps the segment and the GPU DMAs the tensor where it lies.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import math
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from voxserve.datatypes import INPUT_DATATYPES

from ..core.batching import BatchingConfig, BatchResult, QueueFull
from ..core.devicemem import DeviceArray, DeviceMemoryError, Mapping, RegionTensor
from ..core.errors import ServingError, Status, exhausted
from ..protocol.cudashm import CudaSharedMemoryRegistry, check_aligned
from ..protocol.shm import SharedMemoryRegistry
from . import ipc

log = logging.getLogger(__name__)

_CONTROL = object()  # a pending entry's "bytes" for a CONTROL record: its answer is the engine's JSON


@dataclass
class EngineLink:
    path: str
    hello: dict
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pending: dict[int, tuple[asyncio.Future, object]] = field(default_factory=dict)  # id -> (future, its bytes)
    lost: str | None = None
    task: asyncio.Task | None = None
    outbox: ipc.Outbox = field(init=False)

    def __post_init__(self) -> None:
        self.outbox = ipc.Outbox(self.writer)


async def connect_engine(path: str, arena: ipc.Arena, frontend: str, retry_s: float = 0.2) -> EngineLink:
    """Connect to the engine listening on ``path`` (waiting until it listens: it warms up first), hand it
    the arena and read its hello."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            await asyncio.sleep(retry_s)
    try:
        socket.send_fds(sock, [ipc.hello_bytes({"frontend": frontend, "arena_bytes": arena.capacity})], [arena.fd])
        sock.settimeout(30.0)
        hello, _ = await asyncio.to_thread(ipc.read_hello, sock)
        sock.settimeout(None)
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
    except BaseException:
        sock.close()
        raise
    return EngineLink(path, hello, reader, writer)


class RemoteRunner:
    def __init__(self, links: Sequence[EngineLink], arena: ipc.Arena, batching: BatchingConfig,
                 on_device_lost: Callable[[str], object] | None = None) -> None:
        self.links = list(links)
        self.arena = arena
        self.batching = batching
        self.cout = int(self.links[0].hello["cout"])
        self.device_lost: str | None = None
        self._on_device_lost = on_device_lost or (lambda reason: None)
        self._ids = itertools.count(1)
        self.copied_bytes = 0  # tensor bytes copied into the arena, ever (inputs already there are not copied)
        for link in self.links:
            link.task = asyncio.create_task(self._read(link))

    @classmethod
    async def connect(cls, paths: Sequence[str], arena: ipc.Arena, frontend: str, batching: BatchingConfig,
                      on_device_lost: Callable[[str], object] | None = None) -> RemoteRunner:
        links = await asyncio.gather(*(connect_engine(p, arena, frontend) for p in paths))
        return cls(links, arena, batching, on_device_lost)

    @property
    def devices(self) -> list[str]:
        return [d for link in self.links for d in link.hello["device"].split(",")]

    @property
    def kernel(self) -> str:
        return self.links[0].hello["kernel"]

    @property
    def outstanding(self) -> int:
        return sum(len(link.pending) for link in self.links)

    def admit(self) -> None:
        if self.outstanding >= self.batching.max_queue:
            raise QueueFull(f"this front end has {self.outstanding} requests waiting for the engine, its limit "
                            f"(--max-queue-size {self.batching.max_queue})")

    def lost_error(self) -> ServingError:
        return ServingError(Status.UNAVAILABLE, f"the engine(s) on {', '.join(self.devices)} stopped "
                            f"({self.device_lost}); this replica must be restarted, retry on another")

    @property
    def reads_segments(self) -> bool:
        """Whether the engines read clients' system shared-memory segments themselves, page-locked in place (GPU
        engines): then inputs there go to them by region, not through the arena."""
        return all(bool(link.hello.get("system_shm_in_place")) for link in self.links)

    @property
    def cuda_devices(self) -> int:
        """The CUDA devices the engines can open clients' memory on (0: they offer no CUDA shared memory)."""
        return min(int(link.hello.get("cuda_devices", 0)) for link in self.links)

    def _live(self) -> list[EngineLink]:
        live = [link for link in self.links if link.lost is None]
        if not live:
            raise self.lost_error()
        return live

    def _least_busy(self, links: Sequence[EngineLink] | None = None) -> EngineLink:
        """The live engine (of ``links``, when given) with the fewest requests outstanding."""
        candidates = self._live() if links is None else links
        if not candidates:
            raise self.lost_error()
        return min(candidates, key=lambda lk: len(lk.pending))

    def engines_on(self, device_id: int) -> list[EngineLink]:
        """The live engines that execute on CUDA device ``device_id`` (any of them can map a region there)."""
        place = f"cuda:{device_id}"
        return [lk for lk in self._live() if place in lk.hello["device"].split(",")]

    def engine_for(self, device_id: int) -> EngineLink:
        """The engine that registers, unregisters and writes a region on CUDA device ``device_id``: the first that
        executes there, else the first live one (always the same, so that a region on a device no engine runs on
        is opened once, where it was registered)."""
        on_device = self.engines_on(device_id)
        return on_device[0] if on_device else self._live()[0]

    async def run(self, arr: np.ndarray | DeviceArray | RegionTensor, datatype: str,
                  timeout_s: float | None = None) -> BatchResult:
        """Infer one request's (N, Cin, D, H, W) wire-typed array in an engine: from the arena, or where it lies in
        a client's region (a RegionTensor: a CUDA region's goes to the least busy engine on its device, which maps
        it there on its first use, or, where none executes on that device, to the one that registered it; a system
        segment's to the least busy engine, which reads it there)."""
        if isinstance(arr, RegionTensor):
            if arr.kind == "cuda":
                on_device = self.engines_on(arr.device_id)
                link = self._least_busy(on_device) if on_device else self.engine_for(arr.device_id)
            else:
                link = self._least_busy()
            return await self._send(link, ipc.INFER_REGION, datatype, arr.offset, arr.nbytes, arr.shape, timeout_s,
                                    arr, ipc.region_trailer(arr.kind, arr.region, arr.result))
        if not isinstance(arr, np.ndarray):
            raise ServingError(Status.INTERNAL, f"a front end cannot send a {type(arr).__name__} to its engines")
        link = self._least_busy()
        if arr.nbytes <= self.arena.largest or self.arena.offset_of(arr) is not None:
            return await self._one(link, arr, datatype, timeout_s)
        # Larger than an arena block: in pieces of whole samples (the engine batches and splits them anyway).
        sample_bytes = arr.nbytes // arr.shape[0]
        per = self.arena.largest // sample_bytes
        if per == 0:
            raise exhausted(f"one sample of {list(arr.shape[1:])} {datatype} is {sample_bytes} bytes, more than "
                            f"a front end's staging block ({self.arena.largest} bytes: half of "
                            f"--frontend-arena-bytes {self.arena.capacity})")
        parts = await asyncio.gather(*(self._one(link, arr[i : i + per], datatype, timeout_s)
                                       for i in range(0, arr.shape[0], per)))
        return BatchResult(np.concatenate([p.output for p in parts]), max(p.queue_ns for p in parts),
                           max(p.batch_samples for p in parts))

    async def _one(self, link: EngineLink, arr: np.ndarray, datatype: str, timeout_s: float | None) -> BatchResult:
        offset = self.arena.offset_of(arr)
        keep: object = arr
        if offset is None:  # the one copy of a wire tensor in a front end: into the arena
            offset, keep = await self.arena.allocate(arr.nbytes)
            if arr.flags.c_contiguous:  # (a wire tensor always is) one buffer copy, no numpy temporaries
                keep[:] = arr.data.cast("B")
            else:
                np.frombuffer(keep, np.uint8)[:] = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            self.copied_bytes += arr.nbytes
        sending = self._send(link, ipc.INFER, datatype, offset, arr.nbytes, arr.shape, timeout_s, keep)
        del keep, arr  # an error's traceback keeps this frame: only the pending entry may hold the bytes
        return await sending

    async def _send(self, link: EngineLink, kind: int, datatype: str, offset: int, nbytes: int,
                    shape: tuple[int, ...], timeout_s: float | None, keep: object, trailer: bytes = b"") -> BatchResult:
        """One inference record to ``link`` and its answer; ``keep`` (the request's bytes) stays reserved until
        the engine's reply."""
        fields = (INPUT_DATATYPES.index(datatype), len(trailer))
        tail = (offset, nbytes, ipc.deadline_of(timeout_s), *shape)
        asking = self._ask(link, keep, lambda req_id: ipc.REQUEST.pack(kind, *fields, req_id, *tail) + trailer)
        del keep  # (as in _one: only the pending entry may hold the bytes)
        return await asking

    async def control(self, link: EngineLink, operation: dict, data: bytes = b"") -> dict:
        """An operation on the CUDA regions, done by the engine ``link`` (engine.py ``_control``): its answer, or
        the engine's ServingError."""
        trailer = ipc.control_payload(operation, data)
        answer = await self._ask(link, _CONTROL, lambda req_id: ipc.REQUEST.pack(
            ipc.CONTROL, 0, len(trailer), req_id, 0, 0, float("nan"), 0, 0, 0, 0, 0) + trailer)
        return json.loads(answer) if answer else {}

    async def _ask(self, link: EngineLink, keep: object, record: Callable[[int], bytes]):
        """Send ``record(request id)`` to ``link`` and wait for its reply; ``keep`` is the pending entry's (what
        stays reserved until the reply). A cancelled wait tells the engine."""
        if link.lost is not None:
            raise self.lost_error()
        req_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        link.pending[req_id] = (future, keep)
        del keep
        link.outbox.put(record(req_id))
        try:
            return await future
        except asyncio.CancelledError:
            if link.lost is None:
                link.outbox.put(ipc.REQUEST.pack(ipc.CANCEL, 0, 0, req_id, 0, 0, float("nan"), 0, 0, 0, 0, 0))
            raise

    async def _read(self, link: EngineLink) -> None:
        reader = link.reader
        reason = "it closed the connection"
        buffer = bytearray()
        try:
            while data := await reader.read(1 << 16):  # every whole reply of a read at once
                buffer += data
                replies, used = ipc.replies(buffer)
                del buffer[:used]
                for header, payload in replies:
                    self._deliver(link, header, payload)
        except ConnectionError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            reason = "this front end is closing"
            raise
        finally:
            link.lost = reason
            error = ServingError(Status.UNAVAILABLE, f"the engine on {link.hello['device']} stopped "
                                 f"({reason}); retry")
            for future, _ in link.pending.values():
                if not future.done():
                    future.set_exception(error)
            link.pending.clear()
            if all(lk.lost is not None for lk in self.links) and self.device_lost is None:
                self.device_lost = f"engine connection lost: {reason}"
                if reason != "this front end is closing":
                    log.error("every engine is gone (%s): not ready any more", reason)
                    self._on_device_lost(self.device_lost)

    def _deliver(self, link: EngineLink, header: tuple, payload: bytes) -> None:
        """Answer the request of one reply (a function of its own, so that nothing here outlives the reply: the
        pending entry holds the request's arena space)."""
        kind, code, _length, req_id, queue_ns, batch_samples = header
        future, keep = link.pending.pop(req_id, (None, None))
        if future is None or future.done():
            return  # cancelled here meanwhile
        if kind == ipc.OK and keep is _CONTROL:
            future.set_result(payload)
        elif kind == ipc.OK:
            future.set_result(BatchResult(np.frombuffer(payload, np.float32).reshape(-1, self.cout), queue_ns,
                                          batch_samples))
        else:
            future.set_exception(ServingError(Status.of(code), payload.decode(errors="replace")))

    async def close(self) -> None:
        for link in self.links:
            link.writer.close()
            if link.task is not None:
                link.task.cancel()
        await asyncio.gather(*(link.task for link in self.links if link.task is not None), return_exceptions=True)
        self.arena.close()


class _EngineDevices:
    """The device layer of a front end's CUDA registry: the engines' device count; nothing is opened here."""

    def __init__(self, count: int) -> None:
        self.count = count

    def device_count(self) -> int:
        return self.count

    def open(self, handle: bytes, device: int, nbytes: int | None = None) -> Mapping:
        raise DeviceMemoryError("a front end opens no CUDA memory: its engines do")

    def close(self, mapping: Mapping) -> None:
        raise DeviceMemoryError("a front end holds no CUDA mapping")

    def write(self, address: int, data: bytes, device: int) -> None:
        raise DeviceMemoryError("a front end writes no CUDA memory: its engines do")


class EngineCudaSharedMemory(CudaSharedMemoryRegistry):
    """CUDA shared memory through the engines of ``--frontends``: the engines open the handles, read the inputs
    where they lie and write the outputs (engine.py ``_control``); the regions' records, shared by every front end
    and engine in ``shared_dir``, are read here for names, bounds and status. A registration goes to the engine
    of the device it names, which checks it as a server in one process does (handle, extent, limit, one namespace
    with system regions through the exclusive record); a request's tensor goes to the same engine by name."""

    def __init__(self, runner: RemoteRunner, max_regions: int, system: SharedMemoryRegistry | None,
                 shared_dir: str) -> None:
        super().__init__(_EngineDevices(runner.cuda_devices), max_regions, system, shared_dir)
        self.runner = runner

    async def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.check_new(name, raw_handle, device_id, byte_size)
        await self.runner.control(self.runner.engine_for(device_id), {
            "op": "register", "name": name, "handle": base64.b64encode(bytes(raw_handle)).decode(),
            "device_id": device_id, "byte_size": byte_size})

    async def unregister(self, name: str) -> None:
        """One region: by the engine that maps it, then the others drop any mapping of theirs; every region: by
        each engine."""
        links = self.runner._live()
        if not name:
            for link in links:
                await self.runner.control(link, {"op": "unregister", "name": ""})
            return
        (region,) = self.status(name)  # NOT_FOUND first
        owner = self.runner.engine_for(region.device_id)
        await self.runner.control(owner, {"op": "unregister", "name": name})
        for link in links:
            if link is not owner:
                await self.runner.control(link, {"op": "forget", "name": name})

    def read(self, name: str, offset: int, shape: tuple[int, ...], dtype: np.dtype, what: str,
             open_here: bool = True) -> tuple[RegionTensor, None]:
        """The tensor by region and offset, once it lies inside the region (the engine checks again when it reads
        it: the region may change meanwhile); no lease here (the engine's read holds one)."""
        check_aligned(offset, dtype, what)
        with self._locked():
            region = self._slice(name, offset, math.prod(shape) * dtype.itemsize, what)
        return RegionTensor(name, offset, tuple(shape), dtype, region.device_id), None

    async def store(self, name: str, offset: int, data: bytes, what: str) -> None:
        with self._locked():
            region = self._slice(name, offset, len(data), what)
        await self.runner.control(self.runner.engine_for(region.device_id),
                                  {"op": "write", "name": name, "offset": offset, "what": what}, data)

    def write(self, name: str, offset: int, data: bytes, what: str, open_here: bool = True) -> None:
        raise ServingError(Status.INTERNAL, f"{what}: a front end writes CUDA memory through its engine (store)")
