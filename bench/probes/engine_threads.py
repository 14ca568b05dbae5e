"""The engine's threads under load: CPU time per thread and the cores each ran on, per repeat, for one
server configuration (default: twelve front ends without batching, where the engine's one core bounds the
rate). With ``--pin CPUS`` every engine thread is pinned to those cores before the load starts.

    python bench/probes/engine_threads.py [--config "--frontends 12 --no-batching"] [--repeats 3] [--pin 2] \\
        [--bench "--batch 1 --concurrency 64 --duration 6 --processes 8 --connections 16"] [--out FILE]

Each repeat starts a fresh server. Reported per repeat: the rate, the engine's CPU microseconds per request,
and for each engine thread busy more than 2 % of the window its share of a core and the distinct cores it
was seen on (sampled every 10 ms from /proc/<pid>/task/<tid>/stat).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from voxserve.testing.load import ServerProcess, proc_stat, stat_cpu_seconds


def engine_pid(server: ServerProcess) -> int:
    for pid in server.pids():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"VOXSERVE_ROLE=engine" in environ:
            return pid
    raise RuntimeError("no engine process: this configuration needs --frontends")


def thread_stats(pid: int) -> dict[int, tuple[str, float, int]]:
    """tid -> (name, CPU seconds, the core it last ran on)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name, fields = proc_stat(task / "stat")
        except OSError:
            continue
        out[int(task.name)] = (name, stat_cpu_seconds(fields), int(fields[36]))  # 36: the core it last ran on
    return out


def run_once(flags: str, bench_args: list[str], pin: str | None) -> list[str]:
    with ServerProcess(shlex.split(flags)) as server:
        pid = engine_pid(server)
        if pin is not None:
            subprocess.run(["taskset", "-a", "-cp", pin, str(pid)], check=True, capture_output=True)
        samples: list[tuple[float, dict]] = []
        halt = threading.Event()

        def sample() -> None:
            while not halt.is_set():
                samples.append((time.time(), thread_stats(pid)))
                halt.wait(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            out = subprocess.run([sys.executable, "-m", "voxserve", "bench", "--url", server.url, "--json",
                                  *bench_args], check=True, capture_output=True, text=True).stdout
        finally:
            halt.set()
            sampler.join()
    level = json.loads(out)["levels"][0]
    inside = [s for s in samples if level["wall_start"] <= s[0] <= level["wall_end"]]
    (t0, first), (t1, last) = inside[0], inside[-1]
    seconds = t1 - t0
    requests = level["requests_per_s"] * seconds
    used = sum(v[1] for v in last.values()) - sum(v[1] for v in first.values())
    rows = [f"| {level['requests_per_s']:.0f} | {used / seconds:.2f} cores, {used / requests * 1e6:.0f} us/request | "]
    threads = []
    for tid, (name, cpu, _core) in sorted(last.items()):
        busy = (cpu - first.get(tid, (name, 0.0, 0))[1]) / seconds
        if busy > 0.02:
            cores = sorted({s[1][tid][2] for s in inside if tid in s[1]})
            label = "main" if tid == pid else name
            threads.append(f"{label} {busy:.0%} on {len(cores)} core{'s' if len(cores) > 1 else ''}")
    rows[0] += "; ".join(threads) + " |"
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="--frontends 12 --no-batching", help="`voxserve serve` flags")
    parser.add_argument("--bench", default="--batch 1 --concurrency 64 --duration 6 --processes 8 --connections 16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pin", default=None, help="pin every engine thread to these cores (taskset list: 2 or 2,3)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeats):
        rows += run_once(args.config, shlex.split(args.bench), args.pin)
        print(rows[-1], file=sys.stderr)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    pinned = "" if args.pin is None else f", engine pinned to cores {args.pin}"
    report = "\n".join([
        f"# Engine threads: `serve {args.config}`{pinned}",
        "", f"- date: {now}; {os.cpu_count()} CPU cores", f"- command: `python {shlex.join(sys.argv)}`",
        f"- client: `voxserve bench {args.bench}`", "",
        "| req/s | engine CPU | engine threads (share of a core; cores seen on) |", "|---:|---|---|", *rows])
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
