"""One serving process's lifecycle: bind, load weights, warm up, serve, drain on SIGTERM/SIGINT; and `serve`, the
entry point that reads the process's role and becomes a supervisor, an engine or a gRPC server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from typing import TYPE_CHECKING

from . import eventloop, logs, tracing
from .core.devicemem import CudaDeviceMemory, DeviceMemory
from .core.errors import StartupError
from .core.heap import freeze_startup_objects
from .metrics import Metrics, latency_buckets
from .protocol.codec import ModelSpec
from .protocol.control import ControlService
from .protocol.cudashm import CudaSharedMemoryRegistry
from .protocol.inference import InferenceService
from .protocol.partner import call_peer
from .protocol.rest import METHOD_PREFIX as REST_METHOD_PREFIX
from .protocol.rest import RestServer
from .protocol.server import GrpcServer
from .protocol.service import ServingState
from .protocol.shm import SharedMemoryRegistry
from .settings import AUTO, Settings
from .topology import ports
from .topology.executors import open_executor, read_weights
from .topology.roles import ENGINE, FRONTEND, REPLICA, Role
from .topology.supervisor import die_with_supervisor, resolve_frontends, resolve_replicas, supervise, usable_cpus

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from .core.weights import Weights

log = logging.getLogger("voxserve")
STANDALONE = Role()


class VoxServer:
    """One voxserve process that serves gRPC and REST: its model (in process, or in the engines of a front end),
    its gRPC server, its REST server (unless --http-port -1) and its metrics. ``role`` says which (standalone, one
    of --replicas, a front end of --frontends). ``device_memory``: the device layer of CUDA shared memory instead
    of the CUDA devices' (found once the model runs on them; tests give a fake).

    Construct it inside the event loop that will run it (grpc.aio binds to that loop).

    ``start()`` binds and returns while the model loads; ``wait_ready()`` waits
    for the warm-up; ``stop()`` drains. ``run()`` does all three around signals.

    ``tracer`` (None unless --tracing) and ``access_log`` (None unless --access-log) are for every transport's
    requests; ``span_exporter``: where the spans go instead of what OTEL_* asks for (the tests' in-memory one).
    """

    def __init__(self, settings: Settings, role: Role = STANDALONE, span_exporter: SpanExporter | None = None,
                 device_memory: DeviceMemory | None = None) -> None:
        self.settings = settings
        self.role = role
        self.state = ServingState(max_batch=settings.max_batch)
        # One of a supervisor's processes: the supervisor serves the GPU metrics and shares the statistics.
        self.metrics = Metrics(settings.model_name, latency_buckets(settings.latency_buckets_s),
                               gpu_metrics=not role.supervised)
        self.shm = SharedMemoryRegistry(settings.max_shm_regions, settings.max_shm_bytes,
                                        os.path.join(role.run_dir, "regions") if role.supervised else None)
        if role.supervised:
            self.state.stats.share(os.path.join(role.run_dir, "stats"), role.name or str(os.getpid()))
        self._publish_task: asyncio.Task[None] | None = None
        self.tracer = tracing.open_tracer(settings, span_exporter)
        self.access_log = logs.AccessLog(settings.access_log_sample_rate) if settings.access_log else None
        self.service = InferenceService(self.state, self.metrics, settings.model_name, settings.model_version,
                                        self.shm, settings.stream_idle_timeout_s, settings.max_shm_inflight_bytes,
                                        self.tracer, self.access_log, settings.max_message_bytes)
        self.control = ControlService(self.state, settings.model_name, settings.model_version, self.shm)
        self.cuda_shm: CudaSharedMemoryRegistry | None = None
        if device_memory is not None:
            self._offer_cuda_shm(device_memory)
        self.grpc = GrpcServer(settings, self.control, self.service, role.supervised, self._count_refused,
                               partner=bool(role.partner_socket),
                               scope={FRONTEND: "front end", REPLICA: "replica"}.get(role.kind, ""))
        if role.partner_socket:  # its clients are the native front end's: the access log names them so too
            self.service.peer_of = call_peer
        self.limiter = self.grpc.limiter
        self.rest = RestServer(settings, self.control, self.service, self.limiter, role.supervised,
                               self._count_refused) if settings.http_port >= 0 else None
        self.port = 0
        self.http_port = -1
        self.metrics_port = -1
        self._ready = asyncio.Event()
        self._load_task: asyncio.Task[None] | None = None
        self.load_error: BaseException | None = None
        self._weights: Weights | None = None  # read before the ports open; None for a front end
        self._lost_task: asyncio.Task[None] | None = None

    def _offer_cuda_shm(self, devices: DeviceMemory | CudaSharedMemoryRegistry) -> None:
        """Serve CUDA shared memory through ``devices`` (or that registry): the registry, the RPCs, the extension in
        the metadata."""
        shared = os.path.join(self.role.run_dir, "regions") if self.role.supervised else None
        self.cuda_shm = devices if isinstance(devices, CudaSharedMemoryRegistry) else \
            CudaSharedMemoryRegistry(devices, self.settings.max_cuda_shm_regions, self.shm, shared)
        self.shm.cuda = self.control.cuda_shm = self.cuda_shm

    def _count_refused(self, code: str, method: str) -> None:
        """Count an inference call refused before its handler ran (a bad token, the RPC limit)."""
        if method.endswith(("/ModelInfer", "/ModelStreamInfer")):
            self.metrics.count_request(code)
            if self.access_log is not None:
                transport = "http" if method.startswith(REST_METHOD_PREFIX) else "grpc"
                self.access_log.record(transport=transport, method=method.rsplit("/", 1)[-1], code=code,
                                       duration_ms=0.0)

    async def start(self) -> int:
        """Read the weights, bind the ports, start serving (not ready yet) and begin building the model.

        A weights file that cannot be used raises WeightsError here, before any port is open.
        """
        s = self.settings
        if not self.role.supervised:  # its own ports must be free (a supervisor checked its children's)
            ports.ensure_free(s.host, s.grpc_port, "--grpc-port")
            ports.ensure_free(s.host, s.http_port, "--http-port")
            if s.metrics_port > 0:
                ports.ensure_free(s.host, s.metrics_port, "--metrics-port")
        self._weights = await asyncio.to_thread(read_weights, s, self.role, self.metrics)
        if self.role.partner_socket:  # behind a native front end, which holds the public port
            if not self.grpc.bind_socket(self.role.partner_socket):
                raise OSError(f"could not bind gRPC to unix:{self.role.partner_socket}")
            self.port = s.grpc_port
        else:
            self.port = self.grpc.bind(s.host, s.grpc_port)
            if self.port == 0:
                raise OSError(f"could not bind gRPC to {s.host}:{s.grpc_port}")
        if s.metrics_port >= 0:
            self.metrics_port = self.metrics.serve_http(s.host, s.metrics_port)
        await self._set_serving(False)
        await self.grpc.start()
        if self.rest is not None:
            self.http_port = await self.rest.start(s.host, s.http_port)
        tls = " (mutual TLS)" if s.tls_client_ca else " (TLS)" if self.grpc.secure else ""
        log.info("listening: gRPC%s %s:%d, REST %s%s, metrics %s (%s event loop)", tls, s.host, self.port,
                 f"{s.host}:{self.http_port}" if self.http_port >= 0 else "off",
                 ", bearer token required" if s.auth_token_file else "",
                 f"{s.host}:{self.metrics_port}" if self.metrics_port >= 0 else "off", eventloop.running())
        self._load_task = asyncio.create_task(self._load())
        if self.role.supervised:
            # With --replicas/--frontends: this process's statistics for the others' ModelStatistics.
            self._publish_task = asyncio.create_task(self.state.stats.publish_every())
        return self.port

    async def _load(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()

        def lost(reason: str) -> None:
            loop.call_soon_threadsafe(self._device_lost, reason)

        try:
            opened = await open_executor(s, self.role, self._weights, self.state.stats, self.metrics, lost)
            self.state.runner = opened.executor
            if opened.allocate is not None:
                self.shm.allocate = opened.allocate
            self.shm.locker = opened.page_locker
            cin, cout, k, devices, kernel = opened.cin, opened.cout, opened.k, opened.devices, opened.kernel
            self.state.spec = ModelSpec(s.model_name, s.model_version, cin, cout, k, s.max_request_samples,
                                        s.max_request_voxels)
            self.state.device, self.state.kernel = devices, kernel
            # A server whose model runs on CUDA offers CUDA shared memory (the kernel library opens the handles); a
            # front end, when its engines do (they hold the mappings).
            if self.cuda_shm is None and self.role.kind == FRONTEND:
                from .topology.remote import EngineCudaSharedMemory, RemoteRunner

                assert isinstance(opened.executor, RemoteRunner)
                # GPU engines DMA system shared-memory inputs from the clients' segments: passed on by region.
                self.shm.by_reference = opened.executor.reads_segments
                if opened.executor.cuda_devices > 0:
                    self._offer_cuda_shm(EngineCudaSharedMemory(
                        opened.executor, s.max_cuda_shm_regions, self.shm, os.path.join(self.role.run_dir, "regions")))
            elif self.cuda_shm is None and devices.startswith("cuda"):
                from voxserve.kernels import cuda as cuda_kernels

                if cuda_kernels.load_problem() is None:
                    self._offer_cuda_shm(CudaDeviceMemory())
            self.metrics.set_build(devices, kernel)
            if not self.state.draining:
                freeze_startup_objects()
                self.state.ready = True
                await self._set_serving(True)
                log.info("ready: model '%s' v%s (Cin=%d, Cout=%d, k=%d) on %s with %s%s", s.model_name,
                         s.model_version, cin, cout, k, devices, kernel,
                         f" (front end of {len(self.role.engines)} engine(s))" if self.role.kind == FRONTEND else "")
        except Exception as exc:
            self.load_error = exc
            log.error("start-up failed: %s", exc)
        finally:
            self._ready.set()

    def _device_lost(self, reason: str) -> None:
        """The device failed beyond repair: stop reporting ready so the orchestrator replaces this replica."""
        self.state.ready = False
        self._lost_task = asyncio.create_task(self._set_serving(False))

    async def wait_ready(self) -> bool:
        """Wait for start-up to finish; True when the model is ready, False if start-up failed."""
        await self._ready.wait()
        return self.load_error is None

    async def _set_serving(self, serving: bool) -> None:
        await self.grpc.set_serving(serving)
        self.metrics.model_ready.labels(self.settings.model_name).set(1 if serving else 0)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: refuse new work, report not ready, let in-flight requests finish within the grace period."""
        grace_s = self.settings.grace_period_s if grace_s is None else grace_s
        self.state.draining = True
        self.state.ready = False
        await self._set_serving(False)
        await self.grpc.end_watches()
        self.service.close_streams("the server is shutting down; open a stream to another replica")
        log.info("draining: up to %.1f s for %d accepted requests", grace_s, self.state.accepted)
        # While requests are in flight the server stays open, so that new ones are answered
        # UNAVAILABLE by the servicer (retry elsewhere) instead of being cut off by the transport.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        # REST requests still receiving their body are waited for too: they then reach the inference path and are
        # answered UNAVAILABLE (503), as gRPC's are, instead of losing their connection.
        while (self.state.accepted > 0 or (self.rest is not None and self.rest.in_progress > 0)) \
                and loop.time() < deadline:
            await asyncio.sleep(0.01)
        abandoned = self.state.accepted
        await asyncio.gather(self.grpc.stop(max(0.0, deadline - loop.time())),
                             *([self.rest.stop()] if self.rest is not None else []))
        self.metrics.stop_http()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.state.runner is not None:
            await self.state.runner.close()
        if self._publish_task is not None:
            self._publish_task.cancel()
            self.state.stats.publish()  # the final figures, for the replicas still answering
        self.shm.close()
        if self.cuda_shm is not None:
            self.cuda_shm.close()
        if self.tracer is not None:  # the spans still buffered go out now
            await asyncio.to_thread(self.tracer.shutdown)
        stats = self.state.stats.snapshot()
        log.info("stopped: %d requests admitted, %d answered OK, %d abandoned at the end of the grace period",
                 self.state.admitted_total, stats.success.count, abandoned)

    async def run(self) -> int:
        """Serve until SIGTERM or SIGINT, then drain. Returns the process exit code."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
        except StartupError as exc:  # weights that cannot serve, a port in use
            log.error("start-up failed: %s", exc)
            return 1
        ready_task = asyncio.create_task(self.wait_ready())
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait({ready_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if ready_task.done() and not ready_task.result():
            await self.grpc.stop(0)
            if self.rest is not None:
                await self.rest.stop()
            return 1
        await stop_task
        log.info("signal received")
        await self.stop()
        return 0


def serve(settings: Settings) -> int:
    """Run a server in this process until it is signalled (with --replicas N > 1 or --frontends: a supervisor
    of several processes); the CLI's `serve`."""
    role = Role.from_environment()  # what this process is: told by its supervisor, if it has one
    if role.supervised:
        die_with_supervisor()
    if role.kind == ENGINE:
        from .topology.engine import run_engine  # (the model, torch and the devices: only in the engine)

        return run_engine(settings, role.engine_socket, int(role.name or "0"), os.path.join(role.run_dir, "stats"),
                          os.path.join(role.run_dir, "regions"))
    if settings.tracing:  # once, before any process starts: the missing package named in one line
        try:
            tracing.check_available()
        except StartupError as exc:
            logs.configure(settings.log_level, settings.log_format)
            log.error("start-up failed: %s", exc)
            return 1
    replicas = resolve_replicas(settings)
    frontends = resolve_frontends(settings, engines=replicas)
    if settings.frontends == AUTO:
        logs.configure(settings.log_level, settings.log_format)
        log.info("--frontends auto: %d front ends (%.4g usable CPU cores%s)", frontends, usable_cpus(),
                 ", model on the CPU" if frontends == 0 else "")
        if frontends == 0 and settings.frontend_impl == "native":
            log.info("--frontend-impl native: no front ends, so none is native (gRPC is served in process)")
    if replicas > 1 or frontends > 0:
        return supervise(dataclasses.replace(settings, replicas=replicas, frontends=frontends))
    settings = dataclasses.replace(settings, frontends=frontends)
    logs.configure(settings.log_level, settings.log_format)

    async def main() -> int:
        try:
            server = VoxServer(settings, role)
        except StartupError as exc:  # TLS or token files that cannot be used
            log.error("start-up failed: %s", exc)
            return 1
        return await server.run()

    return eventloop.run(main(), settings.event_loop)
