"""Where a small request's time goes in the server process: batch-1 traffic of tiny samples (compute is
negligible) at concurrency 64, with and without batching, and a py-spy profile of the batching server
split into voxserve's own Python, the model, and gRPC/asyncio machinery.

    python bench/probes/frontend_profile.py --out bench/results/frontend-profile-<machine>.md   # needs py-spy

The server runs in a child process on the CPU; the load generator runs here, on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shlex
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyspy  # bench/probes/pyspy.py, beside this script

from voxserve.client import build_request
from voxserve.testing.load import ServerProcess, closed_loop

SHAPE = (1, 3, 3, 3, 3)


def categorise(frames: list[str]) -> str:
    """Whose time a sample is: the innermost frame that belongs to a known part decides."""
    for frame in reversed(frames):
        if "kernels/" in frame or "torch/" in frame:
            return "model (CPU reference op)"
        if "server/" in frame or "client/" in frame or "prometheus_client" in frame:
            return "voxserve Python (decode, batcher, metrics, encode)"
        if "selectors.py" in frame:
            return "event loop waiting (epoll)"
        if "asyncio/" in frame or "grpc" in frame:
            return "gRPC aio / asyncio machinery (C and Cython callbacks)"
        if "threading.py" in frame or "concurrent/futures" in frame:
            return "other threads (gRPC poller, executor idle)"
    return "other"


def profile(pid: int, seconds: float) -> Counter:
    shares: Counter = Counter()
    for frames, n in pyspy.record(pid, seconds):
        shares[categorise(frames)] += n
    return shares


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    x = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    body = build_request(x, "voxnet", "FP32").SerializeToString()
    rows, shares = [], Counter()
    for batching in (True, False):
        with ServerProcess(["--device", "cpu"] + ([] if batching else ["--no-batching"])) as server:
            asyncio.run(closed_loop(server.url, body, 64, 2.0))  # warm
            spy = None
            if batching:
                from concurrent.futures import ThreadPoolExecutor

                spy = ThreadPoolExecutor(1).submit(profile, server.proc.pid, args.seconds)
            r = asyncio.run(closed_loop(server.url, body, 64, args.seconds))
            if spy is not None:
                shares = spy.result()
            rows.append((batching, r))
    total = sum(shares.values()) or 1
    lines = ["# Small-request cost in the server process (CPU)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPU "
             "cores; server in a child process, load generator on the same machine",
             f"- command: `python bench/probes/frontend_profile.py {shlex.join(sys.argv[1:])}`",
             f"- requests of {SHAPE} FP32 (compute is negligible), 64 outstanding, {args.seconds:.0f} s", "",
             "| batching | req/s | p50 ms | p99 ms |", "|---|---:|---:|---:|"]
    for batching, r in rows:
        lines.append(f"| {'on' if batching else 'off'} | {r.rate():.0f} | {r.percentile_ms('OK', 50):.1f} | "
                     f"{r.percentile_ms('OK', 99):.1f} |")
    lines += ["", f"Batching gives {rows[0][1].rate() / rows[1][1].rate():.2f}x here.", "",
              "py-spy samples of the batching server, by whose time it is:", "", "| share | where |", "|---:|---|"]
    for where, n in shares.most_common():
        lines.append(f"| {n / total:.0%} | {where} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
