"""The completion watcher's bookkeeping (server/core/pipeline.py) with stand-in events, so it runs without a GPU:
executions end in order, on a wake-up or on the poll that backs wake-ups up, and a failed event ends its
execution with the error. tests/core/test_pipeline_gpu.py runs it against real CUDA host functions."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import pytest

from voxserve.server.core.pipeline import CompletionWatcher
from voxserve.testing.fake_pipeline import FakeEvent


@dataclass
class FakePending:
    events: tuple = field(default_factory=lambda: (FakeEvent(),))

    def finish(self, fd: int | None = None) -> None:
        self.events[-1].finished = True
        if fd is not None:
            os.eventfd_write(fd, 1)  # what the host function does


class FakePipeline:
    def __init__(self) -> None:
        self.completion_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


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
