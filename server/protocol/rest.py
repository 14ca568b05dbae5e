"""The REST front end: the Open Inference Protocol's HTTP/REST form (KServe v2) with Triton's binary-tensor
extension, on ``--http-port`` (8000, Triton's layout), beside gRPC in every process that serves gRPC.

It serves through the same pieces as gRPC: the control RPCs (``ControlService``), the inference path
(``InferenceService.infer``, so the same validation, batching, deadlines, shared memory, statistics and metrics),
the bearer tokens and TLS files, and the RPC limit (``--max-concurrent-rpcs`` counts gRPC calls and REST requests
together, each connection a peer). Only the translation is its own (``rest_codec.py``), and the map from the
server's statuses to HTTP's, with the error as ``{"error": "<message>"}``.

Routes (Triton's):
  GET  /v2/health/live, /v2/health/ready                          200, or 400 when not ({"live": ...})
  GET  /v2                                                        server metadata
  GET  /v2/models/{model}[/versions/{version}]                    model metadata
  GET  /v2/models/{model}[/versions/{version}]/ready              200, or 400 when not
  GET  /v2/models/{model}[/versions/{version}]/config             model configuration
  GET  /v2/models[/{model}[/versions/{version}]]/stats            statistics
  POST /v2/models/{model}[/versions/{version}]/infer              inference
  GET  /v2/systemsharedmemory[/region/{region}]/status            system shared memory
  POST /v2/systemsharedmemory/region/{region}/register            body {"key", "offset", "byte_size"}
  POST /v2/systemsharedmemory[/region/{region}]/unregister

Bodies are read into one buffer, grown as they arrive (the binary tensors are then viewed in it, not copied), at
most --max-message-bytes (413 above), and a body that stalls for --http-timeout-s, or arrives slower than
MIN_BODY_BYTES_PER_S beyond that, is answered 408; while the server is at --max-concurrent-rpcs, one that is
admission.PREEMPT_IDLE_S behind that rate gives its slot to a newcomer and is answered 503. A connection with no
request in a handler for --http-timeout-s (headers that never complete, an idle keep-alive) is closed, and at
most --http-max-connections are open (``ConnectionWatch``). Compressed bodies are refused (415) before any byte
is inflated, as gRPC's are by default. A JSON part over --max-json-bytes is refused (413): parsing holds the
interpreter and costs several times the text in memory; JSON parts of more than JSON_INLINE_BYTES are parsed off
the event loop, one --max-json-bytes' worth at a time. ``Expect: 100-continue`` is answered with the refusal
instead when the request will be refused.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import functools
import logging
import socket
import ssl
import struct
import termios
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import HttpVersion11, web

from voxserve.proto import pb

from ..core.errors import ServingError, Status, invalid, shown
from ..settings import Settings
from ..topology.ports import bind_address
from . import rest_codec, security
from .admission import MIN_BODY_BYTES_PER_S, ByteBudget, Call, RpcLimiter, current_call, holding
from .control import ControlService
from .inference import HttpCall, InferenceService
from .service import MalformedRequest
from .wire import InferRequest

log = logging.getLogger(__name__)

# google.rpc's mapping of the canonical codes to HTTP statuses (google/rpc/code.proto). Triton's REST server
# agrees where it has the code; it answers 400 for UNKNOWN and CANCELLED, which name no client error here.
HTTP_STATUS = {
    Status.OK: 200, Status.CANCELLED: 499, Status.UNKNOWN: 500, Status.INVALID_ARGUMENT: 400,
    Status.DEADLINE_EXCEEDED: 504, Status.NOT_FOUND: 404, Status.ALREADY_EXISTS: 409, Status.PERMISSION_DENIED: 403,
    Status.RESOURCE_EXHAUSTED: 429, Status.FAILED_PRECONDITION: 400, Status.ABORTED: 409, Status.OUT_OF_RANGE: 400,
    Status.UNIMPLEMENTED: 501, Status.INTERNAL: 500, Status.UNAVAILABLE: 503, Status.DATA_LOSS: 500,
    Status.UNAUTHENTICATED: 401,
}  # fmt: skip
JSON_INLINE_BYTES = 64 * 1024  # larger JSON is parsed in a thread (the event loop gets the interpreter in between)
TLS_HANDSHAKE_S = 10.0  # at most this long for a TLS handshake (or --http-timeout-s, if shorter)
ACCEPT_WARN_S = 10.0  # at most one warning this often when connections cannot be accepted
OPEN_ROUTES = frozenset({"ServerLive", "ServerReady", "ModelReady"})  # --open-health: probes without a token
INFER_ROUTE = "ModelInfer"
METHOD_PREFIX = "/v2/rest/"  # how a route is named to on_refused (gRPC's "/service/Method")
_DENIED = "missing or invalid credentials: send 'Authorization: Bearer <token>'"


class HttpError(ServingError):
    """A ServingError whose HTTP status is not the code's own (413, 415, 408): counted under ``code``."""

    def __init__(self, code: Status, http_status: int, message: str) -> None:
        super().__init__(code, message)
        self.http_status = http_status


