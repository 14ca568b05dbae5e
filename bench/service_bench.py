"""The service benchmark: raw gRPC ceiling vs voxserve vs Triton vs MLServer, driven by one client, in one run.

    python bench/service_bench.py --out bench/results/service-<machine>.md [--mlserver-pythonpath DIR]
        [--mlserver-python PY] [--triton [WHEEL]] [--device auto] [--duration 5]

Scenarios (all through `voxserve.client.bench.run_level`: pre-serialised requests, N concurrent workers):
  1. full-batch FP32 over gRPC: a trivial sink (the transport's ceiling), voxserve, Triton, MLServer;
  2. the same batch as FP16 on the wire (voxserve, Triton);
  3. the same batch in system shared memory (voxserve, Triton; a client on the same host);
  4. batch-1 traffic at concurrency 64: voxserve with batching, without (--no-batching), Triton, MLServer;
  5. the full batch and batch 1 over the REST form (bench/rest_load.py), the tensor as binary data (Triton's
     extension) and as JSON numbers: voxserve's REST port, Triton's HTTP endpoint;
  6. on a GPU, the full batch and batch 1 in CUDA shared memory (this process's device memory, allocated and
     exported by voxserve.client's CudaBuffer: needs cuda-bindings, voxserve[cuda]): voxserve in process, Triton.
With --frontends N, voxserve also runs with N gRPC front ends before its engine (rows of their own); the
batch-1 client is --processes load processes over --connections connections, the same for every server.
Triton (--triton: the nvidia-pytriton wheel's path, or an installed pytriton) runs voxserve's own model
code in its Python backend (bench/triton_peer/: one model per input datatype, dynamic batching,
--triton-instances each) in every table; without it its rows are skipped and the report says why.
MLServer runs the same model as a custom runtime with eager PyTorch (bench/mlserver_peer/), in its own
process and Python environment (--mlserver-python, or this one with --mlserver-pythonpath prepended).
Every server runs on this machine beside the client, one at a time; --out is rewritten after each (a run cut
short keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import provenance  # bench/ (this script's folder), as rest_load and triton_peer
from rest_load import rest_body, run_rest_level
from triton_peer.server import TritonUnavailable, triton_server

from voxserve.client import Client, build_request
from voxserve.client.bench import (
    LevelResult,
    raw_sink,
    run_level_over,
    setup_cuda_shared_memory,
    setup_shared_memory,
)
from voxserve.datatypes import to_wire
from voxserve.testing.load import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]
SAMPLE = (3, 16, 32, 32)
TRITON = "Triton"
TITLES = {"full": "Full batch, FP32 over gRPC", "fp16": "Full batch, FP16 on the wire",  # the tables, in order
          "shm": "Full batch in system shared memory", "cuda_shm": "Full batch in CUDA shared memory (the client's "
          "GPU memory)", "batch1": "Batch 1 at concurrency 64", "cuda_shm_batch1": "Batch 1 in CUDA shared memory "
          "at concurrency 64", "rest_full": "Full batch, FP32 over REST",
          "rest_batch1": "Batch 1 over REST at concurrency 64"}


def wanted(args, *tables: str) -> bool:
    """Whether any of ``tables`` (TITLES' keys) is asked for (--tables; every one without it)."""
    return args.tables is None or any(t in args.tables for t in tables)


@contextlib.contextmanager
def mlserver(python: str, pythonpath: str | None, timeout_s: float = 300.0):
    """MLServer with the eager-PyTorch runtime on free ports; yields its gRPC address."""
    with tempfile.TemporaryDirectory(prefix="voxnet-mlserver-") as root:
        from voxserve.kernels import reference_weights  # (torch: not in the load processes, which import this)

        w, b = reference_weights()
        model_dir = Path(root) / "voxnet"
        model_dir.mkdir()
        np.savez(model_dir / "weights.npz", weight=w.numpy(), bias=b.numpy())
        (model_dir / "model-settings.json").write_text(json.dumps({
            "name": "voxnet", "implementation": "voxnet_runtime.VoxnetEager", "parameters": {"uri": "./weights.npz"}}))
        grpc_port = free_port()
        (Path(root) / "settings.json").write_text(json.dumps({
            "grpc_port": grpc_port, "http_port": free_port(), "metrics_port": free_port(), "parallel_workers": 0,
            "grpc_max_message_length": 512 * 1024 * 1024}))
        paths = [str(REPO / "bench" / "mlserver_peer")] + ([pythonpath] if pythonpath else [])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
        log = open(Path(root) / "mlserver.log", "w+")  # noqa: SIM115 - read back on failure
        proc = subprocess.Popen([python, "-c", "import sys; from mlserver.cli.main import main; "
                                 "sys.argv = ['mlserver', 'start', sys.argv[1]]; main()", root],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
        url = f"127.0.0.1:{grpc_port}"
        try:
            deadline = time.monotonic() + timeout_s
            with Client(url, timeout_s=2) as c:
                while not c.is_ready():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(f"MLServer did not become ready:\n{log.read()[-3000:]}")
                    time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def level(url: str, payload: bytes, samples: int, tensor_bytes: int, concurrency: int, target: str,
          duration_s: float, processes: int = 1, connections: int = 1, model: str = "voxnet") -> LevelResult:
    print(f"  {target}: {samples} samples x c={concurrency}", file=sys.stderr, flush=True)
    common = dict(duration_s=duration_s, requests=None, model=model, target=target, timeout_s=300.0,
                  connections=connections)
    return run_level_over(url, payload, samples, tensor_bytes, concurrency, processes=processes, **common)


def rest_level(host_port: str, x: np.ndarray, binary: bool, concurrency: int, target: str, duration_s: float,
               processes: int = 1, model: str = "voxnet") -> LevelResult:
    """One level over the REST form: the tensor as binary data (Triton's extension) or as JSON numbers."""
    body, json_length = rest_body(x, "FP32", binary)
    kind = "binary" if binary else "JSON"
    print(f"  {target} (REST {kind}): {len(x)} samples x c={concurrency}", file=sys.stderr, flush=True)
    common = dict(duration_s=duration_s, requests=None, model=model, target=f"{target}, REST {kind}",
                  timeout_s=300.0)
    # (no ModelStatistics: the host and port are REST's)
    return run_level_over(host_port, body, len(x), x.nbytes, concurrency, processes=processes, statistics=False,
                          driver=run_rest_level, driver_options={"json_length": json_length}, **common)


def rest_rows(args, out: dict[str, list[LevelResult]], host_port: str, full: np.ndarray, target: str,
              model: str = "voxnet", full_json: bool = True) -> None:
    """A server's REST rows: full batches (binary; with ``full_json`` also JSON at c=1: a 128-sample batch is
    ~130 MB of JSON) and batch 1 at c=64 (binary and JSON)."""
    d, one = args.duration, full[:1].copy()
    if wanted(args, "rest_full"):
        for c in args.full_concurrency:
            out["rest_full"].append(rest_level(host_port, full, True, c, target, d, args.full_processes, model=model))
        if full_json:
            out["rest_full"].append(rest_level(host_port, full, False, 1, target, d, model=model))
    if wanted(args, "rest_batch1"):
        for binary in (True, False):
            out["rest_batch1"].append(rest_level(host_port, one, binary, 64, target, d, args.processes, model=model))


def cuda_rows(args, out: dict[str, list[LevelResult]], url: str, full: np.ndarray, notes: list[str], target: str,
              model: str = "voxnet", connections: int = 1) -> None:
    """A server's CUDA shared-memory rows: input and output in device memory of this process (voxserve.client's
    CudaBuffer, exported by CUDA IPC), the full batch at each full concurrency (over ``connections``) and batch 1
    at c=64; or a note saying why there are none."""
    fp = args.full_processes  # load processes of the full-batch levels
    d, load = args.duration, (args.processes, args.connections)
    one = full[:1].copy()
    try:
        if wanted(args, "cuda_shm"):
            payload, cleanup = setup_cuda_shared_memory(url, full, "FP32", model)
            try:
                for c in args.full_concurrency:
                    out["cuda_shm"].append(level(url, payload, args.batch, full.nbytes, c, target, d, fp, connections,
                                                 model=model))
            finally:
                cleanup()
        if wanted(args, "cuda_shm_batch1"):
            payload, cleanup = setup_cuda_shared_memory(url, one, "FP32", model)
            try:
                out["cuda_shm_batch1"].append(level(url, payload, 1, one.nbytes, 64, target, d, *load, model=model))
            finally:
                cleanup()
    except Exception as exc:  # no GPU, no CUDA IPC, no cuda-bindings here: the other rows are still worth their report
        traceback.print_exc()
        notes.append(f"{target}: no CUDA shared-memory rows ({type(exc).__name__}: {str(exc).splitlines()[0]})")


def triton_rows(args, out: dict[str, list[LevelResult]], full: np.ndarray, notes: list[str],
                checkpoint: Callable[[dict[str, list[LevelResult]]], None] = lambda rows: None) -> None:
    """Triton's rows in every table, or a note saying why there are none."""
    fp = args.full_processes  # load processes of the full-batch levels
    one = full[:1].copy()
    d, load = args.duration, (args.processes, args.connections)
    n32, n16, n1 = full.nbytes, len(to_wire(full, "FP16")), one.nbytes
    try:
        with triton_server(args.triton, instances=args.triton_instances, device=args.device,
                           max_batch=max_batch(args)) as triton:
            notes.append(f"{TRITON}: Triton Inference Server {triton.version} (nvidia-pytriton 0.7.0's tritonserver), "
                         f"Python backend running voxserve's Model (bench/triton_peer/), models "
                         f"{', '.join(triton.models.values())}, {triton.instances} instances each, dynamic batching "
                         f"(max_batch_size {max_batch(args)}, no queue delay)")
            m32, m16 = triton.models["FP32"], triton.models["FP16"]
            fp32 = build_request(full, m32, "FP32").SerializeToString()
            fp16 = build_request(full, m16, "FP16").SerializeToString()
            single = build_request(one, m32, "FP32").SerializeToString()
            for c in args.full_concurrency if wanted(args, "full") else ():
                out["full"].append(level(triton.url, fp32, args.batch, n32, c, TRITON, d, fp, model=m32))
            for c in args.full_concurrency if wanted(args, "fp16") else ():
                out["fp16"].append(level(triton.url, fp16, args.batch, n16, c, TRITON, d, fp, model=m16))
            if wanted(args, "shm"):
                payload, cleanup = setup_shared_memory(triton.url, full, "FP32", m32)
                try:
                    for c in args.full_concurrency:
                        out["shm"].append(level(triton.url, payload, args.batch, n32, c, TRITON, d, fp, model=m32))
                finally:
                    cleanup()
            if wanted(args, "batch1"):
                out["batch1"].append(level(triton.url, single, 1, n1, 64, TRITON, d, *load, model=m32))
            if args.device != "cpu":
                cuda_rows(args, out, triton.url, full, notes, TRITON, model=m32)
            rest_rows(args, out, triton.http_url, full, TRITON, model=m32)
            checkpoint(out)  # before Triton stops: its stop has outlasted a run's time limit
    except TritonUnavailable as exc:
        print(f"Triton's rows skipped: {exc}", file=sys.stderr, flush=True)
        notes.append(f"{TRITON}: skipped: {str(exc).splitlines()[0]}")
    except Exception as exc:  # the other servers' rows are still worth their report
        traceback.print_exc()
        notes.append(f"{TRITON}: failed part way ({type(exc).__name__}: {str(exc).splitlines()[0]}); its rows so far "
                     "are below")


def max_batch(args) -> int:
    """Every server's most samples in one execution."""
    return args.max_batch or args.batch


def frontend_configurations(args) -> list[tuple[str, int, list[str]]]:
    """The front-end configurations asked for: (rows' name, front ends, `voxserve serve` flags)."""
    configurations = []
    engines = ["--replicas", str(args.engines)] if args.engines > 1 else []
    suffix = f", {args.engines} engines" if engines else ""
    if args.frontends:
        configurations.append((f"voxserve --frontends {args.frontends}{suffix}", args.frontends, engines))
    if args.native_frontends:
        configurations.append((f"voxserve --frontends {args.native_frontends}, native{suffix}", args.native_frontends,
                               ["--frontend-impl", "native", *engines]))
    return configurations


def voxserve_rows(args, out: dict[str, list[LevelResult]], serve: list[str], name: str, payloads: tuple,
                  notes: list[str], spread: int = 1, full_json: bool = True) -> None:
    """The rows of one voxserve configuration (``voxserve serve`` with ``serve``), named ``name``, with and without
    batching (only batch 1 without), the full-batch levels over ``spread`` connections; only the tables asked for
    (--tables), and the server without batching only for batch 1's."""
    fp = args.full_processes  # load processes of the full-batch levels
    full, fp32, fp16, single, n32, n16, n1 = payloads
    d, load = args.duration, (args.processes, args.connections)
    with ServerProcess(serve) as vox:
        for c in args.full_concurrency if wanted(args, "full") else ():
            out["full"].append(level(vox.url, fp32, args.batch, n32, c, name, d, fp, spread))
        for c in args.full_concurrency if wanted(args, "fp16") else ():
            out["fp16"].append(level(vox.url, fp16, args.batch, n16, c, name, d, fp, spread))
        if wanted(args, "shm"):
            payload, cleanup = setup_shared_memory(vox.url, full, "FP32", "voxnet")
            try:
                for c in args.full_concurrency:
                    out["shm"].append(level(vox.url, payload, args.batch, n32, c, name, d, fp, spread))
            finally:
                cleanup()
        if wanted(args, "batch1"):
            out["batch1"].append(level(vox.url, single, 1, n1, 64, name, d, *load))
        rest_rows(args, out, f"127.0.0.1:{vox.http_port}", full, name, full_json=full_json)
        if args.device != "cpu":  # (with front ends, the engines map the regions)
            cuda_rows(args, out, vox.url, full, notes, name, connections=spread)
    if wanted(args, "batch1"):
        with ServerProcess([*serve, "--no-batching"]) as vox:
            out["batch1"].append(level(vox.url, single, 1, n1, 64, f"{name}, no batching", d, *load))


def run(args, notes: list[str], checkpoint: Callable[[dict[str, list[LevelResult]]], None]
        ) -> dict[str, list[LevelResult]]:
    """Every server's rows, one server at a time; ``checkpoint`` gets the rows so far after each."""
    fp = args.full_processes  # load processes of the full-batch levels
    rng = np.random.default_rng(0)
    full = rng.standard_normal((args.batch, *SAMPLE), dtype=np.float32)
    one = full[:1].copy()
    fp32 = build_request(full, "voxnet", "FP32").SerializeToString()
    fp16 = build_request(full, "voxnet", "FP16").SerializeToString()
    single = build_request(one, "voxnet", "FP32").SerializeToString()
    n32, n16, n1 = full.nbytes, len(to_wire(full, "FP16")), one.nbytes
    payloads = (full, fp32, fp16, single, n32, n16, n1)
    d = args.duration
    load = (args.processes, args.connections)  # the batch-1 client, the same for every server
    out: dict[str, list[LevelResult]] = {key: [] for key in TITLES if wanted(args, key)}
    if wanted(args, "full"):
        with raw_sink() as sink:
            for c in args.full_concurrency:
                out["full"].append(level(sink, fp32, args.batch, n32, c, "raw sink", d, fp))
    # --max-json-bytes: the full batch as JSON (~130 MB) is a row of its own; the default (16 MiB) refuses it.
    serve = ["--device", args.device, "--max-message-bytes", str(512 * 1024 * 1024), "--max-json-bytes",
             str(256 * 1024 * 1024), "--max-batch", str(max_batch(args))]
    voxserve_rows(args, out, serve, "voxserve", payloads, notes)
    checkpoint(out)
    for name, frontends, flags in frontend_configurations(args):
        # over at least 4 connections, so that every front end gets some of the full-batch levels
        voxserve_rows(args, out, [*serve, "--frontends", str(frontends), *flags], name, payloads, notes,
                      spread=max(4, frontends), full_json=False)
        checkpoint(out)
    if args.triton:
        triton_rows(args, out, full, notes, checkpoint)
        checkpoint(out)
    else:
        notes.append(f"{TRITON}: not run (--triton not given)")
    if (args.mlserver_python or args.mlserver_pythonpath) and wanted(args, "full", "batch1"):
        with mlserver(args.mlserver_python or sys.executable, args.mlserver_pythonpath) as url:
            for c in args.full_concurrency if wanted(args, "full") else ():
                out["full"].append(level(url, fp32, args.batch, n32, c, "MLServer", d, fp))
            if wanted(args, "batch1"):
                out["batch1"].append(level(url, single, 1, n1, 64, "MLServer", d, *load))
    return out


def h2d_rate(args, nbytes: int, seconds: float = 2.0) -> float | None:
    """GB/s of host-to-device copies of ``nbytes`` from pinned memory on GPU 0 (bench/probes/h2d_probe.py's loop),
    the ceiling the system shared-memory rows are held to; None without a GPU (or with --device cpu), or if the
    system shared-memory table is not asked for."""
    if args.device == "cpu" or not wanted(args, "shm"):
        return None
    try:
        import torch
        from probes.h2d_probe import copy_loop  # bench/probes/
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    out: dict[int, float] = {}
    copy_loop(0, torch.empty(nbytes // 4, dtype=torch.float32).pin_memory(), seconds, out)
    return out[0]


def _best(rows: list[LevelResult], target: str) -> LevelResult | None:
    rows = [r for r in rows if r.target == target and r.requests]
    return max(rows, key=lambda r: r.rps) if rows else None


def render(args, out: dict[str, list[LevelResult]], device: str, seconds: float, notes: list[str],
           h2d_gb_s: float | None = None) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Service benchmark: {device}", "",
             f"- date: {now}; {os.cpu_count()} CPU cores, Python {platform.python_version()}; client and servers on "
             "the same host over loopback, one server at a time",
             f"- command: `{shlex.join(['python', 'bench/service_bench.py', *sys.argv[1:]])}` ({seconds:.0f} s)",
             f"- commit: {provenance.commit(args.commit)}",
             f"- requests: ({args.batch}, {', '.join(map(str, SAMPLE))}) for the full batch, (1, "
             f"{', '.join(map(str, SAMPLE))}) for batch 1; {args.duration:.0f} s per level; every "
             f"server's most samples in one execution: {max_batch(args)}",
             *(f"- {note}" for note in notes), ""]
    tables, out = out, {key: out.get(key, []) for key in TITLES}  # (the targets read every table: empty if not run)
    for key, rows in tables.items():
        lines += [f"## {TITLES[key]}", "", "| target | conc | req/s | samples/s | tensor MB/s | p50 ms | p90 ms | "
                  "p99 ms | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r.target} | {r.concurrency} | {r.rps:.1f} | {r.rps * r.samples_per_request:.0f} | "
                         f"{r.rps * r.request_bytes / 1e6:.0f} | {r.percentile(50):.1f} | {r.percentile(90):.1f} | "
                         f"{r.percentile(99):.1f} | {r.errors} |")
        lines.append("")
        failed = [r for r in rows if r.first_error is not None]
        for r in failed:
            status, message = r.first_error or ("", "")
            lines.append(f"- {r.target}, c={r.concurrency}: {r.errors} errors; the first: {status}: {message[:200]}")
        if failed:
            lines.append("")
    lines += ["tensor MB/s: input tensor bytes per second, on the wire or in shared memory.", "",
              "## Against the targets", "",
              "Each goal is met or missed by the rows above (best level of each server); without the rows a goal "
              "needs, it is not measured.", "", "| target | measured | goal | verdict |", "|---|---|---|---|"]

    def ratio(a: LevelResult | None, b: LevelResult | None) -> float | None:
        """a's samples/s over b's."""
        return a.rps * a.samples_per_request / (b.rps * b.samples_per_request) if a and b and b.rps else None

    def target(name: str, value: float | None, goal: float, goal_text: str, shown: str = "", strict: bool = False,
               unit: str = "x") -> None:
        if value is None:
            measured, verdict = "-", "not measured"
        else:
            measured = (f"{value:.0%}" if unit == "%" else f"{value:,.0f} req/s" if unit == "req/s" else
                        f"{value:.2f}x") + (f" ({shown})" if shown else "")
            verdict = "met" if (value > goal if strict else value >= goal) else "missed"
        lines.append(f"| {name} | {measured} | {goal_text} | {verdict} |")

    def best(key: str, targets: tuple[str, ...]) -> LevelResult | None:
        return max((r for r in (_best(out[key], t) for t in targets) if r), key=lambda r: r.rps, default=None)

    raw, vox = _best(out["full"], "raw sink"), _best(out["full"], "voxserve")
    target("full-batch FP32 vs raw gRPC ceiling", vox.rps / raw.rps if vox and raw and raw.rps else None, 0.9,
           ">= 90 %", f"{vox.rps:.1f} vs {raw.rps:.1f} req/s" if vox and raw else "", unit="%")
    target("FP16 vs FP32 samples/s", ratio(_best(out["fp16"], "voxserve"), vox), 1.8, ">= 1.8x")
    target("shared memory vs raw gRPC ceiling, samples/s", ratio(_best(out["shm"], "voxserve"), raw), 5.0,
           ">= 5x (GPU box)")
    b1 = {r.target: r for r in out["batch1"]}
    fronts = [name for name, _, _ in frontend_configurations(args)]
    for server in ["voxserve", *fronts]:
        on, off = b1.get(server), b1.get(f"{server}, no batching")
        if on and off:
            target(f"batch 1, c=64, `{server}`: batching vs none", ratio(on, off), 4.0, ">= 4x, p99 stated",
                   f"{on.rps:.0f} vs {off.rps:.0f} req/s; p99 {on.percentile(99):.0f} vs {off.percentile(99):.0f} ms")
    voxserve_targets = ("voxserve", *fronts)
    best_full, best_1 = best("full", voxserve_targets), best("batch1", voxserve_targets)
    inproc_1, front_1 = b1.get("voxserve"), best("batch1", tuple(fronts))
    target("batch 1 at c=64, in process", inproc_1.rps if inproc_1 else None, 4000, ">= 4,000 req/s",
           f"p99 {inproc_1.percentile(99):.1f} ms" if inproc_1 else "", unit="req/s")
    target("batch 1 at c=64, through front ends", front_1.rps if front_1 else None, 16000,
           ">= 16,000 req/s (goal p99 <= 10 ms)",
           f"{front_1.target}, p99 {front_1.percentile(99):.1f} ms" if front_1 else "", unit="req/s")
    target("vs MLServer (eager PyTorch), full batch", ratio(best_full, _best(out["full"], "MLServer")), 2.0, ">= 2x")
    target("vs MLServer, batch 1 at c=64", ratio(best_1, b1.get("MLServer")), 2.0, ">= 2x")
    shm_best = best("shm", voxserve_targets)
    target("system shared memory, full batch", shm_best.rps if shm_best else None, 1600, ">= 1,600 req/s",
           f"p99 {shm_best.percentile(99):.1f} ms" if shm_best else "", unit="req/s")
    shm_gb_s = shm_best.rps * shm_best.request_bytes / 1e9 if shm_best else None
    target("system shared memory, full batch, vs the host-to-device copy rate from pinned memory (this run)",
           shm_gb_s / h2d_gb_s if shm_gb_s is not None and h2d_gb_s else None, 0.75, ">= 75 %",
           f"{shm_gb_s:.1f} of {h2d_gb_s:.1f} GB/s" if shm_gb_s is not None and h2d_gb_s else "", unit="%")
    cuda_best = best("cuda_shm", voxserve_targets)
    target("CUDA shared memory, full batch", cuda_best.rps if cuda_best else None, 5000, ">= 5,000 req/s",
           f"{cuda_best.target}, p99 {cuda_best.percentile(99):.1f} ms" if cuda_best else "", unit="req/s")
    for server, where in (("voxserve", "in process"), *((fe, f"`{fe}`") for fe in fronts)):
        cuda_1, wire_1 = _best(out["cuda_shm_batch1"], server), b1.get(server)
        target(f"batch 1 at c=64: CUDA shared memory vs the wire, {where}", ratio(cuda_1, wire_1), 3.0, ">= 3x",
               f"{cuda_1.rps:.0f} vs {wire_1.rps:.0f} req/s" if cuda_1 and wire_1 else "")
    for key in tables:
        rest = key.startswith("rest")
        ours = best(key, tuple(f"{t}, REST binary" for t in voxserve_targets) if rest else voxserve_targets)
        theirs = _best(out[key], f"{TRITON}, REST binary" if rest else TRITON)
        target(f"vs Triton, {TITLES[key][0].lower()}{TITLES[key][1:]}", ratio(ours, theirs), 1.0, "> 1x",
               strict=True)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="voxserve's --device")
    parser.add_argument("--batch", type=int, default=128, help="samples in a full batch")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="most samples in one execution, every server's (voxserve's --max-batch, Triton's "
                        "max_batch_size; default --batch): above --batch the batchers merge full batches")
    parser.add_argument("--full-concurrency", type=lambda t: [int(v) for v in t.split(",")], default=[1, 4])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per level")
    parser.add_argument("--mlserver-python", default=None, help="a Python with mlserver and torch installed")
    parser.add_argument("--mlserver-pythonpath", default=None, help="prepend this to PYTHONPATH for MLServer")
    parser.add_argument("--frontends", type=int, default=0,
                        help="also run voxserve with --frontends N (its own rows in every table)")
    parser.add_argument("--native-frontends", type=int, default=0,
                        help="also run voxserve with --frontends N --frontend-impl native (rows of their own)")
    parser.add_argument("--engines", type=int, default=1,
                        help="engine processes behind the front ends (--replicas N; on one GPU they share it)")
    parser.add_argument("--processes", type=int, default=1, help="load processes of the batch-1 client")
    parser.add_argument("--full-processes", type=int, default=1,
                        help="load processes of the full-batch client (at most the level's concurrency), every server, "
                        "gRPC and REST")
    parser.add_argument("--connections", type=int, default=1, help="connections of the batch-1 client")
    parser.add_argument("--triton", nargs="?", const="auto", default=None, metavar="WHEEL",
                        help="also run Triton Inference Server: the nvidia-pytriton wheel (or a zip of its server "
                        "parts: bench/triton_peer/server.py pack), a folder holding pytriton, or none: the "
                        "installed pytriton")
    parser.add_argument("--triton-instances", type=int, default=2, help="Triton model instances per model")
    parser.add_argument("--commit", default=None, help="the commit measured, for the report (default: "
                        "$VOXSERVE_COMMIT, else git's HEAD here)")
    parser.add_argument("--tables", type=lambda t: t.split(","), default=None,
                        help=f"only these tables (comma-separated: {','.join(TITLES)}; default every one): the "
                        "levels of the others are not run, nor a server none of whose tables is asked for")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tables is not None and not set(args.tables) <= set(TITLES):
        parser.error(f"--tables: unknown table(s) {', '.join(sorted(set(args.tables) - set(TITLES)))}; the tables: "
                     f"{', '.join(TITLES)}")
    # SIGTERM (a time limit) unwinds like Ctrl-C: every server started so far is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    t0 = time.perf_counter()
    notes: list[str] = []

    def checkpoint(rows: dict[str, list[LevelResult]]) -> None:  # a report so far, should the run be cut short
        if args.out:
            Path(args.out).write_text(render(args, rows, "unfinished run", time.perf_counter() - t0,
                                             [*notes, "unfinished: written before every server had run"], h2d))

    h2d = h2d_rate(args, args.batch * int(np.prod(SAMPLE)) * 4)  # before any server: the GPU is idle
    if h2d is not None:
        notes.append(f"host-to-device copies of one full batch from pinned memory, GPU 0 alone: {h2d:.1f} GB/s")
    out = run(args, notes, checkpoint)
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else \
            f"CPU ({platform.processor() or platform.machine()})"
    except ImportError:
        device = "unknown"
    text = render(args, out, device, time.perf_counter() - t0, notes, h2d)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
