"""Leases on a resource that must outlive its users (a mapping of a client's memory the GPU may still read): a
lease ends when released or when it is garbage-collected, whichever comes first, and the resource is closed after
its last lease ended, not under a request still reading it (an unregister is deferred, as Triton defers it).

A lease's end may come from a finalizer, on any thread, even one inside the owner's own locked section (its lock
is not reentrant): ``Releases`` queues the ends and accounts for them whenever the lock is free.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Lease:
    """Holds a resource until ``release()`` (idempotent), at the latest until the lease is collected."""

    __slots__ = ("__weakref__", "_end")

    def __init__(self, end: Callable[[], object]) -> None:
        self._end = weakref.finalize(self, end)

    def release(self) -> None:
        self._end()

    @property
    def released(self) -> bool:
        return not self._end.alive


class Releases(Generic[T]):
    """Lease ends of resources ``T``, accounted under ``lock`` by ``ended(resource)`` (which returns what must be
    closed now, outside the lock, or None); ``close(resource)`` closes it. Use ``locked()`` for the owner's own
    sections, so that ends queued meanwhile are accounted on the way out."""

    def __init__(self, lock: threading.Lock, ended: Callable[[T], T | None], close: Callable[[T], None]) -> None:
        self._lock = lock
        self._ended = ended
        self._close = close
        self._queue: collections.deque[T] = collections.deque()

    def end(self, resource: T) -> None:
        """One lease of ``resource`` ended (from a release or a finalizer, on any thread)."""
        self._queue.append(resource)
        self.drain()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            yield
        self.drain()

    def drain(self) -> None:
        while self._queue:
            if not self._lock.acquire(blocking=False):
                return  # its holder drains when it lets go
            closing = []
            try:
                while self._queue:
                    done = self._ended(self._queue.popleft())
                    if done is not None:
                        closing.append(done)
            finally:
                self._lock.release()
            for resource in closing:
                self._close(resource)