def http_status(exc: ServingError) -> int:
    return exc.http_status if isinstance(exc, HttpError) else HTTP_STATUS[exc.code]


def _json(doc, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An error as the REST form sends it: the HTTP status and ``{"error": message}``."""
    response = _json({"error": message}, status)
    if headers:
        response.headers.update(headers)
    return response


class _Watched(asyncio.Protocol):
    """One REST connection: aiohttp's protocol, watched. ``ConnectionWatch`` closes it once it has had no request
    in a handler for the idle timeout (headers that never complete, a keep-alive connection left open)."""

    def __init__(self, inner: asyncio.Protocol, watch: ConnectionWatch) -> None:
        self.inner, self.watch = inner, watch
        self.transport: asyncio.Transport | None = None
        self.busy = 0  # requests of this connection in a handler now
        self.idle_since = 0.0
        self.writing = 0  # responses of this connection being written now (after their handler)
        self.unsent = -1  # while writing: the bytes waiting in the transport at the last check
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.watch.opened(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.watch.closed(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class ConnectionWatch:
    """The REST port's connections: at most ``limit`` open (a newcomer past it is answered 503 and closed, before
    it can hold a file descriptor the gRPC port needs too), and each closed once it has had no request in a
    handler for ``idle_timeout_s``: aiohttp has no timeout on headers that never complete, and its keep-alive
    timer restarts at every byte, so a client trickling header bytes would hold its connection forever."""

    REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n%s")

    def __init__(self, limit: int, idle_timeout_s: float) -> None:
        self.limit, self.idle_timeout_s = limit, idle_timeout_s
        self.open: dict[object, _Watched] = {}  # by transport
        self.pending = 0  # accepted, not yet open (a TLS handshake in progress)
        self.refused = 0

    def full(self) -> bool:
        return len(self.open) + self.pending >= self.limit

    def refuse(self, conn: socket.socket, plain: bool) -> None:
        """Turn away a connection just accepted: a 503 that says why over plain HTTP (over TLS nothing can be said
        before a handshake, which is what the limit spares), then close."""
        self.refused += 1
        if plain:
            body = orjson.dumps({"error": f"the REST port has {self.limit} connections open, its limit "
                                          f"(--http-max-connections); retry later"})
            with contextlib.suppress(OSError):
                conn.send(self.REFUSAL % (len(body), body))
                conn.shutdown(socket.SHUT_WR)
        conn.close()

    def opened(self, conn: _Watched) -> None:
        """A connection accepted earlier is set up (after its TLS handshake): from pending to open, watched."""
        assert conn.transport is not None
        self.pending -= 1
        self.open[conn.transport] = conn
        self._arm(conn)

    def closed(self, conn: _Watched) -> None:
        if self.open.get(conn.transport) is conn:
            del self.open[conn.transport]
        if conn.timer is not None:
            conn.timer.cancel()

    def begin(self, transport) -> None:
        """A request of the connection of ``transport`` entered a handler."""
        conn = self.open.get(transport)
        if conn is not None:
            conn.busy += 1

    def end(self, transport) -> None:
        """A request's handler ended without a response to write."""
        conn = self.open.get(transport)
        if conn is not None:
            conn.busy -= 1
            conn.idle_since = asyncio.get_running_loop().time()

    def end_after(self, response: web.StreamResponse, transport) -> None:
        """A request's handler returned ``response``: the connection is writing it (aiohttp does, after the
        handler) until its end has been written or writing failed."""
        conn = self.open.get(transport)
        if conn is None:
            return
        conn.busy -= 1
        conn.writing += 1
        conn.unsent = -1
        write_eof = response.write_eof

        async def written(data: bytes = b"") -> None:
            try:
                await write_eof(data)
            finally:
                conn.writing -= 1
                conn.idle_since = asyncio.get_running_loop().time()

        response.write_eof = written  # type: ignore[method-assign]

    def _arm(self, conn: _Watched) -> None:
        loop = asyncio.get_running_loop()
        conn.idle_since = loop.time()

        def check() -> None:
            # A response being written is not idleness while the client reads it: each bit of progress gives it
            # another timeout; a client that stops reading is closed like an idle one.
            if conn.writing and conn.transport is not None:
                unsent = _unsent(conn.transport)
                if unsent != conn.unsent:
                    conn.unsent = unsent
                    conn.idle_since = loop.time()
            due = conn.idle_since + self.idle_timeout_s
            if conn.busy or loop.time() < due:
                conn.timer = loop.call_at(max(due, loop.time() + self.idle_timeout_s / 4) if conn.busy else due,
                                          check)
            elif conn.transport is not None:
                conn.transport.close()

        conn.timer = loop.call_at(conn.idle_since + self.idle_timeout_s, check)


