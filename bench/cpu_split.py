"""CPU time per request, split by process: each server role (supervisor, front ends, engines, in-process
server), the load client with whatever else runs on the host, and, for comparison, a trivial gRPC sink
driven by the same client.

At a fixed concurrency a server's rate is bound by its slowest stage; on a host shared with the client it
is bound by the cores everyone shares. Both show here as CPU microseconds per answered request. The host's
and each server process's CPU time are sampled every 0.1 s and taken over the load's own window (from its
first request to its last answer), so the client's start-up is not counted.

    python bench/cpu_split.py --config="--frontends 6" --config="--frontends 6 --no-batching" \\
        --bench="--batch 1 --concurrency 64 --duration 6 --processes 8 --connections 16" \\
        [--profile] --out bench/results/cpu-split-<machine>.md

--profile samples each server process with py-spy (installed separately) during a second run of each
configuration and lists where its interpreter time goes (innermost frames).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import provenance  # bench/ (this script's folder)

from voxserve.client.bench import raw_sink
from voxserve.testing.load import ServerProcess, cpu_seconds

HZ = os.sysconf("SC_CLK_TCK")


def role(pid: int, root: int) -> str:
    if pid == root:
        return "server"  # the in-process server, or the supervisor of several
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    if argv[0].endswith("voxserve-frontend"):  # a native front end (--frontend-impl native), named by --name
        return "native " + (argv[argv.index("--name") + 1] if "--name" in argv[:-1] else "?")
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    kind, index = env.get("VOXSERVE_ROLE", "replica"), env.get("VOXSERVE_REPLICA_INDEX", "?")
    return index if index.startswith(kind) else f"{kind}-{index}"


def machine_busy_s() -> float:
    """CPU seconds the whole host has spent busy (all cores, /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / HZ


class Sampler(threading.Thread):
    """Every ``period_s``: the wall time, the host's busy CPU seconds and each server process's."""

    def __init__(self, pids: list[int], period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pids, self.period_s = pids, period_s
        self.samples: list[tuple[float, float, dict[int, float]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append((time.time(), machine_busy_s(), {pid: cpu_seconds(pid) for pid in self.pids}))
            self.halt.wait(self.period_s)

    def window(self, start: float, end: float) -> tuple[float, float, dict[int, float]]:
        """(seconds, host busy seconds, per-process seconds) between the first and last samples inside
        [start, end]."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            raise RuntimeError("the load ran too briefly to sample; raise --duration")
        (t0, m0, p0), (t1, m1, p1) = inside[0], inside[-1]
        return t1 - t0, m1 - m0, {pid: p1[pid] - p0[pid] for pid in p0}


def bench_command(url: str, bench_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "voxserve", "bench", "--url", url, "--json", *bench_args]


def level(stdout: str) -> dict:
    return json.loads(stdout)["levels"][0]


def profile(pids: dict[int, str], url: str, bench_args: list[str], lead_s: float, seconds: float,
            keep_dir: str | None, name: str) -> list[str]:
    """py-spy on each server process for ``seconds``, starting ``lead_s`` after a longer load run is launched
    (its processes start and meet first); the innermost frames of each, and the raw profiles in keep_dir."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    pids = {pid: label for pid, label in pids.items() if not label.startswith("native")}  # (C++: no Python frames)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        client = subprocess.Popen(bench_command(url, [*bench_args, "--duration", str(lead_s + seconds + 3)]),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        time.sleep(lead_s)
        spy_start = time.time()
        spies = [subprocess.Popen([py_spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "500", "-f",
                                   "raw", "-o", f"{tmp}/{pid}.txt", "--nonblocking"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for pid in pids]
        for spy in spies:
            spy.wait(seconds + 60)
        result = level(client.communicate()[0])
        if not result["wall_start"] <= spy_start:
            rows.append(f"|  | (profiles started before the load did: raise the lead of {lead_s} s) | | | | |")
        for pid, label in pids.items():
            path = Path(f"{tmp}/{pid}.txt")
            if not path.exists():
                continue
            rows.append(f"|  | {label}: " + "; ".join(top_frames(path)) + " | | | | |")
            rows.append(f"|  | {label}, whose time: " + "; ".join(split_by_owner(path)) + " | | | | |")
            if keep_dir:
                tag = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
                shutil.copy(path, Path(keep_dir) / f"{tag}.{label}.txt")
    return rows


def top_frames(path: Path, n: int = 12) -> list[str]:
    own, total = Counter(), 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            own[stack.split(";")[-1]] += int(count)
            total += int(count)
    return [f"{c / total:.0%} {frame}" for frame, c in own.most_common(n)] if total else []


# Whose a sample is, by its frames (outermost first): the first rule that matches any frame decides.
OWNERS = (
    ("metrics (prometheus_client)", re.compile(r"prometheus_client/")),
    # (engine.py's serve and run are on every stack of an engine: only its request and reply functions count here)
    ("the engine link (records, replies, arena)",
     re.compile(r"\(server/topology/(remote|ipc)\.py|^(_requests?|_connection|_segment_request|_map_then|_control|"
                r"__call__) \(server/topology/engine\.py")),
    ("the model and the batcher", re.compile(r"\((server/core|kernels)/|torch/")),
    ("gRPC's read of the message (context.read)", re.compile(r"InferenceService\.ModelInfer \(server/protocol/"
                                                              r"inference\.py:128\)$")),
    ("voxserve's request path (decode, checks, encode, statistics)",
     re.compile(r"\(server/protocol/(inference|codec|wire|shm|cudashm|admission|security)\.py")),
    ("gRPC and asyncio machinery (C and Cython callbacks, the poller, the event loop)", re.compile(r".")),
)


def split_by_owner(path: Path) -> list[str]:
    """The shares of a raw py-spy profile by OWNERS (innermost matching rule over the stack's frames wins for the
    specific owners; a stack none of them claims is gRPC's and asyncio's)."""
    shares, total = Counter(), 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        owner = next(name for name, rule in OWNERS if any(rule.search(f) for f in frames))
        shares[owner] += int(count)
        total += int(count)
    return [f"{c / total:.0%} {owner}" for owner, c in shares.most_common()] if total else []


def measure(name: str, url: str, pids: dict[int, str], bench_args: list[str], args: argparse.Namespace) -> list[str]:
    subprocess.run(bench_command(url, [*bench_args, "--duration", "2"]), check=True,
                   capture_output=True)  # warm-up (the last --duration wins)
    sampler = Sampler(list(pids))
    sampler.start()
    try:
        result = level(subprocess.run(bench_command(url, bench_args), check=True, capture_output=True,
                                      text=True).stdout)
    finally:
        sampler.halt.set()
        sampler.join()
    seconds, host_s, server = sampler.window(result["wall_start"], result["wall_end"])
    n = result["requests_per_s"] * seconds  # requests answered within the sampled window (a steady rate)
    gb = n * result["request_bytes"] / 1e9  # input tensor bytes those requests carried

    def row(label: str, cpu_s: float, busy: str) -> str:
        return f"| {name} | {label} | {cpu_s / n * 1e6:.0f} | {cpu_s / n * 1e3:.3f} | {cpu_s / gb:.2f} | {busy} |"

    rest = host_s - sum(server.values())
    rows = [row("client and the rest of the host", rest, f"{rest / seconds:.1f}")]
    by_role: dict[str, list[float]] = {}
    for pid, s in server.items():
        by_role.setdefault(pids[pid].rsplit("-", 1)[0], []).append(s)
    for r, secs in sorted(by_role.items()):
        label = r if len(secs) == 1 else f"{r} (x{len(secs)}, summed)"
        busy = f"{sum(secs) / seconds:.1f}"
        if len(secs) > 1:  # how evenly the kernel spread the connections: each process's cores busy
            busy += f" (each {min(secs) / seconds:.2f}-{max(secs) / seconds:.2f})"
        rows.append(row(label, sum(secs), busy))
    # executions within the window, at the level's requests per execution (ModelStatistics around the level)
    executions = n * result["server_executions"] / result["requests"] if result.get("server_executions") else 0
    if executions:
        engines = sum(s for pid, s in server.items() if pids[pid].startswith("engine"))
        if engines:
            rows.append(f"| {name} | engines' CPU per execution: {engines / executions * 1e6:.0f} us "
                        f"({executions:.0f} executions in the window, {n / executions:.1f} requests each) | | | | |")
    rows.append(f"| {name} | **{result['requests_per_s']:.0f} req/s**, p50 {result['p50_ms']:.1f} ms, "
                f"p99 {result['p99_ms']:.1f} ms; host {host_s / seconds:.1f} of {os.cpu_count()} cores busy | | | | |")
    if args.profile:
        rows += profile(pids, url, bench_args, args.profile_lead_s, 5.0, args.profile_dir, name)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None,
                        help="`voxserve serve` flags of one configuration (repeatable) [default: '' and "
                             "'--no-batching']")
    parser.add_argument("--bench", default="--batch 1 --concurrency 64 --duration 6",
                        help="`voxserve bench` flags, --url and --json aside")
    parser.add_argument("--sink", action=argparse.BooleanOptionalAction, default=True,
                        help="also drive a trivial gRPC sink (one process) with the same client")
    parser.add_argument("--profile", action="store_true", help="sample the server processes with py-spy")
    parser.add_argument("--profile-lead-s", type=float, default=6.0,
                        help="seconds from launching the profiled load run to the profiles' start")
    parser.add_argument("--profile-dir", default=None, help="keep the raw py-spy profiles here")
    parser.add_argument("--commit", default=None, help="the commit measured, for the report (default: "
                        "$VOXSERVE_COMMIT, else git's HEAD here)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bench_args = shlex.split(args.bench)
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    rows = []
    for flags in args.config if args.config is not None else ["", "--no-batching"]:
        with ServerProcess(shlex.split(flags)) as server:
            pids = {pid: role(pid, server.proc.pid) for pid in server.pids()}
            rows += measure(f"`serve {flags}`", server.url, pids, bench_args, args)
    if args.sink:
        with raw_sink() as url:
            sinks = {p.pid: "sink" for p in multiprocessing.active_children()}  # the sink's process
            rows += measure("raw gRPC sink", url, sinks, bench_args, args)
    device = "CPU only"
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            device = torch.cuda.get_device_name(0)
    lines = ["# CPU time per request, by process", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {socket.gethostname()}; "
             f"{os.cpu_count()} CPU cores; {device}; client and server on this host over loopback",
             f"- command: `python bench/cpu_split.py {shlex.join(sys.argv[1:])}`",
             f"- commit: {provenance.commit(args.commit)}",
             f"- client: `voxserve bench {args.bench}`", "",
             "| server | process | CPU us per request | CPU s per 1k requests | CPU s per GB ingested | cores busy |",
             "|---|---|---:|---:|---:|---:|", *rows, "",
             "GB ingested: the requests' input tensor bytes (on the wire or in shared memory), 1e9 bytes."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
