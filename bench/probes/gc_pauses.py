"""The garbage collector's full collections in a serving process, with the start-up objects frozen (what
the server does once ready: server/core/heap.py) and without (unfrozen again right after start-up).

    python bench/probes/gc_pauses.py [--seconds 15] [--weights W.safetensors] \\
        [--out bench/results/gc-pauses-<machine>.md]

The server runs in this process on the CPU (so the collector's callbacks see it); `voxserve bench` drives
batch-1 traffic at concurrency 64 from a child process. Reported per variant: the rate, p99, and each full
(generation 2) collection's pause, during which the event loop, and every request waiting on it, stood still.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(frozen: bool, seconds: float, weights: str | None) -> str:
    sys.path.insert(0, str(REPO))
    from tests.conftest import running_server

    pauses: list[float] = []
    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                pauses.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(watch)
    try:
        with running_server(**({"weights": weights} if weights else {})) as srv:
            assert srv.wait_ready()
            if not frozen:
                gc.unfreeze()
            pauses.clear()
            out = subprocess.run([sys.executable, "-m", "voxserve", "bench", "--url", srv.url, "--batch", "1",
                                  "--concurrency", "64", "--duration", str(seconds), "--json"],
                                 capture_output=True, text=True, check=True).stdout
    finally:
        gc.callbacks.remove(watch)
        gc.unfreeze()
    level = json.loads(out)["levels"][0]
    shown = ", ".join(f"{p:.1f}" for p in pauses) or "none"
    return (f"| {'frozen' if frozen else 'not frozen'} | {level['requests_per_s']:.0f} | {level['p99_ms']:.1f} | "
            f"{len(pauses)} | {shown} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--weights", default=None, help="a safetensors file (default: the reference weights)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [run(frozen, args.seconds, args.weights) for frozen in (False, True)]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = "\n".join([
        "# Full garbage collections in a serving process", "",
        f"- date: {now}; {os.cpu_count()} CPU cores; server on the CPU in this process, client in a child",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- load: `voxserve bench --batch 1 --concurrency 64 --duration {args.seconds:g}`", "",
        "| start-up objects | req/s | p99 ms | full collections | each one's pause, ms |",
        "|---|---:|---:|---:|---|", *rows])
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
