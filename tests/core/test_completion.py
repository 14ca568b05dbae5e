"""The completion watcher's bookkeeping (server/core/pipeline.py) with stand-in events, so it runs without a GPU:
executions end in order, on a wake-up or on the poll that backs wake-ups up, and a failed event ends its
execution with the error. tests/core/test_pipeline_gpu.py runs it against real CUDA host functions."""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field

import pytest

from voxserve.server.core.pipeline import CompletionWatcher
from voxserve.testing.fake_pipeline import FakeEvent


@dataclass
class FakePending:
    events: tuple = field(default_factory=lambda: (FakeEvent(),))

    def finish(self, fd: int | None = None) -> None:
        self.events[-1].end()
        if fd is not None:
            os.eventfd_write(fd, 1)  # what the host function does


class FakePipeline:
    def __init__(self) -> None:
        self.completion_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.released: list[FakePending] = []

    def release(self, pending: FakePending) -> None:
        self.released.append(pending)


def test_executions_end_in_order_on_wake_ups_and_on_the_poll():
    pipeline = FakePipeline()

    async def go():
        watcher = CompletionWatcher(pipeline, asyncio.get_running_loop())
        watcher.POLL_S = 0.02
        try:
            a, b, c = FakePending(), FakePending(), FakePending()
            fa, fb, fc = watcher.done(a), watcher.done(b), watcher.done(c)
            b.finish(pipeline.completion_fd)  # the stream finishes in order: b cannot end before a
            await asyncio.sleep(0.005)
            assert not fa.done() and not fb.done()
            a.finish(pipeline.completion_fd)
            await asyncio.sleep(0.005)
            assert fa.done() and fb.done() and not fc.done()
            c.finish()  # no wake-up: the poll ends it
            await asyncio.wait_for(fc, 1.0)
            d = FakePending()
            d.finish()  # finished before it was handed over: done at once
            assert watcher.done(d).done()
            e = FakePending()
            e.events[-1].error = RuntimeError("CUDA error: an illegal memory access was encountered")
            with pytest.raises(RuntimeError, match="illegal memory access"):
                await asyncio.wait_for(watcher.done(e), 1.0)
        finally:
            watcher.close()

    try:
        asyncio.run(go())
    finally:
        os.close(pipeline.completion_fd)


def test_an_abandoned_or_cancelled_execution_is_released_once_it_has_ended_and_close_ends_every_one():
    """An execution nobody collects (abandoned, or its future cancelled) has its slot released when it ends, not
    before; close() waits for those still in flight (a shutdown) and ends each, and one handed over after close
    is released as soon as it has ended: no slot stays out."""
    pipeline = FakePipeline()

    async def go():
        watcher = CompletionWatcher(pipeline, asyncio.get_running_loop())
        a, b, c, d, late = (FakePending() for _ in range(5))
        watcher.abandon(a)
        watcher.done(b).cancel()
        fc = watcher.done(c)
        watcher.abandon(d)
        await asyncio.sleep(0.005)
        assert pipeline.released == []  # none has ended
        a.finish(pipeline.completion_fd)
        b.finish(pipeline.completion_fd)
        await asyncio.sleep(0.005)
        assert pipeline.released == [a, b] and not fc.done()
        threading.Timer(0.05, c.finish).start()  # (ended while close() waits)
        threading.Timer(0.05, d.finish).start()
        watcher.close()
        assert fc.done() and fc.exception() is None and pipeline.released == [a, b, d]
        late.finish()
        watcher.abandon(late)
        assert pipeline.released == [a, b, d, late]

    try:
        asyncio.run(go())
    finally:
        os.close(pipeline.completion_fd)
