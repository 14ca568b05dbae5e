"""Where a request's time goes in a serving process under load: one path's traffic at one concurrency against
``voxserve serve`` in a child process, the server's CPU seconds per request, and a py-spy profile of it by
thread: where each thread spends its samples (innermost frame) and which of voxserve's own functions hold them.

    python bench/probes/server_profile.py --path cuda --batch 128 --concurrency 16 --out bench/results/x.md
    python bench/probes/server_profile.py --path wire --batch 1 --concurrency 64 -- --device cpu

``--path``: wire (the tensor in the request), system (system shared memory), cuda (CUDA shared memory: needs
cuda-bindings and a GPU). Arguments after ``--`` go to ``voxserve serve``. Needs py-spy.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import re
import shlex
import sys
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyspy  # bench/probes/pyspy.py, beside this script

from voxserve.client import build_request
from voxserve.client.bench import setup_cuda_shared_memory, setup_shared_memory
from voxserve.testing.load import ServerProcess, closed_loop, cpu_seconds

# voxserve's own frames (paths as py-spy prints them), but the process's entry, which every stack holds
OWN = re.compile(r"\((voxserve|server|kernels|client)/(?!cli\.py|__main__\.py)")


def function(frame: str) -> str:
    """``name (file:line)`` -> ``name (file)``: a function's samples over all its lines."""
    return re.sub(r":\d+\)$", ")", frame)


def thread_of(frames: list[str]) -> str:
    """A stack's thread, by name (py-spy --threads puts "thread (tid): name" first); numbered pool threads
    (``submit-cuda_0``, ``ThreadPoolExecutor-0_3``) count as one."""
    head = frames[0] if frames else ""
    name = head.split(": ", 1)[1] if head.startswith("thread") and ": " in head else "?"
    return re.sub(r"_\d+$", "_*", re.sub(r"^Thread-\d+", "Thread", name))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=("wire", "system", "cuda"), default="cuda")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default="")
    parser.add_argument("serve_args", nargs="*", help="after --: voxserve serve's arguments")
    args = parser.parse_args()
    x = np.random.default_rng(0).standard_normal((args.batch, 3, 16, 32, 32), dtype=np.float32)
    with ServerProcess(args.serve_args) as server:
        cleanup = lambda: None  # noqa: E731
        if args.path == "wire":
            payload = build_request(x, "voxnet", "FP32").SerializeToString()
        elif args.path == "system":
            payload, cleanup = setup_shared_memory(server.url, x, "FP32", "voxnet")
        else:
            payload, cleanup = setup_cuda_shared_memory(server.url, x, "FP32", "voxnet")
        try:
            asyncio.run(closed_loop(server.url, payload, args.concurrency, 2.0))  # warm
            pid = server.proc.pid
            cpu0, here0 = cpu_seconds(pid), cpu_seconds(os.getpid())
            spy = ThreadPoolExecutor(1).submit(pyspy.record, pid, args.seconds, 250, True)
            report = asyncio.run(closed_loop(server.url, payload, args.concurrency, args.seconds + 0.5))
            cpu, here = cpu_seconds(pid) - cpu0, cpu_seconds(os.getpid()) - here0
            stacks = spy.result()
        finally:
            cleanup()
    n = max(report.ok, 1)
    threads: dict[str, list] = defaultdict(list)
    for frames, count in stacks:
        threads[thread_of(frames)].append((frames[1:], count))
    total = sum(c for _, c in stacks) or 1
    lines = [f"# Server profile: {args.path} path, batch {args.batch}, concurrency {args.concurrency}", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPU cores; "
             f"commit {args.commit or '?'}; server and load generator on this machine",
             f"- command: `python bench/probes/server_profile.py {shlex.join(sys.argv[1:])}`", "",
             f"{report.rate():.0f} req/s, p50 {report.percentile_ms('OK', 50):.2f} ms, p99 "
             f"{report.percentile_ms('OK', 99):.2f} ms, {sum(report.codes.values()) - report.ok} errors; server CPU "
             f"{cpu / n * 1e6:.0f} us per request ({cpu / (args.seconds + 0.5):.2f} cores), load generator "
             f"{here / n * 1e6:.0f} us per request", "",
             f"py-spy: {total} samples at 250/s over {args.seconds:.0f} s (idle threads not sampled)."]
    for name, its in sorted(threads.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        share = sum(c for _, c in its)
        lines += ["", f"## {name}: {share} samples ({share / total:.0%})", "", "| self | innermost frame |",
                  "|---:|---|"]
        lines += [f"| {c / share:.0%} | `{f}` |" for f, c in pyspy.by_self(its).most_common(args.top)]
        own: Counter = pyspy.by_total([([function(f) for f in fs], c) for fs, c in its], lambda f: bool(OWN.search(f)))
        lines += ["", "| total | voxserve frame on the stack |", "|---:|---|"]
        lines += [f"| {c / share:.0%} | `{f}` |" for f, c in own.most_common(args.top)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
