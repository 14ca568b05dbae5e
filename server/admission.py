"""Admission of RPCs: the server-wide limit on RPCs in progress, applied to every method the server registers.

gRPC's own limit (``maximum_concurrent_rpcs``) takes a slot as soon as a call's headers arrive, before any
interceptor runs, so calls that are about to be refused (a missing token) and calls nobody will ever finish
(idle streams of a stranger) count against everyone. Here the limit wraps the method handlers themselves:
the token check runs first (an interceptor), and a call holds a slot only while its handler runs. What a
single connection can hold is bounded by HTTP/2 (``grpc.max_concurrent_streams``, set from
``--max-streams-per-connection``), what an idle stream can hold by ``--stream-idle-timeout-s``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping

import grpc

from .errors import exhausted


class RpcLimiter:
    """At most ``limit`` RPCs in progress, over every method wrapped with ``handler()``. A call over the limit is
    answered RESOURCE_EXHAUSTED, naming the limit, and ``on_refused(method)`` is told (for its metrics)."""

    def __init__(self, limit: int, on_refused: Callable[[str], None] | None = None) -> None:
        self.limit = limit
        self.active = 0
        self._on_refused = on_refused or (lambda method: None)
        self._refusal = exhausted(f"the server has {limit} RPCs in progress, its limit (--max-concurrent-rpcs); "
                                  f"retry later")

    def handler(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with its behaviour counted against the limit (same kind, same (de)serialisers)."""
        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary), **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(method, handler.stream_unary), **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._streaming(method, handler.unary_stream), **kwargs)
        return grpc.stream_stream_rpc_method_handler(self._streaming(method, handler.stream_stream), **kwargs)

    def service(self, name: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
        """The generic handler of service ``name`` with each of its methods counted against the limit."""
        return grpc.method_handlers_generic_handler(
            name, {m: self.handler(f"/{name}/{m}", h) for m, h in handlers.items()})

    async def _refuse(self, method: str, context) -> None:
        self._on_refused(method)
        await context.abort(self._refusal.code, self._refusal.message)

    def _unary(self, method: str, behavior):
        async def limited(request, context):
            if self.active >= self.limit:
                await self._refuse(method, context)
            self.active += 1
            try:
                return await behavior(request, context)
            finally:
                self.active -= 1

        return limited

    def _streaming(self, method: str, behavior):
        async def limited(request, context):
            if self.active >= self.limit:
                await self._refuse(method, context)
            self.active += 1
            try:
                result = behavior(request, context)
                if hasattr(result, "__aiter__"):  # an async generator: pass its messages on
                    async for response in result:
                        yield response
                else:  # a coroutine that writes with context.write (grpc_health's Watch)
                    await result
            finally:
                self.active -= 1

        return limited


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
