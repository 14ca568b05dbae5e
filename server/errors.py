"""Errors as values: a gRPC status code and one sentence naming the field, the value and the limit."""

from __future__ import annotations

import grpc

from .batching import DeadlineExceeded, QueueFull


class ServingError(Exception):
    """A request-level failure the client is told about with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ServingError({self.code.name}, {self.message!r})"


def invalid(message: str) -> ServingError:
    return ServingError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServingError:
    return ServingError(grpc.StatusCode.NOT_FOUND, message)


def exhausted(message: str) -> ServingError:
    return ServingError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> ServingError:
    return ServingError(grpc.StatusCode.UNAVAILABLE, message)


def unimplemented(message: str) -> ServingError:
    return ServingError(grpc.StatusCode.UNIMPLEMENTED, message)


def runner_error(exc: BaseException, model_name: str) -> ServingError | None:
    """The client-facing error for what the runner raises, or None for an unexpected failure."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, QueueFull):
        return unavailable(f"model '{model_name}' is overloaded: {exc}; retry later")
    if isinstance(exc, DeadlineExceeded):
        return ServingError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
    return None
