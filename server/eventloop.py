"""Which asyncio event loop the server's processes run (--event-loop): asyncio's own, or uvloop.

Every request passes through a handful of loop callbacks (gRPC's completion callbacks, the batcher's futures,
the engine hop). On an H200 host uvloop cut a trivial gRPC sink's CPU per batch-1 request by 14 %, but the
service's rates moved within their run-to-run spread (bench/results/host-h200.md), so the standard loop stays
the default and uvloop is there to choose.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

uvloop: Any
try:
    import uvloop
except ImportError:  # optional (pip install uvloop; the test extra installs it)
    uvloop = None

log = logging.getLogger(__name__)

AUTO, UVLOOP, ASYNCIO = "auto", "uvloop", "asyncio"
CHOICES = (AUTO, UVLOOP, ASYNCIO)

T = TypeVar("T")


def resolve(kind: str) -> str:
    """``auto`` becomes uvloop when it can be imported, else asyncio; uvloop asked for but missing is an error."""
    if kind == AUTO:
        return UVLOOP if uvloop is not None else ASYNCIO
    if kind == UVLOOP and uvloop is None:
        raise RuntimeError("--event-loop uvloop: uvloop is not installed (pip install uvloop, or --event-loop auto)")
    return kind


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A function making a new loop of ``kind`` (auto, uvloop or asyncio)."""
    if resolve(kind) == UVLOOP:
        return uvloop.new_event_loop
    return asyncio.new_event_loop


def running() -> str:
    """The kind of the running loop: uvloop or asyncio."""
    return UVLOOP if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else ASYNCIO


def run(main: Coroutine[Any, Any, T], kind: str) -> T:
    """``asyncio.run(main)`` on a loop of ``kind``."""
    factory = loop_factory(kind)
    log.debug("event loop: %s", resolve(kind))
    runner_type = getattr(asyncio, "Runner", None)  # Python 3.11+
    if runner_type is not None:
        with runner_type(loop_factory=factory) as runner:
            return runner.run(main)
    loop = factory()  # Python 3.10: what asyncio.run does, on this loop
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
