"""The cost of one small request between a front end and the engine (``--frontends``), without gRPC.

An engine runs in a child process on the CPU; this process is a front end's runner (RemoteRunner) keeping
``--concurrency`` requests of a tiny sample in flight (compute is negligible), so what is measured is the
IPC hop: records, arena, batcher, replies. Reported: requests/s and the CPU time per request of the engine
process and of this (the front end's) process, from /proc.

    python bench/probes/engine_probe.py [--concurrency 8,64] [--seconds 5] [--gpu-path] \\
        [--out bench/results/engine-probe-<machine>.md]

Each concurrency runs with batching on and off, each against a fresh engine. With ``--gpu-path`` the engine's
model is voxserve.testing.fake_pipeline's stand-in for a GPU: its runner takes the GPU path (executions enqueued
on the loop, ended through the completion watcher's eventfd, as on a device), 20 us of "GPU" an execution, so the
engine's own work is what is measured, on a machine without a GPU; the stand-in's own host work (a numpy mean, a
threading.Event: about a third of an execution's engine CPU on the 2-core box) is counted in it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from voxserve.testing.load import cpu_seconds

SHAPE = (1, 3, 3, 3, 3)
GPU_S = 20e-6  # --gpu-path: the stand-in's time per execution (a small batch's kernel, about)


def engine_main(path: str, batching: bool, gpu_path: bool = False, event_loop: str = "asyncio") -> None:
    from voxserve.server.settings import Settings
    from voxserve.server.topology.engine import run_engine

    settings = Settings(device="cpu", batching=batching, log_level="WARNING", event_loop=event_loop)
    if gpu_path:
        _fake_gpu_engine(settings, path)
    else:
        run_engine(settings, path, 0, None)


def _fake_gpu_engine(settings, path: str) -> None:
    """An engine whose model is the stand-in GPU model (see the module's docstring), served until SIGTERM."""
    from voxserve.server import eventloop
    from voxserve.server.topology.engine import Engine
    from voxserve.testing import fake_pipeline

    engine = Engine(settings, path)
    engine.load()  # (the CPU model: the hello's shapes)
    engine._models = [fake_pipeline.FakeGpuModel(settings.max_batch, depth=4, gpu_s=GPU_S)]
    engine.hello["cout"] = fake_pipeline.COUT
    engine._pin = lambda arena: False  # (no CUDA to page-lock the arena with)

    async def main() -> int:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        return await engine.serve(stop)

    eventloop.run(main(), settings.event_loop)


async def drive(path: str, engine_pid: int, concurrency: int, seconds: float, batching: bool) -> dict:
    from voxserve.server.core.batching import BatchingConfig
    from voxserve.server.topology.ipc import Arena
    from voxserve.server.topology.remote import RemoteRunner

    runner = await RemoteRunner.connect([path], Arena(64 << 20), 0, BatchingConfig(batching, 0.0, 4096))
    x = np.random.default_rng().standard_normal(SHAPE, dtype=np.float32)
    done = 0
    samples = 0

    async def worker(stop_at: float) -> None:
        nonlocal done, samples
        while time.perf_counter() < stop_at:
            r = await runner.run(x, "FP32")
            done += 1
            samples += r.batch_samples

    await asyncio.gather(*(worker(time.perf_counter() + 0.5) for _ in range(concurrency)))  # warm
    done = samples = 0
    e0, f0, t0 = cpu_seconds(engine_pid), time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(t0 + seconds) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    e1, f1 = cpu_seconds(engine_pid), time.process_time()
    await runner.close()
    return {"req_s": done / wall, "engine_us": (e1 - e0) / done * 1e6, "frontend_us": (f1 - f0) / done * 1e6,
            "mean_batch": samples / done}


def probe(concurrency: int, seconds: float, batching: bool, gpu_path: bool = False,
          event_loop: str = "asyncio") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "engine.sock")
        proc = multiprocessing.get_context("spawn").Process(target=engine_main, args=(path, batching, gpu_path,
                                                                                            event_loop))
        proc.start()
        try:
            return asyncio.run(drive(path, proc.pid, concurrency, seconds, batching))
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            proc.join(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=lambda t: [int(v) for v in t.split(",")], default=[8, 64])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--event-loop", default="asyncio", help="the engine's --event-loop (asyncio, uvloop)")
    ap.add_argument("--gpu-path", action="store_true",
                    help="the engine's runner takes the GPU path, with a stand-in pipeline (no GPU needed)")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args()
    rows = ["| concurrency | batching | req/s | mean batch | engine CPU us/request | front end CPU us/request |",
            "|---:|---|---:|---:|---:|---:|"]
    for c in args.concurrency:
        for batching in (True, False):
            r = probe(c, args.seconds, batching, args.gpu_path, args.event_loop)
            rows.append(f"| {c} | {'on' if batching else 'off'} | {r['req_s']:.0f} | {r['mean_batch']:.1f} | "
                        f"{r['engine_us']:.0f} | {r['frontend_us']:.0f} |")
            print(rows[-1], flush=True)
    if args.out:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        Path(args.out).write_text(
            f"# Engine probe: the front end to engine hop without gRPC "
            f"({'GPU path, stand-in pipeline' if args.gpu_path else 'CPU engine'})\n\n"
            f"- date: {when}; {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}\n"
            f"- command: `python bench/probes/engine_probe.py {' '.join(sys.argv[1:])}`\n"
            f"- request: {SHAPE} FP32 (compute is negligible); {args.seconds:g} s per row\n\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
