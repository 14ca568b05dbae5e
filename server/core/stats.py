"""Cumulative per-model statistics behind the ModelStatistics RPC (real counts and times).

With --replicas, each replica publishes its snapshot to the run directory twice a second and answers
ModelStatistics with its own live figures plus the others' last published ones (``combined``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        """``count`` more, taking ``ns`` in all."""
        self.count += count
        self.ns += ns


@dataclass
class BatchDurations:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class StatsSnapshot:
    inference_count: int
    execution_count: int
    last_inference_ms: int
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    batches: dict[int, BatchDurations]


def _merge_duration(a: Duration, b: Duration) -> Duration:
    return Duration(a.count + b.count, a.ns + b.ns)


def merge(a: StatsSnapshot, b: StatsSnapshot) -> StatsSnapshot:
    """The figures of two replicas as one model's."""
    batches = dict(a.batches)
    for size, d in b.batches.items():
        if size in batches:
            m = batches[size]
            batches[size] = BatchDurations(_merge_duration(m.compute_input, d.compute_input),
                                           _merge_duration(m.compute_infer, d.compute_infer),
                                           _merge_duration(m.compute_output, d.compute_output))
        else:
            batches[size] = d
    return StatsSnapshot(
        inference_count=a.inference_count + b.inference_count,
        execution_count=a.execution_count + b.execution_count,
        last_inference_ms=max(a.last_inference_ms, b.last_inference_ms),
        **{f: _merge_duration(getattr(a, f), getattr(b, f))
           for f in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")},
        batches=dict(sorted(batches.items())),
    )


def _from_json(data: dict) -> StatsSnapshot:
    def d(v: dict) -> Duration:
        return Duration(int(v["count"]), int(v["ns"]))

    return StatsSnapshot(
        inference_count=int(data["inference_count"]), execution_count=int(data["execution_count"]),
        last_inference_ms=int(data["last_inference_ms"]),
        **{f: d(data[f]) for f in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")},
        batches={int(size): BatchDurations(d(b["compute_input"]), d(b["compute_infer"]), d(b["compute_output"]))
                 for size, b in data["batches"].items()},
    )


class ModelStats:
    """Thread-safe accumulators: requests are recorded on the event loop, executions on the runner thread."""

    def __init__(self) -> None:
        self._shared: tuple[str, str] | None = None  # (directory, this replica's file name) with --replicas
        self._lock = threading.Lock()
        # One publish at a time: the periodic one runs on a thread that a cancelled task does not stop, and the
        # final one at shutdown writes the same file (the two renamed each other's temporary file away).
        self._publishing = threading.Lock()
        self._inference_count = 0
        self._execution_count = 0
        self._last_inference_ms = 0
        self._success = Duration()
        self._fail = Duration()
        self._queue = Duration()
        self._input = Duration()
        self._infer = Duration()
        self._output = Duration()
        self._batches: dict[int, BatchDurations] = defaultdict(BatchDurations)

    def record_execution(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        with self._lock:
            self._execution_count += 1
            self._input.add(input_ns)
            self._infer.add(infer_ns)
            self._output.add(output_ns)
            b = self._batches[batch_size]
            b.compute_input.add(input_ns)
            b.compute_infer.add(infer_ns)
            b.compute_output.add(output_ns)

    def record_success(self, samples: int, duration_ns: int, queue_ns: int, requests: int = 1) -> None:
        """``requests`` successful requests (one by default) of ``samples`` in all, taking ``duration_ns`` and
        ``queue_ns`` in all."""
        with self._lock:
            self._inference_count += samples
            self._last_inference_ms = time.time_ns() // 1_000_000
            self._success.add(duration_ns, requests)
            self._queue.add(queue_ns, requests)

    def record_failure(self, duration_ns: int, requests: int = 1) -> None:
        with self._lock:
            self._fail.add(duration_ns, requests)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            def copy(d: Duration) -> Duration:
                return Duration(d.count, d.ns)

            return StatsSnapshot(
                inference_count=self._inference_count,
                execution_count=self._execution_count,
                last_inference_ms=self._last_inference_ms,
                success=copy(self._success),
                fail=copy(self._fail),
                queue=copy(self._queue),
                compute_input=copy(self._input),
                compute_infer=copy(self._infer),
                compute_output=copy(self._output),
                batches={
                    size: BatchDurations(copy(b.compute_input), copy(b.compute_infer), copy(b.compute_output))
                    for size, b in sorted(self._batches.items())
                },
            )

    # --- several replicas -------------------------------------------------------------------------

    def share(self, directory: str, replica: str) -> None:
        """Publish to and read the other replicas' snapshots from ``directory``."""
        os.makedirs(directory, exist_ok=True)
        self._shared = (directory, f"{replica}.json")

    @property
    def shared(self) -> bool:
        return self._shared is not None

    def publish(self) -> None:
        """Write this replica's snapshot (atomically: readers see the previous or this one, whole)."""
        if self._shared is None:
            return
        directory, name = self._shared
        tmp = os.path.join(directory, f".{name}.tmp")
        with self._publishing:
            with open(tmp, "w") as f:
                json.dump(dataclasses.asdict(self.snapshot()), f)
            os.replace(tmp, os.path.join(directory, name))

    async def publish_every(self, interval_s: float = 0.5) -> None:
        """Publish every ``interval_s`` until cancelled (a task of each process that shares its figures)."""
        while True:
            try:
                await asyncio.to_thread(self.publish)
            except OSError as exc:
                log.warning("publishing statistics failed: %s", exc)
            await asyncio.sleep(interval_s)

    def combined(self) -> StatsSnapshot:
        """This replica's live figures plus the other replicas' last published ones."""
        total = self.snapshot()
        if self._shared is None:
            return total
        directory, own = self._shared
        for entry in sorted(os.listdir(directory)):
            if entry == own or not entry.endswith(".json"):
                continue
            try:
                with open(os.path.join(directory, entry)) as f:
                    total = merge(total, _from_json(json.load(f)))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # replaced or removed meanwhile: skip it this once
        return total
