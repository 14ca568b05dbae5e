"""The transport's own cost, Python against C++: the same client load on gRPC's Python aio server and on gRPC's C++
server, both trivial ModelInfer sinks (no model), with each sink's CPU time per answered request.

The Python sink is `voxserve bench --compare-raw`'s (bytes in, a fixed reply out: it does not even parse the
request); the C++ one (bench/probes/cpp_sink/sink.cc, gRPC's synchronous C++ server) parses each request with
protobuf C++ and answers the same reply. Whatever a Python front end of voxserve does per request comes on top of
the Python sink's row; the C++ row is what a front end outside Python starts from.

    bench/probes/cpp_sink/build.sh     # Debian: apt-get install libgrpc++-dev protobuf-compiler-grpc
    python bench/probes/sink_compare.py [--duration 5] [--out bench/results/sink-compare-<machine>.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from voxserve.client import build_request
from voxserve.client.bench import raw_sink, run_level_over

ROOT = Path(__file__).resolve().parents[2]
SINK = ROOT / "build" / "cpp_sink" / "sink"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` and its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def measure(url: str, pid: int, payload: bytes, samples: int, nbytes: int, concurrency: int, processes: int,
            connections: int, duration: float) -> tuple[float, float, float]:
    """(req/s, p50 ms, the sink's CPU us per answered request) of one level."""
    before = cpu_seconds(pid)
    common = dict(duration_s=duration, requests=None, model="sink", target="sink", timeout_s=120.0,
                  connections=connections)
    result = run_level_over(url, payload, samples, nbytes, concurrency, processes=processes, **common)
    used = cpu_seconds(pid) - before
    answered = max(1, len(result.latencies_ms))
    return result.rps, result.percentile(50), used / answered * 1e6


@contextlib.contextmanager
def cpp_sink() -> Iterator[tuple[str, int]]:
    """The running C++ sink (built by bench/probes/cpp_sink/build.sh): its URL and process id."""
    proc = subprocess.Popen([str(SINK), "0"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().split()[1])  # type: ignore[union-attr]
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def python_sink_pid(url: str) -> int:
    """The raw sink's process (a child of this one, listening on ``url``'s port)."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return int(out.split("pid=", 1)[1].split(",", 1)[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--processes", type=int, default=2, help="load processes for batch 1")
    ap.add_argument("--connections", type=int, default=8, help="connections per load process for batch 1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not SINK.exists():
        print(f"{SINK} is missing: run bench/probes/cpp_sink/build.sh first", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    full = rng.standard_normal((128, 3, 16, 32, 32), dtype=np.float32)
    one = full[:1].copy()
    loads = [("full batch (25 MB), c=1", build_request(full, "sink", "FP32").SerializeToString(), 128, full.nbytes,
              1, 1, 1),
             ("full batch (25 MB), c=4", build_request(full, "sink", "FP32").SerializeToString(), 128, full.nbytes,
              4, 1, 4),
             ("batch 1, c=64", build_request(one, "sink", "FP32").SerializeToString(), 1, one.nbytes, 64,
              args.processes, args.connections)]
    rows = []
    with cpp_sink() as (cpp_url, cpp_pid), raw_sink() as url:
        py_pid = python_sink_pid(url)
        for label, payload, samples, nbytes, c, procs, conns in loads:
            for name, target, pid in (("Python (grpc.aio)", url, py_pid), ("C++ (grpc++ sync)", cpp_url, cpp_pid)):
                print(f"  {name}: {label}", file=sys.stderr, flush=True)
                rows.append((label, name, *measure(target, pid, payload, samples, nbytes, c, procs, conns,
                                                   args.duration)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    lines = ["# The transport's own cost: gRPC's Python server against its C++ server (trivial sinks)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPU cores "
             f"({platform.processor() or platform.machine()}), Python {platform.python_version()}; client and sink "
             f"on the same host over loopback; commit {commit}",
             f"- command: `python bench/probes/sink_compare.py {' '.join(sys.argv[1:])}`",
             f"- batch 1: {args.processes} load processes x {args.connections} connections; {args.duration:g} s "
             f"per level", "",
             "| load | sink | req/s | p50 ms | sink CPU us per request |", "|---|---|---:|---:|---:|",
             *(f"| {label} | {name} | {rps:.1f} | {p50:.2f} | {cpu:.0f} |" for label, name, rps, p50, cpu in rows)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
