"""A GPU pipeline and model for server/core/runner.py's GPU path without a GPU: executions end in order on one
"stream" (a thread), each a moment after it was enqueued, and signal the completion watcher's eventfd as the real
pipeline's host function does; a sample's output is the mean of its voxels, COUT times. As the real pipeline, it
has ``depth`` slots: an enqueue takes one (waiting for it, or None without ``wait_for_slot``), ``finish`` and
``release`` give it back, once; a slot read or released after it came back is recorded in ``violations`` (on the
GPU the next execution would be overwriting it). A test can make an enqueue or an execution of a given sample count
fail, or an enqueue wait at a gate. tests/core/test_runner_gpu_path.py drives the runner with it, and
bench/probes/runner_calls.py counts the Python calls per request it takes.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

COUT = 4


class FakeEvent:
    def __init__(self) -> None:
        self.finished = False
        self.error: Exception | None = None
        self._ended = threading.Event()

    def end(self) -> None:
        self.finished = True
        self._ended.set()

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.finished

    def synchronize(self) -> None:
        self._ended.wait()
        self.query()


@dataclass
class FakePending:
    output: np.ndarray
    samples: int
    slot: int = -1
    events: tuple = field(default_factory=lambda: (FakeEvent(),))
    released: bool = False


class FakePipeline:
    """Executions end in order on one "stream" (a thread), each a moment after it was enqueued; the output of a
    sample is the mean of its voxels, COUT times."""

    native = None

    def __init__(self, depth: int = 2, gpu_s: float = 0.0005) -> None:
        self.depth = depth
        self.gpu_s = gpu_s  # each execution's time on the "stream"
        self.completion_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.fail_submit: set[int] = set()  # sample counts whose enqueue raises
        self.fail_event: set[int] = set()  # sample counts whose execution ends in an error
        self.gated: set[int] = set()  # sample counts whose enqueue, once counted in submitted, waits for gate
        self.gate = threading.Event()
        self.submitted: list[int] = []  # the sample counts of the enqueues that got a slot
        self.waiting = 0  # enqueues waiting for a slot now
        self.enqueued = 0  # enqueues that have returned
        self.finished = 0  # executions the stream has ended
        self.released = 0  # slots given back by release() (finish() gives its own back too)
        self.violations: list[str] = []
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(depth):
            self._free.put(slot)
        self._stream: list[FakePending] = []
        self._lock = threading.Condition()
        self._closed = False
        self.hold = threading.Event()  # cleared: the stream stops after its current execution, until set again
        self.hold.set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def free_slots(self) -> int:
        return self._free.qsize()

    def submit(self, arrays, datatype, wait_for_slot=True, notify=True, max_host_copy=None):
        samples = sum(int(a.shape[0]) for a in arrays)
        if wait_for_slot:
            self.waiting += 1
            try:
                slot = self._free.get()
            finally:
                self.waiting -= 1
        else:
            try:
                slot = self._free.get_nowait()
            except queue.Empty:
                return None
        try:
            self.submitted.append(samples)
            if samples in self.gated:
                self.gate.wait()
            if samples in self.fail_submit:
                raise RuntimeError("CUDA error: an enqueue the test refuses")
            x = np.concatenate([np.asarray(a, dtype=np.float32) for a in arrays])
        except BaseException:
            self._free.put(slot)
            raise
        means = x.reshape(samples, -1).mean(axis=1, dtype=np.float64).astype(np.float32)
        pending = FakePending(np.repeat(means[:, None], COUT, axis=1), samples, slot)
        if samples in self.fail_event:
            pending.events[-1].error = RuntimeError("CUDA error: an execution the test fails")
        with self._lock:
            self._stream.append(pending)
            self._lock.notify()
        self.enqueued += 1
        return pending

    def finish(self, pending: FakePending):
        if pending.released:
            self.violations.append(f"finish() of a {pending.samples}-sample execution whose slot came back")
        if not pending.events[-1].finished:
            self.violations.append(f"finish() of a {pending.samples}-sample execution still running")
        output = pending.output.copy()
        self._give_back(pending)
        return output, 0, 1000, 0

    def release(self, pending: FakePending) -> None:
        if not pending.released:  # (once, as the real pipeline's)
            if not pending.events[-1].finished and pending.events[-1].error is None:
                self.violations.append(f"release() of a {pending.samples}-sample execution still running")
            self.released += 1
            self._give_back(pending)

    def _give_back(self, pending: FakePending) -> None:
        pending.released = True
        self._free.put(pending.slot)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stream and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                pending = self._stream.pop(0)
            self.hold.wait()
            time.sleep(self.gpu_s)  # the GPU's time
            pending.events[-1].end()
            self.finished += 1
            os.eventfd_write(self.completion_fd, 1)

    def close(self) -> None:
        self.hold.set()
        self.gate.set()
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(5)
        os.close(self.completion_fd)


class FakeGpuModel:
    """What the runner asks of a model on a GPU."""

    def __init__(self, max_batch: int, depth: int = 2, gpu_s: float = 0.0005) -> None:
        self.device = torch.device("cuda", 0)  # (only named: nothing runs on it)
        self.max_batch = max_batch
        self.pipeline = self.gpu_pipeline = FakePipeline(depth, gpu_s)
        self.recovered = 0

    def recover(self) -> str | None:
        self.recovered += 1
        return None  # the device serves on


def expected(x: np.ndarray) -> np.ndarray:
    """FakePipeline's output for ``x``."""
    means = x.reshape(x.shape[0], -1).mean(axis=1, dtype=np.float64).astype(np.float32)
    return np.repeat(means[:, None], COUT, axis=1)
