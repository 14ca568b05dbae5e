"""The reliability report: fuzzing, overload, SIGTERM under load, with the figures written to
bench/results/reliability.md (or --out).

    python bench/reliability.py                       # 1e5 fuzz inputs per engine, 20 s overload, 3 drains
    python bench/reliability.py --fuzz-inputs 2000 --overload-s 5 --drains 1 --out /tmp/r.md   # a quick look

The server runs on the CPU in a child process on this machine; the load generator shares the machine, so
absolute rates say more about the box than about voxserve. What the report shows is the behaviour: every
request answered, the refusals, the memory ceiling, recovery, and that nothing accepted is lost.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from fuzz_infer import run_atheris, run_grpc  # noqa: E402

from voxserve.client import build_request  # noqa: E402
from voxserve.testing.load import ServerProcess, closed_loop, open_loop, sample_rss  # noqa: E402

SHAPE = (8, 3, 16, 32, 32)
QUEUE = 32


def overload(seconds: float, factor: float, extra: list[str]) -> dict:
    x = np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32)
    body = build_request(x, "voxnet", "FP32").SerializeToString()
    with ServerProcess(["--device", "cpu", "--max-queue-size", str(QUEUE), *extra]) as server:
        idle_rss = server.rss_mb()
        capacity = asyncio.run(closed_loop(server.url, body, 16, 5.0))
        stop = threading.Event()
        rss: list[float] = []
        sampler = threading.Thread(target=lambda: rss.extend(sample_rss(server, stop, 0.1)))
        sampler.start()
        try:
            load = asyncio.run(open_loop(server.url, body, factor * capacity.rate(), seconds, timeout_s=60,
                                         connections=16))
        finally:
            stop.set()
            sampler.join()
        after = asyncio.run(closed_loop(server.url, body, 16, 5.0))
        peak = server.peak_rss_mb()
        alive = server.alive()
    third = max(1, len(rss) // 3)
    return {"capacity": capacity, "load": load, "after": after, "idle_rss": idle_rss, "rss": rss, "peak": peak,
            "alive": alive, "first_third_max": max(rss[:third]), "last_third_max": max(rss[-third:]),
            "factor": factor, "seconds": seconds}


def drain(rounds: int, extra: list[str]) -> list[dict]:
    x = np.random.default_rng(2).standard_normal(SHAPE, dtype=np.float32)
    body = build_request(x, "voxnet", "FP32").SerializeToString()
    results = []
    for _ in range(rounds):
        with ServerProcess(["--device", "cpu", "--grace-period-s", "30", *extra]) as server:
            capacity = asyncio.run(closed_loop(server.url, body, 8, 2.0))
            exits: list[tuple[int, float]] = []

            def terminate(server=server, exits=exits) -> None:
                t0 = time.monotonic()
                server.signal(signal.SIGTERM)
                exits.append((server.wait(60), time.monotonic() - t0))

            load = asyncio.run(open_loop(server.url, body, 0.7 * capacity.rate(), 8.0, timeout_s=60,
                                         during=terminate))
            # One closing line per process that served gRPC (several with --frontends): their sums.
            m = re.findall(r"stopped: (\d+) requests admitted, (\d+) answered OK, (\d+) abandoned", server.log_text())
            admitted, answered, abandoned = (sum(int(g[i]) for g in m) for i in range(3)) if m else (-1, -1, -1)
            lost = admitted - (capacity.ok + load.ok) if m else None
            results.append({"load": load, "exit": exits[0][0], "exit_s": exits[0][1], "admitted": admitted,
                            "answered": answered, "abandoned": abandoned, "client_ok": capacity.ok + load.ok,
                            "lost": lost})
    return results


def _codes(load) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(load.codes.items()))


def render(args, fuzz: list[dict], ov: dict | None, drains: list[dict], elapsed_s: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = shlex.join(["python", "bench/reliability.py", *sys.argv[1:]])
    lines = [
        "# Reliability report",
        "",
        f"- date: {now}; machine: {platform.node() or 'unknown'}, {os.cpu_count()} CPUs, "
        f"{platform.python_implementation()} {platform.python_version()}; server on the CPU in a child process"
        f"{f' with --frontends {args.frontends}' if args.frontends else ''}, load generator on the same machine",
        f"- command: `{command}`",
        f"- total time: {elapsed_s:.0f} s",
        "",
        "## Fuzzing ModelInfer",
        "",
        "Property: every input is answered OK or with a specific refusal (INVALID_ARGUMENT, NOT_FOUND, "
        "RESOURCE_EXHAUSTED, UNIMPLEMENTED); never UNKNOWN/INTERNAL, no hang, no crash; the server answers "
        "correctly afterwards.",
        "",
        "| engine | inputs | time | result | details |",
        "|---|---:|---:|---|---|",
    ]
    for r in fuzz:
        if r["engine"] == "atheris":
            details = f"coverage-guided (libFuzzer) on request decoding; final coverage {r['coverage']}"
        else:
            codes = ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items()))
            details = (f"structure-aware + byte mutations over gRPC to a live server: {codes}; slowest answer "
                       f"{r['slowest_s'] * 1e3:.0f} ms; server peak RSS {r['peak_rss_mb']:.0f} MB; "
                       f"correct afterwards: {'yes' if r['correct_after'] else 'NO'}")
        lines.append(f"| {r['engine']} | {r['inputs']} | {r['seconds']:.0f} s | "
                     f"{'no violations' if r['ok'] else '**VIOLATIONS**'} | {details} |")
    if ov is not None:
        cap, load, after = ov["capacity"], ov["load"], ov["after"]
        refused = load.codes.get("UNAVAILABLE", 0) + load.codes.get("RESOURCE_EXHAUSTED", 0)
        lines += [
            "",
            "## Overload",
            "",
            f"Requests of {list(SHAPE)} FP32, `--max-queue-size {QUEUE}`. Capacity measured closed-loop "
            f"(16 outstanding, 5 s); then an open loop offers {ov['factor']:.0f}x that rate for {ov['seconds']:.0f} s "
            "whatever the answers; then capacity again.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| capacity before | {cap.rate():.0f} req/s (p50 {cap.percentile_ms('OK', 50):.1f} ms) |",
            f"| offered | {load.offered} requests at {load.offered / ov['seconds']:.0f} req/s |",
            f"| answered | {load.answered} of {load.offered} ({_codes(load)}) |",
            f"| served during overload | {load.ok / load.seconds:.0f} req/s; OK latency p50 "
            f"{load.percentile_ms('OK', 50):.0f} ms, p99 {load.percentile_ms('OK', 99):.0f} ms |",
            f"| refused | {refused}; refusal latency p50 {load.percentile_ms('UNAVAILABLE', 50):.0f} ms, "
            f"p99 {load.percentile_ms('UNAVAILABLE', 99):.0f} ms |",
            f"| timeouts / other errors | {load.answered - load.ok - refused} |",
            f"| server RSS | idle {ov['idle_rss']:.0f} MB; max in first third {ov['first_third_max']:.0f} MB, in last "
            f"third {ov['last_third_max']:.0f} MB; kernel high-water mark {ov['peak']:.0f} MB |",
            f"| capacity after | {after.rate():.0f} req/s ({after.rate() / cap.rate():.0%} of before), "
            f"{_codes(after)} |",
            f"| server alive afterwards | {'yes' if ov['alive'] else 'NO'} |",
        ]
    if drains:
        lines += [
            "",
            "## SIGTERM under load",
            "",
            "An open loop at 0.7x capacity for 8 s; SIGTERM at 4 s; the load goes on. The server's closing log line "
            "accounts for every request it admitted; the client counts what it received.",
            "",
            "| round | offered | client saw | admitted (server) | answered OK (server) | abandoned | lost | exit | "
            "exit after SIGTERM |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for i, d in enumerate(drains, 1):
            lines.append(f"| {i} | {d['load'].offered} | {_codes(d['load'])} | {d['admitted']} | {d['answered']} | "
                         f"{d['abandoned']} | {d['lost']} | {d['exit']} | {d['exit_s']:.1f} s |")
        lines += ["", "lost = admitted by the server - successes received by clients."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fuzz-inputs", type=int, default=100_000)
    parser.add_argument("--overload-s", type=float, default=20.0)
    parser.add_argument("--overload-factor", type=float, default=4.0)
    parser.add_argument("--drains", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--frontends", type=int, default=0,
                        help="run the overload and SIGTERM parts against voxserve --frontends N")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "reliability.md"))
    args = parser.parse_args(argv)
    extra = ["--frontends", str(args.frontends)] if args.frontends else []
    seed = args.seed if args.seed is not None else int(time.time()) % 2**31
    t0 = time.perf_counter()
    crash_dir = Path("/tmp/voxserve-fuzz")
    fuzz = []
    if args.fuzz_inputs:
        print(f"fuzzing: {args.fuzz_inputs} inputs per engine (seed {seed})", file=sys.stderr)
        fuzz = [run_atheris(args.fuzz_inputs, seed, crash_dir), run_grpc(args.fuzz_inputs, seed, 4, crash_dir)]
    ov = None
    if args.overload_s > 0:
        print(f"overload: {args.overload_factor}x capacity for {args.overload_s} s", file=sys.stderr)
        ov = overload(args.overload_s, args.overload_factor, extra)
    print(f"drain: {args.drains} rounds", file=sys.stderr)
    drains = drain(args.drains, extra)
    text = render(args, fuzz, ov, drains, time.perf_counter() - t0)
    Path(args.out).write_text(text)
    print(text)
    ok = all(r["ok"] for r in fuzz) and all(d["lost"] == 0 and d["abandoned"] == 0 and d["exit"] == 0
                                             for d in drains)
    if ov is not None:
        load = ov["load"]
        ok = ok and ov["alive"] and load.answered == load.offered and set(load.codes) <= {
            "OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
