"""Admission of RPCs: the server-wide limit on RPCs in progress, applied to every method the server registers,
and a fair share of it for every connection.

gRPC's own limit (``maximum_concurrent_rpcs``) takes a slot as soon as a call's headers arrive, before any
interceptor runs, so calls that are about to be refused (a missing token) and calls nobody will ever finish
(idle streams of a stranger) count against everyone. Here the limit wraps the method handlers themselves:
the token check runs first (an interceptor), and a call holds a slot only while its handler runs. What a
single connection can hold is bounded by HTTP/2 (``grpc.max_concurrent_streams``, set from
``--max-streams-per-connection``), what an idle stream can hold by ``--stream-idle-timeout-s``.

When every slot is taken, a newcomer is not refused while some connection holds at least two slots more
than the newcomer's own and one of them is a stream that has been idle (nothing in progress, no message in
or out) for PREEMPT_IDLE_S: the longest idle such stream of the connection holding the most is ended with
UNAVAILABLE (clients retry that code) and the newcomer takes its slot. A newcomer whose connection holds as many
as the others (or one fewer: a swap would only invite the same in return) ends a stream only once it has been
idle for IDLE_STREAM_YIELD_S, the longest idle of all: so idle streams, however they are spread over
connections, cannot lock anyone out for their idle timeout, and a connection keeps what it uses: a call in
progress is never ended for another.

A request still arriving (``Call.reading``: a REST body, counted as its bytes come in; a ModelInfer call's
message, of which gRPC shows nothing until the whole of it has come) is ended for any newcomer while the server is
full once it is PREEMPT_IDLE_S behind MIN_BODY_BYTES_PER_S, counted from when its reading began (a body that stalls
or trickles falls behind; one that keeps up has credit for a pause), whatever its connection holds; the one
furthest behind goes first, answered UNAVAILABLE (REST: 503), and may be sent again. Such a request holds a slot
it hardly uses, and a connection holds at most one (HTTP/1.1) or needs only one, so slow requests spread over many
connections (no more than a newcomer's share each) would otherwise lock everyone out, for --http-timeout-s or (a
ModelInfer without a deadline) for good. To hold the slots a client must now send a REST body at MIN_BODY_BYTES_PER_S
on each, and a ModelInfer's message must be in PREEMPT_IDLE_S after its call began, at whatever rate it came: so
while the server is full, a large message arriving slowly may be ended for a newcomer (the README says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping

import grpc

from ..core.errors import ServingError, exhausted
from .status import abort

# A stream idle for this long may be ended to make room for another connection's call when the server is full:
# longer than a streaming client takes between its messages, short enough that streams opened in a burst (or
# reopened again and again) keep others out for no longer than this.
PREEMPT_IDLE_S = 0.1
# A stream idle this long is ended for any newcomer while the server is full, whatever its connection holds: long
# enough that a client sending on its stream now and then keeps it, short enough that idle streams spread over
# many connections (one each) keep nobody out for long.
IDLE_STREAM_YIELD_S = 1.0
# The slowest average a request's body may arrive at: one behind it while the server is full may be ended for
# another call (above), and beyond --http-timeout-s one behind it is refused (REST: 408).
MIN_BODY_BYTES_PER_S = 1e6


class Call:
    """A call holding a slot, as the limiter sees it. A streaming call's handler may describe itself better than
    the default (idle since its last message; ended by cancelling it) with ``current_call()``: ``busy`` (it has
    work in progress), ``on_preempt`` (end it gracefully with UNAVAILABLE and the reason) and ``touch()``. A call
    whose request is still arriving says so with ``reading()`` (and its bytes in ``received``), then ``read()``."""

    __slots__ = ("_arriving", "busy", "last_active", "on_preempt", "peer", "preempted", "read_since", "received",
                 "streaming", "task")

    def __init__(self, peer: str, streaming: bool, now: float, arriving: set[Call] | None = None) -> None:
        self.peer, self.streaming = peer, streaming
        self._arriving = arriving if arriving is not None else set()  # the limiter's calls whose request arrives
        self.last_active = now
        self.busy: Callable[[], bool] = lambda: False
        self.on_preempt: Callable[[str], None] | None = None
        self.preempted: str | None = None  # the reason, once it was ended for another call
        # While its request arrives: since when, and the bytes so far (see the module's docstring).
        self.read_since: float | None = None
        self.received = 0
        self.task = asyncio.current_task()

    def touch(self) -> None:
        self.last_active = asyncio.get_running_loop().time()

    def reading(self) -> None:
        """Its request begins to arrive now (count the bytes that come in ``received``); ``read()`` once it has."""
        self.read_since, self.received = asyncio.get_running_loop().time(), 0
        self._arriving.add(self)

    def read(self) -> None:
        """Its request has arrived (or stopped arriving): no longer ended for another as a slow one."""
        self.read_since = None
        self._arriving.discard(self)

    def behind(self, now: float) -> float:
        """How far its request is behind MIN_BODY_BYTES_PER_S, in seconds (-inf unless one is arriving)."""
        if self.read_since is None:
            return float("-inf")
        return now - self.read_since - self.received / MIN_BODY_BYTES_PER_S

    def idle_since(self) -> float | None:
        """When it last did something, if it may be ended for another call now (an idle stream); else None."""
        return None if not self.streaming or self.busy() else self.last_active


_current: contextvars.ContextVar[Call | None] = contextvars.ContextVar("voxserve_admitted_call", default=None)


def current_call() -> Call | None:
    """The call the running handler holds its slot for (None outside a limited handler)."""
    return _current.get()


@contextlib.contextmanager
def holding(call: Call) -> Iterator[None]:
    """``call`` as the ``current_call()`` of the code run inside (a handler admitted with ``RpcLimiter.admit``
    directly, as the REST front end's are, in a task that may serve further requests)."""
    token = _current.set(call)
    try:
        yield
    finally:
        _current.reset(token)


class RpcLimiter:
    """At most ``limit`` RPCs in progress, over every method wrapped with ``handler()``, shared fairly between
    connections (see the module's docstring). A call over the limit is answered RESOURCE_EXHAUSTED, naming the
    limit, and ``on_refused(method)`` is told (for its metrics)."""

    def __init__(self, limit: int, on_refused: Callable[[str], None] | None = None,
                 peer_of: Callable[[grpc.aio.ServicerContext], str] | None = None, scope: str = "") -> None:
        self.limit = limit
        # Which client a gRPC call is (its connection): the call's peer, or who a native front end says it is.
        self._peer_of = peer_of or (lambda context: context.peer() or "")
        self.preempted = 0  # calls ended to make room for others
        self._by_peer: dict[str, set[Call]] = {}
        # The calls that may be ended for another, kept apart so that a refusal scans only them: streams, and
        # calls whose request is still arriving.
        self._streams: set[Call] = set()
        self._arriving: set[Call] = set()
        self._active = 0
        self._on_refused = on_refused or (lambda method: None)
        # ``scope``: what the limit bounds where several processes share the port ("front end": each applies it)
        self._refusal = exhausted(
            f"this {scope} has {limit} RPCs in progress, its limit (--max-concurrent-rpcs, each {scope}'s own); "
            f"retry later" if scope else
            f"the server has {limit} RPCs in progress, its limit (--max-concurrent-rpcs); retry later")

    @property
    def active(self) -> int:
        return self._active

    def handler(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with its behaviour counted against the limit (same kind, same (de)serialisers)."""
        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary), **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._awaiting_message(method, handler.stream_unary),
                                                        **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._streaming(method, handler.unary_stream), **kwargs)
        return grpc.stream_stream_rpc_method_handler(
            self._streaming(method, handler.stream_stream, reads=True), **kwargs)

    def service(self, name: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
        """The generic handler of service ``name`` with each of its methods counted against the limit."""
        return grpc.method_handlers_generic_handler(
            name, {m: self.handler(f"/{name}/{m}", h) for m, h in handlers.items()})

    def admit(self, peer: str, method: str, streaming: bool = False) -> Call:
        """Take a slot for a call of ``peer`` (one per connection) or raise the RESOURCE_EXHAUSTED refusal; give
        it back with ``release``. The gRPC handlers call it through ``handler()``, the REST front end directly."""
        if self._active >= self.limit and not self._preempt_for(peer):
            self._on_refused(method)
            raise self._refusal
        call = Call(peer, streaming, asyncio.get_running_loop().time(), self._arriving)
        self._by_peer.setdefault(peer, set()).add(call)
        if streaming:
            self._streams.add(call)
        self._active += 1
        return call

    async def _admit(self, method: str, context, streaming: bool) -> Call:
        try:
            return self.admit(self._peer_of(context), method, streaming)
        except ServingError as exc:
            await abort(context, exc)
            raise  # (abort raises)

    def release(self, call: Call) -> None:
        """Give back the slot ``call`` holds."""
        self._release(call)

    def _release(self, call: Call) -> None:
        if call.preempted is None:  # a preempted call gave its slot away already
            self._drop(call)

    def _drop(self, call: Call) -> None:
        held = self._by_peer[call.peer]
        held.discard(call)
        if not held:
            del self._by_peer[call.peer]
        self._streams.discard(call)
        call.read()
        self._active -= 1

    def _preempt_for(self, peer: str) -> bool:
        """End the request still arriving furthest behind (any connection's), or else the longest idle stream of the
        connection holding the most slots if that is at least two more than ``peer`` holds, or else the longest
        idle stream of all if idle for IDLE_STREAM_YIELD_S; True if a slot was freed so."""
        now = asyncio.get_running_loop().time()
        latest = now - PREEMPT_IDLE_S
        lag, slowest = max(((call.behind(now), call) for call in self._arriving), key=lambda pair: pair[0],
                           default=(0.0, None))
        if slowest is not None and lag >= PREEMPT_IDLE_S:
            self._end(slowest, (
                f"the server is at its limit of RPCs in progress (--max-concurrent-rpcs) and this request was still "
                f"arriving, slower than {MIN_BODY_BYTES_PER_S / 1e6:g} MB/s: it was ended for another client's call; "
                f"send it again"))
            return True
        mine = len(self._by_peer.get(peer, ()))
        for calls in sorted(self._by_peer.values(), key=len, reverse=True):
            if len(calls) <= mine + 1:  # a swap would only let the other end one of this one's in turn
                break
            idle = [(since, call) for call in calls if (since := call.idle_since()) is not None and since <= latest]
            if idle:
                self._end(min(idle, key=lambda pair: pair[0])[1], (
                    "the server is at its limit of RPCs in progress (--max-concurrent-rpcs) and this connection "
                    "held more than its share: this idle stream was ended for another client's call; open it again"))
                return True
        since, longest = min(((since, call) for call in self._streams if (since := call.idle_since()) is not None),
                             key=lambda pair: pair[0], default=(now, None))
        if longest is not None and since <= now - IDLE_STREAM_YIELD_S:
            self._end(longest, (
                f"the server is at its limit of RPCs in progress (--max-concurrent-rpcs) and this stream had been "
                f"idle for {IDLE_STREAM_YIELD_S:g} s: it was ended for another client's call; open it again"))
            return True
        return False

    def _end(self, victim: Call, reason: str) -> None:
        """Take ``victim``'s slot for another call and end it (gracefully where it said how) with ``reason``."""
        self._drop(victim)
        self.preempted += 1
        victim.preempted = reason
        if victim.on_preempt is not None:
            victim.on_preempt(reason)
        elif victim.task is not None:
            victim.task.cancel()

    def _unary(self, method: str, behavior):
        async def limited(request, context):
            call = await self._admit(method, context, streaming=False)
            try:
                return await behavior(request, context)
            finally:
                self._release(call)

        return limited

    def _awaiting_message(self, method: str, behavior):
        """A call that reads its one message itself (ModelInfer: admitted at its headers). Until the message has come
        (``in_progress()``, from the handler) it is a request still arriving, as a REST body is, of which no byte
        is seen (gRPC hands over whole messages): PREEMPT_IDLE_S after it began it may be ended for any newcomer
        while the server is full, so calls opened and left without a message lock nobody out, however many
        connections hold them; once the message is in, the call is never ended for another."""
        async def limited(request, context):
            call = await self._admit(method, context, streaming=False)
            call.reading()
            _current.set(call)  # the call's task is its own: nothing to reset
            try:
                return await behavior(request, context)
            except asyncio.CancelledError:
                await _ended_for_another(call, context)
            finally:
                self._release(call)

        return limited

    def _streaming(self, method: str, behavior, reads: bool = False):
        async def limited(request, context):
            call = await self._admit(method, context, streaming=True)
            _current.set(call)  # the call's task is its own: nothing to reset
            try:
                result = behavior(_touching(request, call) if reads else request, context)
                if hasattr(result, "__aiter__"):  # an async generator: pass its messages on
                    async for response in result:
                        yield response
                else:  # a coroutine that writes with context.write (grpc_health's Watch)
                    await result
            except asyncio.CancelledError:
                await _ended_for_another(call, context)
            finally:
                self._release(call)

        return limited


def in_progress() -> None:
    """The running handler's call has its work in hand (ModelInfer's message has come): never ended for another."""
    call = _current.get()
    if call is not None:
        call.read()


async def _ended_for_another(call: Call, context) -> None:
    """In a limited handler cancelled (raise on from here): a call whose slot went to another connection's (and that
    has no graceful ending of its own) is answered UNAVAILABLE with the reason; any other cancel goes on."""
    if call.preempted is None or call.on_preempt is not None:
        raise asyncio.CancelledError
    uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python 3.11+ counts cancellations
    if uncancel is not None:
        uncancel()
    await context.abort(grpc.StatusCode.UNAVAILABLE, call.preempted)


async def _touching(requests: AsyncIterator, call: Call) -> AsyncIterator:
    """``requests``, marking ``call`` active at each message."""
    async for request in requests:
        call.touch()
        yield request


class ByteBudget:
    """At most ``limit`` bytes held at once by the requests that acquired them (the server's private copies of
    shared-memory inputs). Requests wait for room in the order they asked; one that alone needs more than the
    limit is refused RESOURCE_EXHAUSTED at once. Event-loop only."""

    def __init__(self, limit: int, what: str, flag: str) -> None:
        self.limit, self.used = limit, 0
        self._what, self._flag = what, flag
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, nbytes: int) -> None:
        """Take ``nbytes``, waiting for room (a cancelled wait takes nothing); release them with ``release``."""
        if nbytes > self.limit:
            raise exhausted(f"{self._what} of {nbytes} bytes exceeds {self._flag} {self.limit}")
        if not self._waiters and self.used + nbytes <= self.limit:
            self.used += nbytes
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # room was granted as the wait was cancelled: hand it on
                self.release(nbytes)
            else:
                self._waiters.remove(entry)
                self._grant()  # a smaller request behind this one may fit now
            raise

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.limit:
            nbytes, waiter = self._waiters.popleft()
            if not waiter.done():
                self.used += nbytes
                waiter.set_result(None)
