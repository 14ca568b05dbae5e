"""A C++ front end against voxserve's Python one, on the same engine: are the answers the same, and what does each
cost per batch-1 request?

It starts `voxserve serve --frontends 1` (one engine, one Python front end) and connects the probe front end
(frontend.cc, gRPC's C++ callback server) to that engine as a second front end on a port of its own. Then:

- answers: the same random requests (FP32, FP16, BF16, a few shapes, raw and typed contents), one at a time so
  that each runs alone in the engine, through both front ends; the outputs must be equal to the bit. Malformed
  requests must get the same status codes (the messages differ). A burst of calls cancelled while the engine runs
  them must leave the probe with nothing pending and its arena empty (its counters, printed when it stops).
- cost: `voxserve bench` against each front end in turn (A B A B ...), and against two trivial sinks with no engine
  (`voxserve bench --compare-raw`'s in Python, bench/probes/cpp_sink's in C++: each transport's floor), every run
  under `flock /tmp/bench.lock` (the host's other benchmarks wait, and we wait for theirs), with the CPU time of the
  front end, the engine, the client and the whole host sampled from /proc over the run's own window (as
  bench/cpu_split.py samples), and the requests per engine execution from the engine's published statistics.

    bench/probes/native_frontend/build.sh [&& bench/probes/cpp_sink/build.sh]
    python bench/probes/native_frontend/compare.py [--rounds 3] [--duration 6] [--no-sink] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from voxserve.client import build_request, parse_response
from voxserve.client.bench import raw_sink
from voxserve.proto import pb
from voxserve.testing.load import ServerProcess, cpu_seconds

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
from cpu_split import machine_busy_s, role  # noqa: E402  (a script of bench/, not a package)

BINARY = ROOT / "build" / "native_frontend" / "frontend"
SINK = ROOT / "build" / "cpp_sink" / "sink"  # bench/probes/cpp_sink/build.sh: gRPC C++'s floor, for reference
INFER = "/inference.GRPCInferenceService/ModelInfer"
LOCK = "/tmp/bench.lock"
SERVE_FLAGS = ["--frontends", "1", "--device", "cpu"]


class Listener:
    """A binary that prints "listening PORT ..." once it serves."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening "):
            raise RuntimeError(f"{argv[0]} did not start: {line!r} {self.proc.stderr.read()}")
        self.url = f"127.0.0.1:{line.split()[1]}"
        self.banner = line.strip()

    def stop(self) -> str:
        """SIGTERM; its last line on stderr."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            err = self.proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            err = self.proc.communicate()[1]
        return err.strip().splitlines()[-1] if err.strip() else ""


class NativeFrontend(Listener):
    """The probe binary, connected to the engine at ``socket_path``, on a free port."""

    def __init__(self, socket_path: str, *flags: str) -> None:
        # It listens once the engine has answered its hello; when it stops it prints what it sent, received and
        # still holds.
        super().__init__([str(BINARY), "--engine", socket_path, "--port", "0", *flags])


def call(url: str, request: pb.ModelInferRequest, timeout_s: float = 30.0) -> tuple[str, bytes | None]:
    """(status code name, the serialised response or None) of one ModelInfer call."""
    with grpc.insecure_channel(url) as channel:
        try:
            return "OK", channel.unary_unary(INFER)(request.SerializeToString(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc.code().name, None


def typed_request(x: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="voxnet")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    return request


def same_answers(python_url: str, native_url: str) -> list[str]:
    """Rows of the answers table: equal outputs for valid requests, equal codes for malformed ones."""
    rng = np.random.default_rng(20261202)
    rows = []
    cases: list[tuple[str, pb.ModelInferRequest]] = []
    for datatype in ("FP32", "FP16", "BF16"):
        for shape in ((1, 3, 3, 3, 3), (2, 3, 5, 4, 6), (4, 3, 8, 9, 7), (1, 3, 16, 32, 32)):
            x = rng.standard_normal(shape, dtype=np.float32) * 3
            cases.append((f"{datatype} {list(shape)}", build_request(x, "voxnet", datatype, request_id="r-1")))
    cases.append(("FP32 typed contents [2, 3, 4, 4, 4]",
                  typed_request(rng.standard_normal((2, 3, 4, 4, 4), dtype=np.float32))))
    for name, request in cases:
        (code_a, a), (code_b, b) = call(python_url, request), call(native_url, request)
        if code_a != "OK" or code_b != "OK":
            rows.append(f"| {name} | {code_a} | {code_b} | no |")
            continue
        ra, rb = pb.ModelInferResponse.FromString(a), pb.ModelInferResponse.FromString(b)
        ya, yb = parse_response(ra), parse_response(rb)
        equal = ya.tobytes() == yb.tobytes() and (ra.model_name, ra.model_version, ra.id, list(ra.outputs[0].shape)) \
            == (rb.model_name, rb.model_version, rb.id, list(rb.outputs[0].shape))
        rows.append(f"| {name} | OK, {ya.shape} | OK, {yb.shape} | {'yes, to the bit' if equal else 'NO'} |")

    def bad(edit) -> pb.ModelInferRequest:
        request = build_request(np.ones((1, 3, 3, 3, 3), np.float32), "voxnet", "FP32")
        edit(request)
        return request

    def shape(dims, data=True):
        def edit(r):
            r.inputs[0].ClearField("shape")
            r.inputs[0].shape.extend(dims)
            if not data:
                r.ClearField("raw_input_contents")
        return edit

    malformed = [
        ("unknown model", lambda r: setattr(r, "model_name", "other")),
        ("unknown version", lambda r: setattr(r, "model_version", "2")),
        ("request id of 300 characters", lambda r: setattr(r, "id", "x" * 300)),
        ("two inputs", lambda r: r.inputs.add(name="input", datatype="FP32", shape=[1, 3, 3, 3, 3])),
        ("input named 'x'", lambda r: setattr(r.inputs[0], "name", "x")),
        ("datatype INT32", lambda r: setattr(r.inputs[0], "datatype", "INT32")),
        ("output 'y' requested", lambda r: setattr(r.outputs[0], "name", "y")),
        ("rank 4", shape([1, 3, 3, 3])),
        ("Cin 2", shape([1, 2, 3, 3, 3])),
        ("D 2 < k", shape([1, 3, 2, 3, 3])),
        ("a zero dimension", shape([0, 3, 3, 3, 3])),
        ("bytes 4 short", lambda r: r.raw_input_contents.__setitem__(0, r.raw_input_contents[0][:-4])),
        ("no data", lambda r: r.ClearField("raw_input_contents")),
        ("FP16 in typed contents", lambda r: (r.ClearField("raw_input_contents"),
                                              setattr(r.inputs[0], "datatype", "FP16"),
                                              r.inputs[0].contents.fp32_contents.extend([0.0] * 81))),
        ("1025 samples", shape([1025, 3, 3, 3, 3], data=False)),
        ("2^40 x 2^40 x 2^40 voxels", shape([1, 3, 2**40, 2**40, 2**40], data=False)),
        ("a NaN in the input", lambda r: r.raw_input_contents.__setitem__(
            0, np.full(81, np.nan, np.float32).tobytes())),
    ]
    for name, edit in malformed:
        request = bad(edit)
        code_a, code_b = call(python_url, request)[0], call(native_url, request)[0]
        rows.append(f"| {name} | {code_a} | {code_b} | {'yes' if code_a == code_b else 'NO'} |")
    return rows


def cancel_burst(url: str, calls: int = 12) -> str:
    """Start ``calls`` calls of 3 MB at once (a probe with an arena of 8 MiB holds two at a time: the others wait for
    room), half cancelled by the client, half by a short deadline; then one plain call, which must be answered."""
    x = np.random.default_rng(1).standard_normal((16, 3, 16, 32, 32), dtype=np.float32)
    payload = build_request(x, "voxnet", "FP32").SerializeToString()
    codes: dict[str, int] = {}
    with grpc.insecure_channel(url, options=[("grpc.max_send_message_length", 1 << 27)]) as channel:
        method = channel.unary_unary(INFER)
        futures = [method.future(payload, timeout=0.05 if i % 2 else 60) for i in range(calls)]
        time.sleep(0.03)
        for i, future in enumerate(futures):
            if not i % 2:
                future.cancel()
        for future in futures:
            try:
                future.result()
                code = "OK"
            except grpc.FutureCancelledError:
                code = "CANCELLED (client)"
            except grpc.RpcError as exc:
                code = exc.code().name
            codes[code] = codes.get(code, 0) + 1
    time.sleep(3)  # the engine finishes what it had started; its replies release the blocks
    after = call(url, build_request(np.ones((1, 3, 3, 3, 3), np.float32), "voxnet", "FP32"))[0]
    return f"{calls} calls of (16, 3, 16, 32, 32) FP32: {codes}; a call after them: {after}"


@contextlib.contextmanager
def locked():
    """The host's benchmark lock (flock(1)'s), held while the answers are checked: their large requests load the
    CPU for a few seconds."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Sampler(threading.Thread):
    """Every 0.1 s: the wall time, the host's busy CPU seconds and each process's (bench/cpu_split.py's Sampler, for
    processes that may end while sampled: the load client)."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.samples: list[tuple[float, float, dict[int, float]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            now, busy, used = time.time(), machine_busy_s(), {}
            for pid in self.pids:
                with contextlib.suppress(OSError):
                    used[pid] = cpu_seconds(pid)
            if len(used) == len(self.pids):  # (once the client has ended, the window is over)
                self.samples.append((now, busy, used))
            self.halt.wait(0.1)

    def window(self, start: float, end: float) -> tuple[float, float, dict[int, float]]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            raise RuntimeError("the load ran too briefly to sample; raise --duration")
        (t0, m0, p0), (t1, m1, p1) = inside[0], inside[-1]
        return t1 - t0, m1 - m0, {pid: p1[pid] - p0[pid] for pid in p0}


def executions(stats_file: Path) -> int:
    """The engine's executions so far, as it last published them (every 0.5 s: engine.py, core/stats.py)."""
    return int(json.loads(stats_file.read_text())["execution_count"])


