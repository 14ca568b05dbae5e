"""Full batches (25 MB FP32 over gRPC) as the client's load processes grow: which side bounds a row.

The same full-batch level against gRPC's Python sink (`voxserve bench --compare-raw`'s), gRPC's C++ sink
(bench/probes/cpp_sink, when built) and voxserve with front ends, at each client process count: where a row
grows with the processes, the client was its bound; where it stays, the server is (or the host). Each level also
reports its p50, and c=1 is timed with one process (the latency of one call).

    bash bench/probes/cpp_sink/build.sh         # optional: the C++ sink's rows
    python bench/probes/full_batch_scaling.py [--frontends 12] [--impl native] [--engines 2]
        [--processes 1,2,4,8] [--concurrency 16] [--duration 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
from sink_compare import SINK, cpp_sink  # bench/probes/ (this script's folder)

from voxserve.client import build_request
from voxserve.client.bench import LevelResult, raw_sink, run_level_over
from voxserve.testing.load import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def level(url: str, payload: bytes, nbytes: int, concurrency: int, processes: int, duration: float,
          target: str, model: str) -> LevelResult:
    print(f"  {target}: c={concurrency}, {processes} client processes", file=sys.stderr, flush=True)
    common = dict(duration_s=duration, requests=None, model=model, target=target, timeout_s=300.0,
                  connections=max(4, concurrency // 4))
    return run_level_over(url, payload, 128, nbytes, concurrency, processes=processes, **common)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frontends", type=int, default=12)
    ap.add_argument("--impl", default="native", choices=("python", "native"), help="voxserve's --frontend-impl")
    ap.add_argument("--engines", type=int, default=2, help="voxserve's --replicas (engines sharing the GPU)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--processes", type=lambda t: [int(v) for v in t.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    full = np.random.default_rng(0).standard_normal((128, 3, 16, 32, 32), dtype=np.float32)
    rows: list[tuple[str, int, int, LevelResult]] = []
    fe = f"voxserve --frontends {args.frontends} --frontend-impl {args.impl} --replicas {args.engines}"

    def sweep(url: str, target: str, model: str) -> None:
        payload = build_request(full, model, "FP32").SerializeToString()
        rows.append((target, 1, 1, level(url, payload, full.nbytes, 1, 1, args.duration, target, model)))
        for p in args.processes:
            rows.append((target, args.concurrency, p,
                         level(url, payload, full.nbytes, args.concurrency, p, args.duration, target, model)))

    with raw_sink() as url:
        sweep(url, "Python sink (grpc.aio)", "sink")
    if SINK.exists():
        with cpp_sink() as (url, _pid):
            sweep(url, "C++ sink (grpc++ sync)", "sink")
    serve = ["--device", args.device, "--max-message-bytes", str(512 * 1024 * 1024), "--frontends",
             str(args.frontends), "--frontend-impl", args.impl, "--replicas", str(args.engines)]
    with ServerProcess(serve) as vox:
        sweep(vox.url, fe, "voxnet")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    lines = ["# Full batches as the client's processes grow", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPU cores "
             f"({platform.processor() or platform.machine()}), Python {platform.python_version()}; client and server "
             f"on the same host over loopback; commit {commit}",
             f"- command: `python bench/probes/full_batch_scaling.py {' '.join(sys.argv[1:])}`",
             f"- request: (128, 3, 16, 32, 32) FP32, {full.nbytes / 1e6:.1f} MB of tensor; {args.duration:g} s per "
             "level", "",
             "| target | conc | client processes | req/s | GB/s | p50 ms | p99 ms | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|",
             *(f"| {t} | {c} | {p} | {r.rps:.1f} | {r.rps * full.nbytes / 1e9:.2f} | {r.percentile(50):.1f} | "
               f"{r.percentile(99):.1f} | {r.errors} |" for t, c, p, r in rows)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
