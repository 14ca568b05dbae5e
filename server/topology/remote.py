"""A front end's runner (``--frontends``): the Runner's interface, served by engine processes.

``RemoteRunner.run`` puts a request's tensor in this process's staging arena (unless a shared-memory read
already put it there), sends the engine with the fewest requests outstanding a record naming it, and waits
for the reply (ipc.py, engine.py). Batching, deadlines in the queue and executions are the engine's; queue
limits hold per front end here and per engine there. A cancelled request is cancelled in the engine too, and
its arena space stays reserved until the engine has answered, so it is never reused while the engine may
still read it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from voxserve.datatypes import INPUT_DATATYPES

from ..core.batching import BatchingConfig, BatchResult, QueueFull
from ..core.devicemem import DeviceArray
from ..core.errors import ServingError, Status, exhausted
from . import ipc

log = logging.getLogger(__name__)


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

    async def run(self, arr: np.ndarray | DeviceArray, datatype: str, timeout_s: float | None = None) -> BatchResult:
        """Infer one request's (N, Cin, D, H, W) wire-typed array in an engine (a front end offers no CUDA shared
        memory: its engines hold no mappings)."""
        if not isinstance(arr, np.ndarray):
            raise ServingError(Status.UNIMPLEMENTED, "CUDA shared memory is not offered through front ends")
        live = [link for link in self.links if link.lost is None]
        if not live:
            raise self.lost_error()
        link = min(live, key=lambda lk: len(lk.pending))
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
            np.frombuffer(keep, np.uint8)[:] = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            self.copied_bytes += arr.nbytes
        if link.lost is not None:
            raise self.lost_error()
        req_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        link.pending[req_id] = (future, keep)  # keeps the bytes reserved until the engine's reply
        link.outbox.put(ipc.REQUEST.pack(ipc.INFER, INPUT_DATATYPES.index(datatype), req_id, offset, arr.nbytes,
                                         ipc.deadline_of(timeout_s), *arr.shape))
        try:
            return await future
        except asyncio.CancelledError:
            if link.lost is None:
                link.outbox.put(ipc.REQUEST.pack(ipc.CANCEL, 0, req_id, 0, 0, float("nan"), 0, 0, 0, 0, 0))
            raise
        finally:
            del keep, arr  # an error's traceback keeps this frame: only the pending entry may hold the bytes

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
        future, _ = link.pending.pop(req_id, (None, None))
        if future is None or future.done():
            return  # cancelled here meanwhile
        if kind == ipc.OK:
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
