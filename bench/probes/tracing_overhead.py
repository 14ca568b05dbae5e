"""What --tracing and --access-log cost per request: the CPU time of the inference hot path
(``InferenceService._infer``: decode, validate, the runner's call, encode, accounting) without gRPC and with a
runner that answers at once, so that what differs between the rows is the hooks alone.

    python bench/probes/tracing_overhead.py [--requests 20000] [--rounds 7] \\
        [--out bench/results/tracing-overhead-cpu-2core.md]

Rows: both off; --access-log (rate 1, and 0.1) to a handler that discards its records after formatting them;
--tracing with the production BatchSpanProcessor and an exporter that drops the spans (sampled, and sampled
out by the caller's traceparent); both on. Each row is the median over rounds of the process's CPU time per
request (every thread: the span processor's worker included), rounds interleaved so that the machine's
drift falls on every row alike. Also printed: the time of the statements the hooks add to a request when
both are off (two perf_counter_ns stamps and two attribute checks), by timeit.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

import numpy as np

from voxserve.client import build_request
from voxserve.server.core.batching import BatchResult
from voxserve.server.logs import ACCESS_LOGGER, FORMAT, AccessLog
from voxserve.server.metrics import Metrics
from voxserve.server.protocol.codec import ModelSpec
from voxserve.server.protocol.inference import InferenceService
from voxserve.server.protocol.service import ServingState
from voxserve.server.protocol.wire import parse_infer_request

SHAPE = (1, 3, 8, 8, 8)
COUT = 16
SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


class InstantRunner:
    """An executor that answers every request at once with a valid output (no model, no batcher)."""

    device_lost = None

    def admit(self) -> None:
        pass

    async def run(self, array: np.ndarray, datatype: str, timeout_s: float | None) -> BatchResult:
        return BatchResult(np.full((array.shape[0], COUT), 1 / COUT, np.float32), 1000, int(array.shape[0]))


class Call:
    """What the hot path asks of a gRPC call: its metadata and peer."""

    def __init__(self, traceparent: str) -> None:
        self.metadata = (("traceparent", traceparent), ("user-agent", "grpc-python/1.81.1"))

    def invocation_metadata(self):
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"


def _service(tracer=None, access_log: AccessLog | None = None) -> InferenceService:
    state = ServingState(max_batch=128)
    state.spec = ModelSpec("voxnet", "1", 3, COUT, 3, 1024)
    state.runner = InstantRunner()  # type: ignore[assignment]
    state.ready = True
    return InferenceService(state, Metrics("voxnet", gpu_metrics=False), "voxnet", "1", tracer=tracer,
                            access_log=access_log)


def _tracer():
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from voxserve.server.tracing import Tracer

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    return Tracer([BatchSpanProcessor(Drop())], "voxnet")


def _access_log(rate: float) -> AccessLog:
    logger = logging.getLogger(f"{ACCESS_LOGGER}.probe")
    logger.propagate = False
    if not logger.handlers:
        sink = logging.StreamHandler(_Discard())  # formatted and written, then forgotten
        sink.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(sink)
    return AccessLog(rate, logger=logger)


class _Discard(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


async def _drive(service: InferenceService, payload: bytes, call: Call, requests: int) -> float:
    """CPU seconds per request over ``requests`` sequential requests."""
    parsed = parse_infer_request(payload)
    for _ in range(200):  # warm
        await service._infer(parsed, call=call)
    t0 = time.process_time()
    for _ in range(requests):
        await service._infer(parse_infer_request(payload), call=call)
    return (time.process_time() - t0) / requests


def _fixed_cost_ns() -> float:
    """The statements a request runs for the hooks when both are off, in ns."""
    class S:
        _observed = False

    s = S()
    n = 1_000_000
    seconds = timeit.timeit("a = pc(); b = pc()\nif s._observed: pass\nif s._observed: pass", number=n,
                            globals={"pc": time.perf_counter_ns, "s": s})
    return seconds / n * 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000, help="requests per round and row")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args()
    payload = build_request(np.zeros(SHAPE, np.float32), "voxnet", "FP32", request_id="probe-1").SerializeToString()
    tracer = _tracer()
    rows = {
        "both off": (_service(), SAMPLED),
        "--access-log (rate 1)": (_service(access_log=_access_log(1.0)), SAMPLED),
        "--access-log --access-log-sample-rate 0.1": (_service(access_log=_access_log(0.1)), SAMPLED),
        "--tracing (sampled)": (_service(tracer=tracer), SAMPLED),
        "--tracing (sampled out by the caller)": (_service(tracer=tracer), UNSAMPLED),
        "--tracing --access-log": (_service(tracer=tracer, access_log=_access_log(1.0)), SAMPLED),
    }
    results: dict[str, list[float]] = {name: [] for name in rows}

    async def run() -> None:
        for _ in range(args.rounds):
            for name, (service, traceparent) in rows.items():
                results[name].append(await _drive(service, payload, Call(traceparent), args.requests))

    asyncio.run(run())
    tracer.shutdown()
    base = statistics.median(results["both off"])
    table = ["| configuration | CPU us/request (median) | min..max over rounds | added us/request |",
             "|---|---:|---:|---:|"]
    for name, values in results.items():
        median = statistics.median(values)
        table.append(f"| {name} | {median * 1e6:.1f} | {min(values) * 1e6:.1f}..{max(values) * 1e6:.1f} | "
                     f"{(median - base) * 1e6:+.1f} |")
    fixed = _fixed_cost_ns()
    note = (f"Both off, the statements the hooks add to a request (two perf_counter_ns stamps, two attribute "
            f"checks; timeit): {fixed:.0f} ns.")
    print("\n".join(table))
    print(note)
    if args.out:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        Path(args.out).write_text(
            f"# Tracing and access-log overhead: CPU per request of the hot path, without gRPC\n\n"
            f"- date: {when}; {os.cpu_count()} CPU cores (shared), {platform.processor() or platform.machine()}, "
            f"Python {sys.version.split()[0]}; commit {commit}\n"
            f"- command: `python bench/probes/tracing_overhead.py {' '.join(sys.argv[1:])}`\n"
            f"- request: {SHAPE} FP32, request id and traceparent set; a runner that answers at once; "
            f"{args.requests} requests per round, {args.rounds} rounds\n\n"
            + "\n".join(table) + "\n\n" + note + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
