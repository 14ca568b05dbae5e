"""The edge's one map from the server's statuses (``core.errors.Status``) to gRPC's codes."""

from __future__ import annotations

import grpc

from ..core.errors import ServingError, Status

_GRPC = {status: grpc.StatusCode[status.name] for status in Status}


def grpc_code(status: Status) -> grpc.StatusCode:
    return _GRPC[status]


async def abort(context: grpc.aio.ServicerContext, error: ServingError) -> None:
    """End the call with ``error``'s status and message (raises, as ``context.abort`` does)."""
    await context.abort(_GRPC[error.code], error.message)