def bench_run(url: str, pids: dict[int, str], bench_args: list[str], stats_file: Path) -> dict:
    """One `voxserve bench` run under the lock, with the CPU of ``pids``, of the client and of the whole host over
    the run's own window (its first request to its last answer), in us per answered request; and the requests
    per engine execution (the engine's published count, read a publication after the run)."""
    time.sleep(1.0)
    executed = executions(stats_file)
    # flock --no-fork: the client is the process flock becomes once it holds the lock, so it is sampled too.
    client = subprocess.Popen(["flock", "--no-fork", LOCK, sys.executable, "-m", "voxserve", "bench", "--url", url,
                               "--json", *bench_args], stdout=subprocess.PIPE, text=True)
    sampler = Sampler([*pids, client.pid])
    sampler.start()
    try:
        out = client.communicate()[0]
    finally:
        sampler.halt.set()
        sampler.join()
    if client.returncode:
        raise RuntimeError(f"voxserve bench exited with {client.returncode}")
    time.sleep(1.0)
    executed = executions(stats_file) - executed
    level = json.loads(out)["levels"][0]
    seconds, host_s, used = sampler.window(level["wall_start"], level["wall_end"])
    answered = level["requests_per_s"] * seconds
    us = {pids.get(pid, "client"): s / answered * 1e6 for pid, s in used.items()}
    return {"rps": level["requests_per_s"], "p50": level["p50_ms"], "p99": level["p99_ms"],
            "errors": level.get("errors", 0), "us": us, "per_execution": level["requests"] / max(1, executed),
            "rest_cores": (host_s - sum(used.values())) / seconds, "cores": host_s / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="A B pairs of bench runs")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per bench run")
    ap.add_argument("--bench", default="--batch 1 --shape 3,3,3,3 --concurrency 16",
                    help="`voxserve bench` flags, --url, --json and --duration aside")
    ap.add_argument("--sink", action=argparse.BooleanOptionalAction, default=True,
                    help="also drive trivial sinks with the same client: `voxserve bench --compare-raw`'s (Python) "
                         f"and the C++ one ({SINK.relative_to(ROOT)}, if built)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not BINARY.exists():
        print(f"{BINARY} is missing: run bench/probes/native_frontend/build.sh first", file=sys.stderr)
        return 2
    bench_args = [*args.bench.split(), "--duration", str(args.duration)]
    lines: list[str] = []
    with ServerProcess(SERVE_FLAGS) as server:  # (the probe must hang up first: the engine waits for its front ends)
        roles = {pid: role(pid, server.proc.pid) for pid in server.pids()}
        engine = next(pid for pid, r in roles.items() if r.startswith("engine"))
        python_fe = next(pid for pid, r in roles.items() if r.startswith("frontend"))
        environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{engine}/environ").read_text().split("\0") if "=" in kv)
        socket_path = environ["VOXSERVE_ENGINE_SOCKET"]
        stats_file = Path(environ["VOXSERVE_REPLICA_DIR"]) / "stats" / "engine-0.json"
        native = NativeFrontend(socket_path)
        sink = Listener([str(SINK), "0"]) if SINK.exists() and args.sink else None
        stack = contextlib.ExitStack()
        try:
            with locked():
                answers = same_answers(server.url, native.url)
                small = NativeFrontend(socket_path, "--arena-bytes", str(8 << 20), "--name", "native-probe-small")
                try:
                    cancels = cancel_burst(small.url)
                finally:
                    small_summary = small.stop()
            targets = {"Python (grpc.aio)": (server.url, {python_fe: "frontend", engine: "engine"}),
                       "C++ (grpc++ callback)": (native.url, {native.proc.pid: "frontend", engine: "engine"})}
            if sink is not None:
                targets["trivial C++ sink (grpc++ sync, no engine)"] = (sink.url, {sink.proc.pid: "frontend"})
            if args.sink:
                url = stack.enter_context(raw_sink())
                (sink_process,) = multiprocessing.active_children()
                targets["trivial Python sink (grpc.aio, no engine)"] = (url, {sink_process.pid: "frontend"})
            for url, _ in list(targets.values())[:2]:  # warm-up (the last --duration wins)
                bench_run(url, {engine: "engine"}, [*bench_args, "--duration", "2"], stats_file)
            runs: dict[str, list[dict]] = {name: [] for name in targets}
            for _ in range(args.rounds):
                for name, (url, pids) in targets.items():
                    runs[name].append(bench_run(url, pids, bench_args, stats_file))
                    print(name, runs[name][-1], file=sys.stderr)
        finally:
            summary = native.stop()
            if sink is not None:
                sink.stop()
            stack.close()
        banner = native.banner
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines += [
        "# A C++ front end against the Python one, same engine (batch 1)", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.node()}; "
        f"{os.cpu_count()} CPU cores ({platform.machine()}); CPU only; client, front ends and engine on this host",
        f"- commit {commit}; `voxserve serve {' '.join(SERVE_FLAGS)}` and the probe "
        f"(`bench/probes/native_frontend/frontend.cc`, gRPC {grpc_version()}) connected to its engine: `{banner}`",
        f"- command: `python bench/probes/native_frontend/compare.py {' '.join(sys.argv[1:])}`; each run: `flock "
        f"--no-fork {LOCK} python -m voxserve bench {' '.join(bench_args)} --url <target>`, the targets in turn "
        f"({args.rounds} rounds), after a 2 s warm-up run of each front end",
        "", "## Answers", "", "| request | Python front end | C++ front end | same |", "|---|---|---|---|", *answers,
        "", f"Cancellation, through a second probe with an 8 MiB arena: {cancels}. That probe when it stopped: "
        f"{small_summary}. The measured probe when it stopped: {summary}.", "",
        "## Cost per request", "",
        "| front end | run | req/s | p50 ms | p99 ms | front-end (or sink) CPU us/req | engine CPU us/req "
        "| client CPU us/req | requests per engine execution | host cores busy | of which by other processes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = [(name, i) for i in range(args.rounds) for name in runs]  # the order they ran in
    for n, (name, i) in enumerate(order, 1):
        r = runs[name][i]
        engine_us = f"{r['us']['engine']:.0f}" if "engine" in r["us"] else "-"
        per_execution = f"{r['per_execution']:.1f}" if "engine" in r["us"] else "-"
        lines.append(f"| {name} | {n} | {r['rps']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
                     f"{r['us']['frontend']:.0f} | {engine_us} | {r['us']['client']:.0f} | {per_execution} | "
                     f"{r['cores']:.2f} | {r['rest_cores']:.2f} |" + (f" {r['errors']} errors" if r["errors"] else ""))
    lines += ["", "Medians over the runs:", "",
              "| front end | req/s | p50 ms | p99 ms | front-end CPU us/req | engine CPU us/req |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, rs in runs.items():
        def med(f, rs=rs):
            return statistics.median(f(r) for r in rs)
        engine_us = f"{med(lambda r: r['us']['engine']):.0f}" if "engine" in rs[0]["us"] else "-"
        lines.append(f"| {name} | {med(lambda r: r['rps']):.0f} | {med(lambda r: r['p50']):.1f} | "
                     f"{med(lambda r: r['p99']):.1f} | {med(lambda r: r['us']['frontend']):.0f} | {engine_us} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def grpc_version() -> str:
    out = subprocess.run(["pkg-config", "--modversion", "grpc++"], capture_output=True, text=True).stdout.strip()
    return f"C++ {out or '?'}, Python grpcio {grpc.__version__}"


if __name__ == "__main__":
    sys.exit(main())
