"""Errors as values: a status and one sentence naming the field, the value and the limit.

The statuses are the canonical codes that the Open Inference Protocol shares with gRPC (and that its REST form
maps to HTTP statuses); nothing here knows a transport. ``server/protocol/status.py`` turns them into the
transport's codes at the edge.
"""

from __future__ import annotations

import enum

from .batching import DeadlineExceeded, QueueFull, Stopped

# A client's string quoted in an error message is cut to this many characters: the message travels in the
# status trailer, and a long one would turn the intended code into the transport's RESOURCE_EXHAUSTED.
SHOWN_CHARS = 64


class Status(enum.Enum):
    """The canonical status codes, by their numbers on the wire."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, value: int) -> Status:
        """The status numbered ``value``; UNKNOWN for a number that is none."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` as quoted in an error message: at most ``limit`` characters, then '...' and the full length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class StartupError(Exception):
    """The server cannot start (unusable weights, TLS or token files, a port in use); the message says why."""


class ServingError(Exception):
    """A request-level failure the client is told about with ``code`` (a Status) and ``message``."""

    def __init__(self, code: Status, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ServingError({self.code.name}, {self.message!r})"


def invalid(message: str) -> ServingError:
    return ServingError(Status.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServingError:
    return ServingError(Status.NOT_FOUND, message)


def exhausted(message: str) -> ServingError:
    return ServingError(Status.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> ServingError:
    return ServingError(Status.UNAVAILABLE, message)


def unimplemented(message: str) -> ServingError:
    return ServingError(Status.UNIMPLEMENTED, message)


def internal(message: str) -> ServingError:
    return ServingError(Status.INTERNAL, message)


def runner_error(exc: BaseException, model_name: str) -> ServingError | None:
    """The client-facing error for what the runner raises, or None for an unexpected failure."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, QueueFull):
        return unavailable(f"model '{model_name}' is overloaded: {exc}; retry later")
    if isinstance(exc, DeadlineExceeded):
        return ServingError(Status.DEADLINE_EXCEEDED, str(exc))
    if isinstance(exc, Stopped):
        return unavailable(f"model '{model_name}' is not served any more here: {exc}; retry on another replica")
    return None