def _unsent(transport: asyncio.BaseTransport) -> int:
    """Bytes written to ``transport`` that the peer has not taken yet: in its buffer and, on Linux, in the kernel's
    send queue (which is what drains as the client reads; the transport's own buffer moves only in large steps)."""
    unsent = transport.get_write_buffer_size() if isinstance(transport, asyncio.WriteTransport) else 0
    sock = transport.get_extra_info("socket")
    if sock is not None and hasattr(termios, "TIOCOUTQ"):
        with contextlib.suppress(OSError, ValueError):
            unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return unsent


class RestServer:
    """An aiohttp server for the REST form. Construct it inside the event loop that will run it; ``start`` binds
    and serves, ``stop`` closes. ``on_refused(code_name, method)`` hears of each request refused before its
    handler ran (a bad token, the RPC limit), as GrpcServer's does. ``shares_port``: one of a supervisor's
    processes, which share its port (SO_REUSEPORT)."""

    def __init__(self, settings: Settings, control: ControlService, inference: InferenceService,
                 limiter: RpcLimiter, shares_port: bool, on_refused: Callable[[str, str], None]) -> None:
        self.settings = settings
        self.control = control
        self.inference = inference
        self.limiter = limiter
        self.shares_port = shares_port
        self._on_refused = on_refused
        self._tokens = (security.BearerTokens(security.load_tokens(settings.auth_token_file))
                        if settings.auth_token_file else None)
        self._ssl = security.server_ssl_context(settings.tls_cert or None, settings.tls_key or None,
                                                settings.tls_client_ca or None)
        # JSON tensors become Python numbers first (several times their text's size), and parsing holds the
        # interpreter: one --max-json-bytes' worth at a time.
        self._json_budget = ByteBudget(settings.max_json_bytes, "REST JSON body", "--max-json-bytes")
        self.app = web.Application(middlewares=[self._guard], client_max_size=settings.max_message_bytes)
        self._rpc_of: dict[web.AbstractRoute, str] = {}  # each route's name: the RPC it is the REST form of
        self._add_routes()
        self._runner: web.AppRunner | None = None
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connecting: set[asyncio.Task[None]] = set()
        self._accept_warned = -ACCEPT_WARN_S
        self.connections = ConnectionWatch(settings.http_max_connections, settings.http_timeout_s)
        self.in_progress = 0  # requests in a handler (the drain waits for them too: a body may still be arriving)

    @property
    def secure(self) -> bool:
        return self._ssl is not None

    def _add_routes(self) -> None:
        model = "/v2/models/{model}"
        versioned = "/v2/models/{model}/versions/{version}"
        routes: list[tuple[str, str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
            ("GET", "/v2/health/live", "ServerLive", self._server_live),
            ("GET", "/v2/health/ready", "ServerReady", self._server_ready),
            ("GET", "/v2", "ServerMetadata", self._server_metadata),
            ("GET", "/v2/models/stats", "ModelStatistics", self._statistics),  # before {model} would take it
            ("GET", "/v2/systemsharedmemory/status", "SystemSharedMemoryStatus", self._shm_status),
            ("GET", "/v2/systemsharedmemory/region/{region}/status", "SystemSharedMemoryStatus", self._shm_status),
            ("POST", "/v2/systemsharedmemory/region/{region}/register", "SystemSharedMemoryRegister",
             self._shm_register),
            ("POST", "/v2/systemsharedmemory/unregister", "SystemSharedMemoryUnregister", self._shm_unregister),
            ("POST", "/v2/systemsharedmemory/region/{region}/unregister", "SystemSharedMemoryUnregister",
             self._shm_unregister),
            ("GET", "/v2/cudasharedmemory/status", "CudaSharedMemoryStatus", self._cuda_shm_status),
            ("GET", "/v2/cudasharedmemory/region/{region}/status", "CudaSharedMemoryStatus", self._cuda_shm_status),
            ("POST", "/v2/cudasharedmemory/region/{region}/register", "CudaSharedMemoryRegister",
             self._cuda_shm_register),
            ("POST", "/v2/cudasharedmemory/unregister", "CudaSharedMemoryUnregister", self._cuda_shm_unregister),
            ("POST", "/v2/cudasharedmemory/region/{region}/unregister", "CudaSharedMemoryUnregister",
             self._cuda_shm_unregister),
        ]
        for prefix in (model, versioned):
            routes += [
                ("GET", prefix, "ModelMetadata", self._model_metadata),
                ("GET", f"{prefix}/ready", "ModelReady", self._model_ready),
                ("GET", f"{prefix}/config", "ModelConfig", self._model_config),
                ("GET", f"{prefix}/stats", "ModelStatistics", self._statistics),
                ("POST", f"{prefix}/infer", INFER_ROUTE, self._infer),
            ]
        for method, path, rpc, handler in routes:
            route = self.app.router.add_route(method, path, handler, expect_handler=self._expect)
            self._rpc_of[route] = rpc

    # --- lifecycle ---------------------------------------------------------------

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port) and serve; the port bound."""
        self._runner = web.AppRunner(
            self.app, handle_signals=False, access_log=None,
            auto_decompress=False,  # a compressed body is refused unread (415), never inflated
            handler_cancellation=True,  # a client that goes away cancels its request, as on gRPC
            # The drain has waited for every accepted request by the time the server stops: what is left (a body
            # still arriving, a probe) is given this long.
            shutdown_timeout=1.0)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        family, bare = bind_address(host)
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.shares_port:  # one of a supervisor's processes, which share its port
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            listener.bind((bare, port))
            listener.listen(1024)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept(listener, lambda: _Watched(server(), self.connections)))
        return listener.getsockname()[1]

    async def _accept(self, listener: socket.socket, protocol: Callable[[], asyncio.Protocol]) -> None:
        """Accept connections while there is room (``ConnectionWatch``: connections being set up, a TLS
        handshake among them, count as well): past --http-max-connections a newcomer is refused at once, before a
        handshake can hold its descriptor. When the process is out of descriptors (or memory), accepting waits a
        moment and says so once in a while, not at every try."""
        loop = asyncio.get_running_loop()
        watch = self.connections
        handshake_s = min(self.settings.http_timeout_s, TLS_HANDSHAKE_S)
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if loop.time() - self._accept_warned > ACCEPT_WARN_S:
                    self._accept_warned = loop.time()
                    log.warning("the REST port cannot accept connections: %s (--http-max-connections %d; the "
                                "process's descriptors may be exhausted)", exc.strerror or exc, watch.limit)
                await asyncio.sleep(0.05)
                continue
            if watch.full():
                watch.refuse(conn, plain=self._ssl is None)
                continue
            watch.pending += 1
            task = asyncio.create_task(self._connect(conn, protocol, handshake_s))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket, protocol: Callable[[], asyncio.Protocol], handshake_s: float) -> None:
        """Set a connection up (``ConnectionWatch.opened`` takes it from pending to open once its protocol runs)."""
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                protocol, conn, ssl=self._ssl, ssl_handshake_timeout=handshake_s if self._ssl is not None else None)
        except (OSError, asyncio.TimeoutError, ssl.SSLError, asyncio.CancelledError) as exc:
            conn.close()  # a handshake that failed or timed out, or the server stopping
            self.connections.pending -= 1
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def stop(self) -> None:
        """Stop accepting connections and close them."""
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        for task in list(self._connecting):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- the edge: tokens, the RPC limit, errors ---------------------------------

    def _denied(self, request: web.Request, rpc: str | None) -> bool:
        """Whether the request lacks an accepted bearer token where one is needed (then on_refused hears of it)."""
        if self._tokens is None or (self.settings.open_health and rpc in OPEN_ROUTES) \
                or self._tokens.admits(request.headers.get("Authorization")):
            return False
        self._on_refused(Status.UNAUTHENTICATED.name, f"{METHOD_PREFIX}{rpc or 'unknown'}")
        return True

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: the client waits to send its body until told to. A request that will be
        refused (no token, a body over --max-message-bytes) is refused now, so that the body is never sent."""
        expect = request.headers.get("Expect", "").lower()
        if request.version < HttpVersion11:  # (HTTP/1.0 has no interim responses)
            return None
        if expect != "100-continue":
            return error_response(417, f"Expect: {shown(expect)} is not understood (only 100-continue is)")
        rpc = self._rpc_of.get(request.match_info.route)
        if self._denied(request, rpc):
            return error_response(401, _DENIED, {"WWW-Authenticate": "Bearer", "Connection": "close"})
        length, limit = request.content_length, self.settings.max_message_bytes
        json_limit = self.settings.max_json_bytes
        if rpc == INFER_ROUTE and length is not None and length > json_limit \
                and rest_codec.HEADER_LENGTH not in request.headers:  # all of it JSON
            limit, flag = json_limit, "--max-json-bytes"
        else:
            flag = "--max-message-bytes"
        if length is not None and length > limit:
            if rpc == INFER_ROUTE:
                self._refused(request, Status.RESOURCE_EXHAUSTED, 413, asyncio.get_running_loop().time())
            return error_response(413, _too_large(length, limit, flag).message, {"Connection": "close"})
        # What aiohttp's own expect handler does: the interim response, not counted as the response's output.
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
        return None

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        rpc = self._rpc_of.get(request.match_info.route)
        if self._denied(request, rpc):  # an unknown route too: no route list leaks
            return error_response(401, _DENIED, {"WWW-Authenticate": "Bearer"})
        method = f"{METHOD_PREFIX}{rpc or 'unknown'}"
        try:
            call = self.limiter.admit(_peer(request), method)
        except ServingError as exc:
            return error_response(HTTP_STATUS[exc.code], exc.message, {"Connection": "close"})
        self.in_progress += 1
        transport = request.transport
        self.connections.begin(transport)
        try:
            with holding(call):  # (for _read_body)
                response = await handler(request)
        except ServingError as exc:
            # (a body ended for another call is left unread: the connection cannot carry another request)
            response = error_response(http_status(exc), exc.message,
                                      {"Connection": "close"} if call.preempted is not None else None)
        except web.HTTPException as exc:
            if exc.status < 400:
                self.connections.end(transport)
                raise
            response = error_response(exc.status, f"{request.method} {shown(request.path)}: {exc.reason}")
        except BaseException:
            self.connections.end(transport)
            raise
        finally:
            self.in_progress -= 1
            self.limiter.release(call)
        # The connection is busy until the response has been written (aiohttp writes it after this returns): a
        # client reading a large answer slowly is not idle.
        self.connections.end_after(response, transport)
        if call.preempted is not None:  # its body is still coming: the connection ends with the 503
            _close_after(response, request.protocol)
        return response

    # --- health, metadata, configuration, statistics -----------------------------

    # Health: the status says it (200, or 400 when not: tritonclient reads that), and the body says it too
    # ({"live": true}: KServe's client reads that when the status is 2xx, and raises on any other).
    async def _server_live(self, request: web.Request) -> web.Response:
        live = (await self.control.ServerLive(pb.ServerLiveRequest())).live
        return _json({"live": live}, 200 if live else 400)

    async def _server_ready(self, request: web.Request) -> web.Response:
        ready = (await self.control.ServerReady(pb.ServerReadyRequest())).ready
        return _json({"ready": ready}, 200 if ready else 400)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return _json(rest_codec.message_json(await self.control.ServerMetadata(pb.ServerMetadataRequest())))

    async def _model_ready(self, request: web.Request) -> web.Response:
        names = _model(request)
        ready = (await self.control.ModelReady(pb.ModelReadyRequest(**names))).ready
        return _json({"name": names["name"], "ready": ready}, 200 if ready else 400)

    async def _model_metadata(self, request: web.Request) -> web.Response:
        response = await self.control.ModelMetadata(pb.ModelMetadataRequest(**_model(request)))
        return _json(rest_codec.message_json(response))

    async def _model_config(self, request: web.Request) -> web.Response:
        # Triton's REST form sends the configuration itself, not wrapped in {"config": ...}.
        response = await self.control.ModelConfig(pb.ModelConfigRequest(**_model(request)))
        return _json(rest_codec.message_json(response.config))

    async def _statistics(self, request: web.Request) -> web.Response:
        names = _model(request) if "model" in request.match_info else {}
        response = await self.control.ModelStatistics(pb.ModelStatisticsRequest(**names))
        return _json(rest_codec.message_json(response))

    # --- system shared memory --------------------------------------------------------

    async def _shm_status(self, request: web.Request) -> web.Response:
        response = await self.control.SystemSharedMemoryStatus(
            pb.SystemSharedMemoryStatusRequest(name=request.match_info.get("region", "")))
        # Triton's REST form: a list of the regions, not the gRPC map.
        return _json([rest_codec.message_json(region) for region in response.regions.values()])

    async def _shm_register(self, request: web.Request) -> web.Response:
        body = await self._small_json(request)
        key = body.get("key")
        offset, byte_size = body.get("offset", 0), body.get("byte_size")
        if not isinstance(key, str):
            raise invalid("the register body's 'key' must be a string (the segment's name)")
        for name, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
                raise invalid(f"the register body's '{name}' must be an integer >= 0")
        await self.control.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
            name=request.match_info["region"], key=key, offset=offset, byte_size=byte_size))
        return web.Response(status=200)

    async def _shm_unregister(self, request: web.Request) -> web.Response:
        await self.control.SystemSharedMemoryUnregister(
            pb.SystemSharedMemoryUnregisterRequest(name=request.match_info.get("region", "")))
        return web.Response(status=200)

    # --- CUDA shared memory ----------------------------------------------------------

    async def _cuda_shm_status(self, request: web.Request) -> web.Response:
        response = await self.control.CudaSharedMemoryStatus(
            pb.CudaSharedMemoryStatusRequest(name=request.match_info.get("region", "")))
        return _json([rest_codec.message_json(region) for region in response.regions.values()])

    async def _cuda_shm_register(self, request: web.Request) -> web.Response:
        body = await self._small_json(request)
        handle, device_id, byte_size = body.get("raw_handle"), body.get("device_id", 0), body.get("byte_size")
        encoded = handle.get("b64") if isinstance(handle, dict) else None
        if not isinstance(encoded, str):
            raise invalid("the register body's 'raw_handle' must be {\"b64\": \"<the handle's bytes in base64>\"}")
        try:
            raw = base64.b64decode(encoded, validate=True)
        except ValueError:
            raise invalid("the register body's 'raw_handle.b64' is not base64") from None
        for name, value, low in (("device_id", device_id, -(1 << 63)), ("byte_size", byte_size, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value < 1 << 63:
                raise invalid(f"the register body's '{name}' must be an integer" + (" >= 0" if low == 0 else ""))
        await self.control.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(
            name=request.match_info["region"], raw_handle=raw, device_id=device_id, byte_size=byte_size))
        return web.Response(status=200)

    async def _cuda_shm_unregister(self, request: web.Request) -> web.Response:
        await self.control.CudaSharedMemoryUnregister(
            pb.CudaSharedMemoryUnregisterRequest(name=request.match_info.get("region", "")))
        return web.Response(status=200)

    async def _small_json(self, request: web.Request) -> dict:
        body = await self._read_body(request, limit=JSON_INLINE_BYTES, flag="the register body's own limit")
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise invalid("the request body is not valid JSON") from None
        if not isinstance(doc, dict):
            raise invalid("the request body must be a JSON object")
        return doc

    # --- inference -------------------------------------------------------------------

    async def _infer(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        names = _model(request)
        started = loop.time()
        header_length = request.headers.get(rest_codec.HEADER_LENGTH)
        try:
            body = await self._read_body(request)
        except ServingError as exc:  # refused before a request could be read from it: counted here
            self._refused(request, exc.code, http_status(exc), started)
            raise
        except (asyncio.CancelledError, ConnectionError):  # the client went away while its body arrived
            self._refused(request, Status.CANCELLED, HTTP_STATUS[Status.CANCELLED], started)
            raise asyncio.CancelledError from None
        try:
            json_bytes = rest_codec.json_length(header_length, len(body))
        except ServingError:
            json_bytes = 0  # parse_infer refuses it again, inside the inference path, which counts it
        if json_bytes > self.settings.max_json_bytes:
            self._refused(request, Status.RESOURCE_EXHAUSTED, 413, started)
            raise HttpError(Status.RESOURCE_EXHAUSTED, 413, f"the request's JSON is {json_bytes} bytes; at most "
                            f"{self.settings.max_json_bytes} are accepted (--max-json-bytes): send large tensors as "
                            f"binary data (Triton's binary extension), which the server reads without parsing")
        try:
            if json_bytes <= JSON_INLINE_BYTES:
                decoded = rest_codec.parse_infer(body, header_length, names["name"], names["version"])
            else:
                await self._json_budget.acquire(json_bytes)
                try:
                    decoded = await asyncio.to_thread(rest_codec.parse_infer, body, header_length, names["name"],
                                                      names["version"])
                finally:
                    self._json_budget.release(json_bytes)
        except ServingError as exc:  # answered by the inference path, so that it is counted as every request is
            parsed: InferRequest | MalformedRequest = MalformedRequest("REST inference request",
                                                                                  len(body), exc.message)
            binary_outputs: frozenset[str] | None = frozenset()
            timeout_s = None
        else:
            parsed, binary_outputs, timeout_s = decoded.request, decoded.binary_outputs, decoded.timeout_s
        deadline = None if timeout_s is None else loop.time() + timeout_s
        call = HttpCall(request.match_info.route.resource.canonical if request.match_info.route.resource else "",
                        request.headers, _peer(request), _infer_status) if self.inference.observed else None
        response = await self.inference.infer(parsed, deadline, call=call)
        body_out, json_length = rest_codec.encode_infer(response, binary_outputs)
        if json_length is None:
            return web.Response(body=body_out, content_type="application/json")
        return web.Response(body=body_out, content_type="application/octet-stream",
                            headers={rest_codec.HEADER_LENGTH: str(json_length)})

    def _refused(self, request: web.Request, code: Status, status: int, started: float) -> None:
        """Count (and access-log) an inference request whose body could not be read: it never reached
        ``infer``, which counts every other one."""
        self.inference.metrics.count_request(code.name)
        if self.inference.access_log is not None:
            self.inference.access_log.record(
                transport="http", method=f"POST {request.path}"[:200], code=code.name, http_status=status,
                duration_ms=(asyncio.get_running_loop().time() - started) * 1e3, peer=_peer(request))

    async def _read_body(self, request: web.Request, limit: int | None = None,
                         flag: str = "--max-message-bytes") -> bytearray:
        """The request's body, in one buffer that grows with the chunks as they arrive (never the announced length
        up front). 413 over ``limit`` (``flag``'s), 415 if compressed, 408 if it sends
        nothing for --http-timeout-s or arrives slower than MIN_BODY_BYTES_PER_S beyond that, 400 if short."""
        limit = self.settings.max_message_bytes if limit is None else limit
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            raise HttpError(Status.UNIMPLEMENTED, 415, f"Content-Encoding '{shown(encoding)}' is not accepted: send "
                                                       f"the body uncompressed")
        length = request.content_length
        if length is not None and length > limit:
            raise _too_large(length, limit, flag)
        # A body may pause for --http-timeout-s, and beyond that must keep arriving at MIN_BODY_BYTES_PER_S on
        # average (of the bytes received so far): one that trickles in holds an RPC slot, which gRPC's calls
        # count on too, for a bounded time; and, while the server is full, one that falls PREEMPT_IDLE_S behind that
        # rate gives its slot to a newcomer (admission.py): then the read is cancelled (wherever it is: a read that
        # has just returned its last chunk too) and the request answered 503, here.
        call = current_call()
        if call is not None:
            call.reading()
            call.on_preempt = functools.partial(_cancel, asyncio.current_task())
        try:
            body = await self._read_chunks(request, limit, flag, call)
        except asyncio.CancelledError:
            if call is None or call.preempted is None:
                raise
            raise _ended_for_newcomer(call) from None
        finally:
            if call is not None:
                call.read()
                call.on_preempt = None
        if call is not None and call.preempted is not None:  # (its cancel dropped as the last read returned)
            raise _ended_for_newcomer(call)
        return body

    async def _read_chunks(self, request: web.Request, limit: int, flag: str, call: Call | None) -> bytearray:
        """``_read_body``'s reading: the buffer grows with what arrives (memory follows the bytes received, not the
        bytes announced)."""
        length = request.content_length
        buffer = bytearray()
        received = 0
        loop = asyncio.get_running_loop()
        timeout_s = self.settings.http_timeout_s
        started = loop.time()
        while True:
            deadline = started + timeout_s + received / MIN_BODY_BYTES_PER_S
            try:
                chunk = await asyncio.wait_for(request.content.readany(),
                                               max(0.0, min(timeout_s, deadline - loop.time())))
            except asyncio.TimeoutError:
                slow = loop.time() >= deadline
                raise HttpError(Status.DEADLINE_EXCEEDED, 408, (
                    f"the body arrived slower than {MIN_BODY_BYTES_PER_S / 1e6:g} MB/s (beyond --http-timeout-s "
                    f"{timeout_s:g} s): {received} bytes" if slow else
                    f"the body sent nothing for {timeout_s:g} s (--http-timeout-s) after {received} bytes")) from None
            if not chunk:
                break
            end = received + len(chunk)
            if end > (limit if length is None else length):  # (aiohttp stops at Content-Length: a safeguard)
                raise _too_large(end, limit, flag) if length is None else invalid(
                    f"the body is longer than its Content-Length {length}")
            buffer += chunk
            received = end
            if call is not None:
                if call.preempted is not None:  # ended for a newcomer, its cancel dropped (_ended_for_newcomer)
                    raise _ended_for_newcomer(call)
                call.received = end
        if length is not None and received != length:
            raise invalid(f"the body ended after {received} of its {length} bytes (Content-Length)")
        return buffer


def _close_after(response: web.StreamResponse, protocol) -> None:
    """Close the connection once ``response`` has been written (the rest of an unread body is not read first, as
    aiohttp would for up to its lingering time)."""
    write_eof = response.write_eof

    async def then_close(data: bytes = b"") -> None:
        try:
            await write_eof(data)
        finally:
            protocol.force_close()

    response.write_eof = then_close  # type: ignore[method-assign]


def _cancel(task: asyncio.Task | None, reason: str) -> None:
    if task is not None:
        task.cancel()


def _ended_for_newcomer(call: Call) -> HttpError:
    """The 503 of a request whose body was ended for a newcomer (``call.preempted`` says why), its read's cancel
    taken back. The cancel may have come as a read returned, where Python 3.11's wait_for drops it: the read then
    goes on, and the preemption is seen at the next chunk or at the body's end instead."""
    task = asyncio.current_task()
    if task is not None and getattr(task, "cancelling", lambda: 0)():  # (Python 3.11+ counts cancellations)
        task.uncancel()
    return HttpError(Status.UNAVAILABLE, 503, call.preempted or "")


def _infer_status(code: Status) -> int:
    """The HTTP status an inference request that ended with ``code`` inside the inference path is answered with
    (its trace and access record say it)."""
    return HTTP_STATUS[code]


def _too_large(nbytes: int, limit: int, flag: str) -> HttpError:
    return HttpError(Status.RESOURCE_EXHAUSTED, 413, f"the request body is {nbytes} bytes; at most {limit} are "
                                                     f"accepted ({flag})")


def _model(request: web.Request) -> dict[str, str]:
    return {"name": request.match_info["model"], "version": request.match_info.get("version", "")}


def _peer(request: web.Request) -> str:
    """One peer per connection, as gRPC names its peers (the limiter's fair share is per connection)."""
    peername = request.transport.get_extra_info("peername") if request.transport is not None else None
    if isinstance(peername, tuple) and len(peername) >= 2:
        return f"http:{peername[0]}:{peername[1]}"
    return f"http:{request.remote or ''}"
