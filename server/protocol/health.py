"""grpc.health.v1: grpc_health's servicer, with Watch streams that end.

The stock Watch never returns: an idle watcher holds an RPC slot for as long as it likes, and a drain waits
for it until the grace period runs out. Here a Watch ends once the server drains (after it has sent
NOT_SERVING) and after ``lifetime_s`` (``--stream-idle-timeout-s``: a watcher sends nothing after its one
request, so it is idle by definition), with UNAVAILABLE; the protocol's clients then watch again.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2

SERVING_STATUS = health_pb2.HealthCheckResponse


class HealthServicer(health.aio.HealthServicer):
    def __init__(self, lifetime_s: float = 0.0) -> None:
        super().__init__()
        self.lifetime_s = lifetime_s

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.lifetime_s if self.lifetime_s > 0 else None
        # One condition per service, kept while watched (the stock servicer deletes it when any watcher leaves,
        # stranding the others).
        condition = self._server_watchers[request.service]
        last = None
        async with condition:
            while True:
                status = self._server_status.get(request.service, SERVING_STATUS.SERVICE_UNKNOWN)
                if status != last:
                    await context.write(SERVING_STATUS(status=status))
                    last = status
                if self._gracefully_shutting_down:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
                remaining = None if end is None else end - loop.time()
                try:
                    if remaining is not None and remaining <= 0:
                        raise asyncio.TimeoutError
                    await asyncio.wait_for(condition.wait(), remaining)
                except asyncio.TimeoutError:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"watched for {self.lifetime_s:g} s (--stream-idle-timeout-s); watch again")
