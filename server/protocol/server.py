"""The gRPC server of one process: its options and limits, the token check, the RPC limit, and the services
it serves (the KServe v2 inference service, grpc.health.v1, server reflection v1 and v1alpha)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from voxserve.proto.pool import reflection_pool

from ..settings import Settings
from . import security
from .admission import RpcLimiter
from .control import ControlService
from .health import HealthServicer
from .inference import InferenceService
from .partner import REPORT_METHOD, Reports, forwarded_peer
from .service import SERVICE_NAME, add_to_server

# Server reflection v1 is v1alpha under another name (the same messages, field for field): grpcurl and newer
# tools ask for v1 first, grpcio-reflection serves v1alpha.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# gRPC's compression algorithms: bit 0 is identity (none), the others gzip and deflate.
IDENTITY_ONLY = 1


def grpc_options(settings: Settings, shares_port: bool) -> list[tuple[str, int]]:
    """The gRPC server's options (channel arguments): message limits, streams per connection, keepalive, compression;
    a native front end's too (server/topology/native.py)."""
    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        # One connection holds at most this share of --max-concurrent-rpcs.
        ("grpc.max_concurrent_streams", settings.max_streams_per_connection),
        # ... counted as HTTP/2 counts them, as the client does. gRPC's overload protection also counts a call
        # whose answer was sent until its handler has let go of it, a moment later, and resets the streams
        # a client opens within that moment (REFUSED_STREAM): a client at its limit lost up to 40 % of its
        # calls. The server's own bounds (--max-concurrent-rpcs, the queue) hold either way.
        ("grpc.http.overload_protection", 0),
        # Find dead peers (a vanished or stalled client) and free what their calls hold.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]
    if not settings.grpc_compression:  # a compressed message is refused from its headers, never inflated
        options.append(("grpc.compression_enabled_algorithms_bitset", IDENTITY_ONLY))
    if not shares_port:  # a server of its own: no other process may join its port (SO_REUSEPORT)
        options.append(("grpc.so_reuseport", 0))
    return options


class GrpcServer:
    """A grpc.aio server for the inference service's two servicers: construct it inside the event loop that
    will run it (grpc.aio binds to that loop). ``on_refused(code_name, method)`` hears of each call refused
    before its handler ran (a bad token, the RPC limit). ``shares_port``: one of a supervisor's processes, which
    share its port."""

    def __init__(self, settings: Settings, control: ControlService, inference: InferenceService, shares_port: bool,
                 on_refused: Callable[[str, str], None], partner: bool = False, scope: str = "") -> None:
        self.settings = settings
        # ``partner``: the partner of a native front end (partner.py), served on a private Unix socket (bind_socket)
        # without TLS (the native front end terminates it), its clients named by the native front end, which
        # reports what it served itself.
        self.health = HealthServicer(settings.stream_idle_timeout_s)
        options = grpc_options(settings, shares_port)
        interceptors = []
        if settings.auth_token_file:
            open_methods = security.HEALTH_METHODS if settings.open_health else frozenset()
            if partner:  # the native front end's own call (clients cannot reach it: it refuses that service)
                open_methods |= {REPORT_METHOD}
            interceptors.append(security.TokenAuthInterceptor(
                security.load_tokens(settings.auth_token_file), open_methods,
                lambda method: on_refused(grpc.StatusCode.UNAUTHENTICATED.name, method)))
        self._credentials = None if partner else security.server_credentials(
            settings.tls_cert or None, settings.tls_key or None, settings.tls_client_ca or None)
        # --max-concurrent-rpcs is applied to the handlers (server/protocol/admission.py), after the token check.
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.limiter = RpcLimiter(settings.max_concurrent_rpcs,
                                  lambda method: on_refused(grpc.StatusCode.RESOURCE_EXHAUSTED.name, method),
                                  forwarded_peer if partner else None, scope)
        add_to_server(control, inference, self.server, self.limiter)
        self._add_health_and_reflection()
        if partner:
            self.server.add_generic_rpc_handlers((Reports(inference).handler(),))

    @property
    def secure(self) -> bool:
        return self._credentials is not None

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
        # Our messages are in a pool of their own (proto/pool.py), health's and reflection's in the default.
        reflector = reflection.aio.ReflectionServicer(
            (SERVICE_NAME, HEALTH_SERVICE, reflection.SERVICE_NAME, REFLECTION_V1),
            pool=reflection_pool(health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR))
        reflection_handlers = {"ServerReflectionInfo": handler(
            grpc.stream_stream_rpc_method_handler, reflector.ServerReflectionInfo,
            reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse)}
        self.server.add_generic_rpc_handlers((
            self.limiter.service(HEALTH_SERVICE, health_handlers),
            self.limiter.service(reflection.SERVICE_NAME, reflection_handlers),
            self.limiter.service(REFLECTION_V1, reflection_handlers),
        ))

    def bind(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); the port bound, 0 if none could be."""
        address = f"{host}:{port}"
        if self._credentials is not None:
            return self.server.add_secure_port(address, self._credentials)
        return self.server.add_insecure_port(address)

    def bind_socket(self, path: str) -> bool:
        """Listen on the Unix socket ``path`` (a native front end's partner: there only, in plaintext)."""
        return self.server.add_insecure_port(f"unix:{path}") != 0

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        """What grpc.health.v1 says of the server and of the inference service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def end_watches(self) -> None:
        """Each health Watch is sent NOT_SERVING and ends (the drain)."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting calls; those in progress get ``grace_s`` to finish."""
        await self.server.stop(grace_s)
