"""Errors as values: a gRPC status code and one sentence naming the field, the value and the limit."""

from __future__ import annotations

import grpc

from .batching import DeadlineExceeded, QueueFull

# A client's string quoted in an error message is cut to this many characters: the message travels in the
# status trailer, and a long one would turn the intended code into the transport's RESOURCE_EXHAUSTED.
SHOWN_CHARS = 64


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` as quoted in an error message: at most ``limit`` characters, then '...' and the full length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


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
