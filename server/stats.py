"""Cumulative per-model statistics behind the ModelStatistics RPC (real counts and times)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
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


class ModelStats:
    """Thread-safe accumulators: requests are recorded on the event loop, executions on the runner thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
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

    def record_success(self, samples: int, duration_ns: int, queue_ns: int) -> None:
        with self._lock:
            self._inference_count += samples
            self._last_inference_ms = time.time_ns() // 1_000_000
            self._success.add(duration_ns)
            self._queue.add(queue_ns)

    def record_failure(self, duration_ns: int) -> None:
        with self._lock:
            self._fail.add(duration_ns)

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
