"""The engine of ``--frontends``: the model and its runner in a process of their own, fed by gRPC front ends.

One Python process terminating gRPC spends most of its interpreter lock on each RPC (gRPC's aio machinery,
protobuf, asyncio; bench/results/service-h100-80gb-hbm3.md), so small requests reach the batcher no
faster than one core can take them. With ``--frontends N`` the supervisor (server/topology/supervisor.py) starts N
front ends that terminate RPCs on the shared port, and one engine per GPU that does nothing but batch and
execute. A front end decodes a request, places its tensor in its staging arena and sends the engine a
record (server/topology/ipc.py); the engine batches the requests of every front end together, exactly as the
in-process server batches its own, and answers each with its output rows. Per request the engine spends
a record read, a view and a reply, so the batcher sees requests at the rate N processes can terminate them.

Start-up: the engine loads the weights, builds and warms up its models, and only then listens on its
socket, so a front end that connects finds a ready engine. Shutdown: on SIGTERM the engine keeps serving
until every front end has drained and hung up (or the grace period plus a margin has passed).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import mmap
import os
import signal
import socket

import numpy as np

from voxserve.datatypes import INPUT_DATATYPES, ITEMSIZE, WIRE_DTYPE

from .. import eventloop, logs
from ..core import pipeline
from ..core.batching import BatchingConfig, BatchResult
from ..core.devicemem import CudaDeviceMemory, DeviceArray, DeviceMemory, RegionTensor
from ..core.errors import ServingError, Status, internal, runner_error
from ..core.heap import freeze_startup_objects
from ..core.hostmem import PageLocker
from ..core.inprocess import build_models, load_weights
from ..core.runner import Runner
from ..core.stats import ModelStats
from ..metrics import Metrics, latency_buckets
from ..protocol.cudashm import MAP_ROUNDS, CudaSharedMemoryRegistry, Lease, NotMappedHere
from ..protocol.shm import SharedMemoryRegistry
from ..settings import Settings
from . import ipc

log = logging.getLogger("voxserve.engine")

# How long after the front ends' grace period the engine waits for them to hang up before it exits anyway.
DRAIN_MARGIN_S = 5.0


class Engine:
    def __init__(self, settings: Settings, socket_path: str, index: int = 0,
                 stats_dir: str | None = None, regions_dir: str | None = None,
                 device_memory: DeviceMemory | None = None, page_locker: PageLocker | None = None) -> None:
        self.settings = settings
        self.socket_path = socket_path
        self.index = index
        self.metrics = Metrics(settings.model_name, latency_buckets(settings.latency_buckets_s), gpu_metrics=False)
        self.stats = ModelStats()
        if stats_dir:
            self.stats.share(stats_dir, f"engine-{index}")
        self.runner: Runner | None = None
        self.hello: dict = {}
        self._connections: set[asyncio.Task] = set()
        self._lost: str | None = None
        self._pinned: list[np.ndarray] = []  # page-locked arenas
        self.regions_dir = regions_dir  # the supervisor's shared registry of regions (system and CUDA)
        self.cuda_shm: CudaSharedMemoryRegistry | None = None  # the clients' CUDA regions, mapped here
        self._mapping: dict[str, asyncio.Future] = {}  # CUDA regions being mapped here for a first request
        self._device_memory = device_memory  # their device layer instead of the CUDA devices' (tests give a fake)
        self._page_locker = page_locker  # the system segments' instead of CUDA's (tests give a fake)
        # The clients' system shared-memory segments, read here in place (a GPU engine) for the front ends.
        self.shm: SharedMemoryRegistry | None = None
        self._controls: set[asyncio.Task] = set()

    def load(self) -> None:
        """Weights, models, warm-up (blocking; before anything listens)."""
        s = self.settings
        self._models = build_models(s, load_weights(s, self.metrics), self.metrics)
        model = self._models[0]
        devices = ",".join(str(m.device) for m in self._models)
        memory = self._device_memory
        if memory is None and any(m.device.type == "cuda" for m in self._models):
            from voxserve.kernels import cuda as cuda_kernels

            if cuda_kernels.load_problem() is None:  # the kernel library opens the handles
                memory = CudaDeviceMemory()
        if memory is not None and self.regions_dir is not None:
            # The regions' records are shared with the front ends (names, bounds, one namespace with system
            # regions); the mappings are this process's.
            self.cuda_shm = CudaSharedMemoryRegistry(memory, s.max_cuda_shm_regions, shared_dir=self.regions_dir)
        locker = self._page_locker
        if locker is None and self.regions_dir is not None and all(m.pipeline is not None for m in self._models):
            from ..core.hostmem import CudaPageLocker

            try:
                locker = CudaPageLocker()
            except OSError as exc:
                log.warning("engine %d: the front ends copy shared-memory inputs: %s", self.index, exc)
        if locker is not None and self.regions_dir is not None:
            # DMA'd from the client's segment, page-locked where it lies (protocol/shm.py); where that is refused,
            # copied into pinned memory first (here, off the event loop).
            self.shm = SharedMemoryRegistry(s.max_shm_regions, s.max_shm_bytes, self.regions_dir, locker)
            if all(m.pipeline is not None for m in self._models):
                from ..core.pipeline import pinned_buffer

                self.shm.allocate = pinned_buffer
        self.hello = {"engine": self.index, "cin": model.cin, "cout": model.cout, "k": model.k,
                      "device": devices, "kernel": model.kernel, "pid": os.getpid(),
                      "cuda_devices": self.cuda_shm.devices.device_count() if self.cuda_shm is not None else 0,
                      "system_shm_in_place": self.shm is not None}
        self.metrics.set_build(devices, model.kernel)

    async def serve(self, stop: asyncio.Event) -> int:
        """Answer front ends until ``stop`` is set and they have hung up; the exit code."""
        s = self.settings
        loop = asyncio.get_running_loop()
        self.runner = Runner(self._models, self.stats, self.metrics, BatchingConfig.from_settings(s),
                             lambda reason: loop.call_soon_threadsafe(self._device_lost, reason, stop),
                             enqueue_on_loop=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        listener.listen(64)
        listener.setblocking(False)
        freeze_startup_objects()
        self.metrics.model_ready.labels(s.model_name).set(1)
        log.info("engine %d ready on %s with %s: %s", self.index, self.hello["device"], self.hello["kernel"],
                 self.socket_path)
        accept = asyncio.create_task(self._accept(listener))
        publish = asyncio.create_task(self.stats.publish_every()) if self.stats.shared else None
        await stop.wait()
        accept.cancel()
        listener.close()
        self.metrics.model_ready.labels(s.model_name).set(0)
        if self._connections:
            log.info("engine %d: waiting for %d front end(s) to drain", self.index, len(self._connections))
            await asyncio.wait(self._connections, timeout=s.grace_period_s + DRAIN_MARGIN_S)
        for task in self._connections:
            task.cancel()
        await self.runner.close()
        if self.cuda_shm is not None:
            self.cuda_shm.close()
        if self.shm is not None:
            self.shm.close()
        if publish is not None:
            publish.cancel()
            self.stats.publish()
        return 0 if self._lost is None else 1

    def _device_lost(self, reason: str, stop: asyncio.Event) -> None:
        # No request can be served here any more: exit, so the supervisor restarts the whole server.
        self._lost = reason
        stop.set()

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            task = asyncio.create_task(self._connection(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _connection(self, conn: socket.socket) -> None:
        """One front end: its hello (with its arena), then its requests until it hangs up."""
        try:
            conn.setblocking(True)
            conn.settimeout(10.0)
            hello, fds = await asyncio.to_thread(ipc.read_hello, conn, 1)
            if len(fds) != 1:
                raise ConnectionError(f"the front end sent {len(fds)} descriptors with its hello, not its arena")
            try:
                size = int(hello["arena_bytes"])
                if os.fstat(fds[0]).st_size < size:  # a mapping past the file's end would fault on access
                    raise ValueError(f"the arena is {os.fstat(fds[0]).st_size} bytes, not the {size} announced")
                arena = mmap.mmap(fds[0], size)
            finally:
                os.close(fds[0])
            conn.settimeout(None)
            conn.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=conn)
        except (OSError, ValueError, KeyError, ConnectionError) as exc:
            log.error("engine %d: a front end's hello failed: %s", self.index, exc)
            conn.close()
            return
        view = np.frombuffer(arena, np.uint8)
        pinned = await asyncio.to_thread(self._pin, view)
        log.info("engine %d: front end %s connected (arena %d MiB%s)", self.index, hello.get("frontend"),
                 len(arena) >> 20, ", page-locked: the GPU reads requests in place" if pinned else "")
        writer.write(ipc.hello_bytes(self.hello))
        pending: dict[int, asyncio.Future] = {}
        try:
            await self._requests(reader, writer, view, pending)
        finally:
            for future in pending.values():
                future.cancel()  # the front end is gone: nobody reads these answers
            writer.close()
            log.info("engine %d: front end %s disconnected", self.index, hello.get("frontend"))

    def _pin(self, arena: np.ndarray) -> bool:
        """Page-lock a front end's arena for every GPU (the pipeline then DMAs requests from it without a host
        copy). It stays registered for the life of the process: a front end connects once."""
        if not any(m.device.type == "cuda" for m in self._models):
            return False
        import torch

        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(arena.ctypes.data, arena.nbytes, 1)  # 1: cudaHostRegisterPortable
        if int(err) != 0:
            log.warning("engine %d: page-locking a front end's arena failed (CUDA error %d): requests are staged "
                        "through a host copy instead", self.index, int(err))
            return False
        self._pinned.append(arena)  # never unmapped while registered
        pipeline.register_page_locked(arena.ctypes.data, arena.nbytes)
        return True

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, arena: np.ndarray,
                        pending: dict[int, asyncio.Future]) -> None:
        """Read request records as they come (every whole one in a read at once) until the front end hangs up."""
        outbox = ipc.Outbox(writer)
        # A trailer is a region's name or a CONTROL's JSON and data, at most one request's output.
        max_trailer = self.settings.max_request_samples * int(self.hello["cout"]) * 4 + (1 << 16)
        buffer = b""
        while True:
            try:
                data = await reader.read(1 << 16)
            except ConnectionError:
                return
            if not data:
                return
            buffer = buffer + data if buffer else data
            try:
                records, used = ipc.requests(buffer, max_trailer)
            except ValueError as exc:  # a corrupt stream: nothing after it can be read as records
                log.error("engine %d: a front end's stream is corrupt, dropping its connection: %s", self.index, exc)
                return
            for record, trailer in records:
                self._request(record, trailer, arena, pending, outbox)
            buffer = buffer[used:]

    def _request(self, record: tuple, trailer: bytes, arena: np.ndarray, pending: dict[int, asyncio.Future],
                 outbox: ipc.Outbox, mapped: int = 0) -> None:
        """Take one record (``mapped``: times its CUDA regions were mapped here for it, by ``_map_then``)."""
        kind, dtype, _trailer_bytes, req_id, offset, nbytes, deadline, *shape = record
        if kind == ipc.CANCEL:
            future = pending.get(req_id)
            if future is not None:
                future.cancel()
            return
        if kind == ipc.CONTROL:
            task = asyncio.create_task(self._control(req_id, trailer, outbox))
            self._controls.add(task)
            task.add_done_callback(self._controls.discard)
            # Cancellable as a request is (the front end stopped waiting: a registration then leaves nothing
            # registered, as in one process); cancelled, possibly before it ran, it is answered here.
            pending[req_id] = task
            task.add_done_callback(_TaskDone(outbox, pending, req_id, self.settings.model_name))
            return
        model_name = self.settings.model_name
        lease = out_lease = None
        store = None
        try:
            datatype = INPUT_DATATYPES[dtype]
            count = math.prod(shape)
            if count * ITEMSIZE[datatype] != nbytes:
                raise ServingError(Status.INTERNAL, f"malformed request record {kind, shape, nbytes}")
            array: np.ndarray | DeviceArray
            region_kind, name, result = ipc.parse_region(trailer) if kind == ipc.INFER_REGION else ("", "", None)
            if region_kind == "system":  # a client's segment: read off the event loop (a first page-lock, a copy)
                if self.shm is None:
                    raise ServingError(Status.UNIMPLEMENTED, "this engine does not read shared-memory segments")
                reading = asyncio.create_task(self._segment_request(name, offset, tuple(shape), datatype, deadline))
                pending[req_id] = reading
                reading.add_done_callback(_Reply(outbox, pending, req_id, model_name, None))
                return
            if region_kind == "cuda":  # in a client's CUDA region: read where it lies, held by its lease
                if self.cuda_shm is None:
                    raise ServingError(Status.UNIMPLEMENTED, "this engine offers no CUDA shared memory")
                try:  # never opening a handle here, on the loop
                    tensor, lease = self.cuda_shm.read(name, offset, tuple(shape), WIRE_DTYPE[datatype],
                                                       "the request's input", open_here=False)
                    assert not isinstance(tensor, RegionTensor)  # this registry maps its regions: an address
                    if result is not None:  # its output goes into a CUDA region: written on the device, or stored
                        out_lease = self.cuda_shm.attach_result(tensor, *result, int(self.hello["cout"]),
                                                                "the request's output", open_here=False)
                        if out_lease is None:  # (host memory: a fake device layer's)
                            store = _Store(self.cuda_shm, *result)
                except NotMappedHere as missing:
                    # Registered through another engine and not mapped here yet: mapped (and checked) on the
                    # registry's thread, then the request is taken again. (A region that is registered anew each
                    # time it has been mapped is refused after a few rounds.)
                    if lease is not None:
                        lease.release()
                    lease = None
                    if mapped >= MAP_ROUNDS:
                        raise missing.remapped_too_often() from None
                    opening = asyncio.create_task(self._map_then(missing.name, record, trailer, arena, pending,
                                                                 outbox, mapped + 1))
                    pending[req_id] = opening
                    opening.add_done_callback(_TaskDone(outbox, pending, req_id, model_name))
                    return
                array = tensor
            elif kind == ipc.INFER and offset + nbytes <= len(arena):
                array = arena[offset : offset + nbytes].view(WIRE_DTYPE[datatype]).reshape(shape)
            else:
                raise ServingError(Status.INTERNAL, f"malformed request record {kind, shape, nbytes}")
            assert self.runner is not None  # serving: the runner exists
            future = self.runner.enqueue(array, datatype, ipc.timeout_of(deadline))
            del array
        except Exception as exc:
            for held in (lease, out_lease):
                if held is not None:
                    held.release()
            outbox.put(_error_reply(req_id, exc, model_name))
            return
        pending[req_id] = future
        future.add_done_callback(_Reply(outbox, pending, req_id, model_name, lease, out_lease, store))

    async def _map_then(self, name: str, record: tuple, trailer: bytes, arena: np.ndarray,
                        pending: dict[int, asyncio.Future], outbox: ipc.Outbox, mapped: int) -> None:
        """Map CUDA region ``name`` in this engine (one mapping for every request that waits for it), then take the
        request again (``_request``: a region that did not open is refused there, in the request's words)."""
        mapping = self._mapping.get(name)
        if mapping is None:
            mapping = asyncio.ensure_future(self._map_region(name))
            self._mapping[name] = mapping
            mapping.add_done_callback(lambda done: self._mapping.pop(name) if self._mapping.get(name) is done
                                      else None)
        with contextlib.suppress(Exception):  # (the request's own read says why)
            await asyncio.shield(mapping)  # a request cancelled meanwhile leaves the mapping to the others
        self._request(record, trailer, arena, pending, outbox, mapped)

    async def _map_region(self, name: str) -> None:
        assert self.cuda_shm is not None
        await self.cuda_shm.map_here(name, "the request's input")
        log.info("engine %d: CUDA shared-memory region %r mapped here too, at its first request here", self.index,
                 name)

    async def _segment_request(self, name: str, offset: int, shape: tuple[int, ...], datatype: str,
                               deadline: float) -> BatchResult:
        """A request whose input lies in a client's system shared-memory segment: its bytes where they lie (the
        view that holds the page-locked mapping's lease, for the GPU's DMA only), or a pinned copy; then the
        batch."""
        assert self.shm is not None and self.runner is not None
        dtype = WIRE_DTYPE[datatype]
        array = await asyncio.to_thread(self.shm.read_tensor, name, offset, shape, dtype, "the request's input")
        assert isinstance(array, np.ndarray)  # (this registry reads: it passes nothing on by reference)
        return await self.runner.enqueue(array, datatype, ipc.timeout_of(deadline))

    async def _control(self, req_id: int, trailer: bytes, outbox: ipc.Outbox) -> None:
        """A front end's operation on the CUDA regions (remote.EngineCudaSharedMemory), answered with its result
        or its error."""
        try:
            if self.cuda_shm is None:
                raise ServingError(Status.UNIMPLEMENTED, "this engine offers no CUDA shared memory")
            operation, data = ipc.parse_control(trailer)
            op, name = operation["op"], str(operation["name"])
            if op == "register":
                await self.cuda_shm.register(name, base64.b64decode(operation["handle"]),
                                             int(operation["device_id"]), int(operation["byte_size"]))
            elif op == "unregister":
                await self.cuda_shm.unregister(name)
            elif op == "forget":  # unregistered by another engine: its record is gone, this one's mapping goes too
                self.cuda_shm.holds(name)
            elif op == "write":
                await self.cuda_shm.store(name, int(operation["offset"]), data, str(operation["what"]))
            else:
                raise ServingError(Status.INTERNAL, f"unknown operation {op!r}")
        except Exception as exc:
            outbox.put(_error_reply(req_id, exc, self.settings.model_name))
            return
        outbox.put(ipc.REPLY.pack(ipc.OK, 0, 0, req_id, 0, 0))


class _TaskDone:
    """The done-callback of a request's task that answers for itself (a CONTROL's, or ``_map_then``'s, which hands
    the request on to ``_request`` and its own entry in ``pending``): out of ``pending`` while the entry is still
    the task's; answered here only when cancelled before it could answer (or failed unforeseen)."""

    __slots__ = ("model_name", "outbox", "pending", "req_id")

    def __init__(self, outbox: ipc.Outbox, pending: dict, req_id: int, model_name: str) -> None:
        self.outbox, self.pending, self.req_id, self.model_name = outbox, pending, req_id, model_name

    def __call__(self, task: asyncio.Future) -> None:
        if self.pending.get(self.req_id) is task:
            del self.pending[self.req_id]
        if task.cancelled():
            self.outbox.put(_error_reply(self.req_id, ServingError(Status.CANCELLED, "cancelled"), self.model_name))
        elif (failed := task.exception()) is not None:
            self.outbox.put(_error_reply(self.req_id, failed, self.model_name))


class _Store:
    """Writes a request's output into the CUDA region its record named, after the execution (where the execution
    could not write it there itself)."""

    __slots__ = ("name", "offset", "registry")

    def __init__(self, registry: CudaSharedMemoryRegistry, name: str, offset: int) -> None:
        self.registry, self.name, self.offset = registry, name, offset

    def __call__(self, output: bytes) -> None:
        self.registry.write(self.name, self.offset, output, "the request's output")


class _Reply:
    """The done-callback of one request's future: its reply record."""

    __slots__ = ("leases", "model_name", "outbox", "pending", "req_id", "store")

    def __init__(self, outbox: ipc.Outbox, pending: dict, req_id: int, model_name: str, lease: Lease | None,
                 out_lease: Lease | None = None, store: _Store | None = None) -> None:
        self.outbox, self.pending, self.req_id, self.model_name = outbox, pending, req_id, model_name
        # a CUDA region's input (and output written on the device): released once no execution uses them
        self.leases = tuple(held for held in (lease, out_lease) if held is not None)
        self.store = store

    def __call__(self, future: asyncio.Future) -> None:
        self.pending.pop(self.req_id, None)
        if not future.cancelled():
            # Answered, with its result or an error: its executions are over (a request run in chunks is answered
            # once none of them runs, batching.py). Cancelled, it may still run: the leases go with its tensors.
            for held in self.leases:
                held.release()
        self.leases = ()
        if future.cancelled():
            self.outbox.put(_error_reply(self.req_id, ServingError(Status.CANCELLED, "cancelled"),
                                         self.model_name))
            return
        exc = future.exception()
        if exc is not None:
            self.outbox.put(_error_reply(self.req_id, exc, self.model_name))
            return
        result: BatchResult = future.result()
        out = np.ascontiguousarray(result.output, dtype=np.float32).tobytes()  # N x Cout: sent with the header
        # (a non-finite row fails the request in the front end, INVALID_ARGUMENT: the client's region keeps what it
        # held, as in one process, where the output is stored only once it has been checked)
        if self.store is not None and np.isfinite(result.output).all():
            try:
                self.store(out)
            except Exception as failed:
                self.outbox.put(_error_reply(self.req_id, failed, self.model_name))
                return
        self.outbox.put(ipc.REPLY.pack(ipc.OK, 0, len(out), self.req_id, result.queue_ns, result.batch_samples) + out)


def _error_reply(req_id: int, exc: BaseException, model_name: str) -> bytes:
    error = runner_error(exc, model_name)
    if error is None:
        log.error("request failed in the engine: %s: %s", type(exc).__name__, exc)
        error = internal("inference failed inside the server; see its log")
    message = error.message.encode()
    return ipc.REPLY.pack(ipc.ERROR, error.code.value, len(message), req_id, 0, 0) + message


def run_engine(settings: Settings, socket_path: str, index: int, stats_dir: str | None,
               regions_dir: str | None = None) -> int:
    """The engine process's main: load, serve until SIGTERM/SIGINT and the front ends' drain."""
    logs.configure(settings.log_level, settings.log_format)
    engine = Engine(settings, socket_path, index, stats_dir, regions_dir)
    try:
        engine.load()
    except Exception as exc:
        log.error("engine %d: start-up failed: %s", index, exc)
        return 1

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await engine.serve(stop)

    return eventloop.run(main(), settings.event_loop)
