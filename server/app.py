"""Server lifecycle: bind, load weights, warm up, serve, drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from . import ports, security
from . import weights as weights_io
from .admission import RpcLimiter
from .codec import ModelSpec
from .engine import build_models, load_weights, run_engine
from .health import HealthServicer
from .heap import freeze_startup_objects
from .ipc import Arena
from .metrics import Metrics, latency_buckets
from .remote import RemoteRunner
from .replicas import (
    ENGINE_SOCKET_ENV,
    ENGINES_ENV,
    REPLICA_DIR_ENV,
    REPLICA_INDEX_ENV,
    ROLE_ENV,
    die_with_supervisor,
    resolve_frontends,
    resolve_replicas,
    supervise,
    usable_cpus,
)
from .runner import BatchingConfig, Runner
from .service import SERVICE_NAME, InferenceService, ServingState, add_to_server
from .settings import AUTO, Settings
from .shm import SharedMemoryRegistry

log = logging.getLogger("voxserve")

# Server reflection v1 is v1alpha under another name (the same messages, field for field): grpcurl and newer
# tools ask for v1 first, grpcio-reflection serves v1alpha.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# gRPC's compression algorithms: bit 0 is identity (none), the others gzip and deflate.
IDENTITY_ONLY = 1


class VoxServer:
    """One voxserve instance: a grpc.aio server, its model and its metrics.

    Construct it inside the event loop that will run it (grpc.aio binds to that loop).

    ``start()`` binds and returns while the model loads; ``wait_ready()`` waits
    for the warm-up; ``stop()`` drains. ``run()`` does all three around signals.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = ServingState(max_batch=settings.max_batch)
        replica_dir = os.environ.get(REPLICA_DIR_ENV)  # one of --replicas: the supervisor serves GPU metrics
        self.metrics = Metrics(settings.model_name, latency_buckets(settings.latency_buckets_s),
                               gpu_metrics=replica_dir is None)
        self.health = HealthServicer(settings.stream_idle_timeout_s)
        options = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            # One connection holds at most this share of --max-concurrent-rpcs.
            ("grpc.max_concurrent_streams", settings.max_streams_per_connection),
            # Find dead peers (a vanished or stalled client) and free what their calls hold.
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
        ]
        if not settings.grpc_compression:  # a compressed message is refused from its headers, never inflated
            options.append(("grpc.compression_enabled_algorithms_bitset", IDENTITY_ONLY))
        if not replica_dir:  # a server of its own: no other process may join its port (SO_REUSEPORT)
            options.append(("grpc.so_reuseport", 0))
        interceptors = []
        if settings.auth_token_file:
            open_methods = security.HEALTH_METHODS if settings.open_health else frozenset()
            interceptors.append(security.TokenAuthInterceptor(security.load_tokens(settings.auth_token_file),
                                                              open_methods,
                                                              self._refusal_counter(grpc.StatusCode.UNAUTHENTICATED)))
        self._credentials = security.server_credentials(settings.tls_cert or None, settings.tls_key or None,
                                                        settings.tls_client_ca or None)
        # --max-concurrent-rpcs is applied to the handlers (server/admission.py), after the token check.
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.limiter = RpcLimiter(settings.max_concurrent_rpcs,
                                  self._refusal_counter(grpc.StatusCode.RESOURCE_EXHAUSTED))
        self.shm = SharedMemoryRegistry(settings.max_shm_regions, settings.max_shm_bytes,
                                        os.path.join(replica_dir, "regions") if replica_dir else None)
        if replica_dir:
            replica = os.environ.get(REPLICA_INDEX_ENV, str(os.getpid()))
            self.state.stats.share(os.path.join(replica_dir, "stats"), replica)
        self._replica_dir = replica_dir
        # A front end of --frontends: the model runs in the engines listening on these sockets.
        engines = os.environ.get(ENGINES_ENV, "") if os.environ.get(ROLE_ENV) == "frontend" else ""
        self._engines = [p for p in engines.split(os.pathsep) if p]
        self._publish_task: asyncio.Task[None] | None = None
        self.service = InferenceService(self.state, self.metrics, settings.model_name, settings.model_version,
                                        self.shm, settings.stream_idle_timeout_s, settings.max_shm_inflight_bytes)
        add_to_server(self.service, self.server, self.limiter)
        self._add_health_and_reflection()
        self.port = 0
        self.metrics_port = -1
        self._ready = asyncio.Event()
        self._load_task: asyncio.Task[None] | None = None
        self.load_error: BaseException | None = None
        self._weights: weights_io.Weights | None = None
        self._lost_task: asyncio.Task[None] | None = None

    def _add_health_and_reflection(self) -> None:
        """grpc.health.v1 and server reflection (v1 and v1alpha), their handlers under the RPC limit too."""
        def handler(kind, behavior, request_cls, response_cls):
            return kind(behavior, request_deserializer=request_cls.FromString,
                        response_serializer=response_cls.SerializeToString)

        health_handlers = {
            "Check": handler(grpc.unary_unary_rpc_method_handler, self.health.Check,
                             health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse),
            "Watch": handler(grpc.unary_stream_rpc_method_handler, self.health.Watch,
                             health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse),
        }
        reflector = reflection.aio.ReflectionServicer(
            (SERVICE_NAME, HEALTH_SERVICE, reflection.SERVICE_NAME, REFLECTION_V1))
        reflection_handlers = {"ServerReflectionInfo": handler(
            grpc.stream_stream_rpc_method_handler, reflector.ServerReflectionInfo,
            reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse)}
        self.server.add_generic_rpc_handlers((
            self.limiter.service(HEALTH_SERVICE, health_handlers),
            self.limiter.service(reflection.SERVICE_NAME, reflection_handlers),
            self.limiter.service(REFLECTION_V1, reflection_handlers),
        ))

    def _refusal_counter(self, code: grpc.StatusCode):
        """A callback that counts an inference call refused before its handler ran (a bad token, the RPC limit)."""
        def count(method: str) -> None:
            if method.endswith(("/ModelInfer", "/ModelStreamInfer")):
                self.metrics.count_request(code.name)

        return count

    async def start(self) -> int:
        """Read the weights, bind the ports, start serving (not ready yet) and begin building the model.

        A weights file that cannot be used raises WeightsError here, before any port is open.
        """
        s = self.settings
        if not self._replica_dir:  # a server of its own: its ports must be free (a supervisor checked its children's)
            ports.ensure_free(s.host, s.grpc_port, "--grpc-port")
            if s.metrics_port > 0:
                ports.ensure_free(s.host, s.metrics_port, "--metrics-port")
        if not self._engines:  # (a front end's engines read the weights)
            self._weights = await asyncio.to_thread(load_weights, s, self.metrics)
        address = f"{s.host}:{s.grpc_port}"
        if self._credentials is not None:
            self.port = self.server.add_secure_port(address, self._credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind gRPC to {s.host}:{s.grpc_port}")
        if s.metrics_port >= 0:
            self.metrics_port = self.metrics.serve_http(s.host, s.metrics_port)
        await self._set_serving(False)
        await self.server.start()
        log.info("listening: gRPC%s %s:%d%s, metrics %s", " (mutual TLS)" if s.tls_client_ca else
                 " (TLS)" if self._credentials else "", s.host, self.port,
                 ", bearer token required" if s.auth_token_file else "",
                 f"{s.host}:{self.metrics_port}" if self.metrics_port >= 0 else "off")
        self._load_task = asyncio.create_task(self._load())
        if self._replica_dir:
            # With --replicas/--frontends: this process's statistics for the others' ModelStatistics.
            self._publish_task = asyncio.create_task(self.state.stats.publish_every())
        return self.port

    async def _load(self) -> None:
        s = self.settings
        batching = BatchingConfig.from_settings(s)
        loop = asyncio.get_running_loop()

        def lost(reason: str) -> None:
            loop.call_soon_threadsafe(self._device_lost, reason)

        try:
            if self._engines:
                arena = Arena(s.frontend_arena_bytes)
                frontend = os.environ.get(REPLICA_INDEX_ENV, "")
                runner = await RemoteRunner.connect(self._engines, arena, frontend, batching, lost)
                self.state.runner = runner
                hello = runner.links[0].hello
                cin, cout, k = int(hello["cin"]), int(hello["cout"]), int(hello["k"])
                devices, kernel = ",".join(runner.devices), runner.kernel
                self.shm.allocate = arena.allocate_now  # shared-memory inputs land in the arena: no second copy
            else:
                models = await asyncio.to_thread(build_models, s, self._weights, self.metrics)
                model = models[0]
                cin, cout, k = model.cin, model.cout, model.k
                self.state.runner = Runner(models, self.state.stats, self.metrics, batching, lost)
                if model.pipeline is not None:  # shared-memory inputs land in pinned memory: the GPU copies in place
                    from .pipeline import pinned_buffer

                    self.shm.allocate = pinned_buffer
                devices, kernel = ",".join(str(m.device) for m in models), model.kernel
            self.state.spec = ModelSpec(s.model_name, s.model_version, cin, cout, k, s.max_request_samples,
                                        s.max_request_voxels)
            self.state.device, self.state.kernel = devices, kernel
            self.metrics.set_build(devices, kernel)
            if not self.state.draining:
                freeze_startup_objects()
                self.state.ready = True
                await self._set_serving(True)
                log.info("ready: model '%s' v%s (Cin=%d, Cout=%d, k=%d) on %s with %s%s", s.model_name,
                         s.model_version, cin, cout, k, devices, kernel,
                         f" (front end of {len(self._engines)} engine(s))" if self._engines else "")
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
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
        self.metrics.model_ready.labels(self.settings.model_name).set(1 if serving else 0)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: refuse new work, report not ready, let in-flight requests finish within the grace period."""
        grace_s = self.settings.grace_period_s if grace_s is None else grace_s
        self.state.draining = True
        self.state.ready = False
        await self._set_serving(False)
        await self.health.enter_graceful_shutdown()  # each Watch is sent NOT_SERVING and ends
        self.service.close_streams("the server is shutting down; open a stream to another replica")
        log.info("draining: up to %.1f s for %d accepted requests", grace_s, self.state.accepted)
        # While requests are in flight the server stays open, so that new ones are answered
        # UNAVAILABLE by the servicer (retry elsewhere) instead of being cut off by the transport.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.state.accepted > 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        abandoned = self.state.accepted
        await self.server.stop(max(0.0, deadline - loop.time()))
        self.metrics.stop_http()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.state.runner is not None:
            await self.state.runner.close()
        if self._publish_task is not None:
            self._publish_task.cancel()
            self.state.stats.publish()  # the final figures, for the replicas still answering
        self.shm.close()
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
        except (weights_io.WeightsError, ports.PortInUse) as exc:
            log.error("start-up failed: %s", exc)
            return 1
        ready_task = asyncio.create_task(self.wait_ready())
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait({ready_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if ready_task.done() and not ready_task.result():
            await self.server.stop(0)
            return 1
        await stop_task
        log.info("signal received")
        await self.stop()
        return 0


def serve(settings: Settings) -> int:
    """Run a server in this process until it is signalled (with --replicas N > 1 or --frontends: a supervisor
    of several processes); the CLI's `serve`."""
    def configure_logging() -> None:
        logging.basicConfig(level=settings.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if os.environ.get(REPLICA_DIR_ENV):  # a child of the supervisor of --replicas / --frontends
        die_with_supervisor()
    if os.environ.get(ROLE_ENV) == "engine":  # one of --frontends' engines
        return run_engine(settings, os.environ[ENGINE_SOCKET_ENV], int(os.environ.get(REPLICA_INDEX_ENV, "0")),
                          os.path.join(os.environ[REPLICA_DIR_ENV], "stats"), configure_logging)
    replicas = resolve_replicas(settings)
    frontends = resolve_frontends(settings, engines=replicas)
    if settings.frontends == AUTO:
        configure_logging()
        log.info("--frontends auto: %d front ends (%.4g usable CPU cores%s)", frontends, usable_cpus(),
                 ", model on the CPU" if frontends == 0 else "")
    if replicas > 1 or frontends > 0:
        return supervise(dataclasses.replace(settings, replicas=replicas, frontends=frontends))
    settings = dataclasses.replace(settings, frontends=frontends)
    configure_logging()

    async def main() -> int:
        try:
            server = VoxServer(settings)
        except security.SecurityConfigError as exc:
            log.error("start-up failed: %s", exc)
            return 1
        return await server.run()

    return asyncio.run(main())
