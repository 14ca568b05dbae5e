"""Runner throughput on 1 GPU vs all visible GPUs (no gRPC: the runner's own ceiling), with each GPU's
utilisation sampled from NVML meanwhile. Writes a markdown table to --out.

    python bench/multi_gpu_probe.py --out bench/results/multi-gpu-<machine>.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import threading
import time
from pathlib import Path

import numpy as np
import torch

from voxserve.server.core.batching import BatchingConfig
from voxserve.server.core.model import Model
from voxserve.server.core.runner import Runner
from voxserve.server.core.stats import ModelStats
from voxserve.server.core.weights import default_weights
from voxserve.server.metrics import Metrics


def _utilisation(stop: threading.Event, samples: dict[int, list[int]]) -> None:
    import pynvml

    pynvml.nvmlInit()
    handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in samples}
    while not stop.is_set():
        for i, h in handles.items():
            samples[i].append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
        time.sleep(0.1)


def measure(gpus: list[int], batch: int, concurrency: int, seconds: float, pinned: bool = False) -> dict:
    models = [Model(default_weights(), torch.device(f"cuda:{i}"), "fused-cuda", 128) for i in gpus]
    for m in models:
        m.warm_up()
    runner = Runner(models, ModelStats(), Metrics("voxnet", gpu_metrics=False), BatchingConfig(True, 0.0, 4096))
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((batch, 3, 16, 32, 32), dtype=np.float32) for _ in range(concurrency)]
    if pinned:  # as shared-memory inputs arrive: in pinned memory, sent to the GPU without a staging copy
        from voxserve.server.core.pipeline import pinned_buffer

        for i, x in enumerate(inputs):
            inputs[i] = np.frombuffer(pinned_buffer(x.nbytes), dtype=np.float32).reshape(x.shape)
            inputs[i][...] = x
    util: dict[int, list[int]] = {i: [] for i in range(torch.cuda.device_count())}
    stop = threading.Event()
    sampler = threading.Thread(target=_utilisation, args=(stop, util))
    done = 0

    async def worker(x: np.ndarray, until: float) -> None:
        nonlocal done
        while time.perf_counter() < until:
            await runner.run(x, "FP32")
            done += 1

    async def main() -> float:
        await asyncio.gather(*(runner.run(x, "FP32") for x in inputs))  # warm: slots, graphs
        sampler.start()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(x, t0 + seconds) for x in inputs))
        elapsed = time.perf_counter() - t0
        stop.set()
        await runner.close()
        return elapsed

    elapsed = asyncio.run(main())
    sampler.join()
    return {"gpus": gpus, "samples_per_s": done * batch / elapsed,
            "util": {i: (float(np.mean(v)) if v else float("nan")) for i, v in util.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--pinned", action="store_true",
                        help="inputs in pinned memory (the shared-memory path: no staging copy)")
    parser.add_argument("--all-only", action="store_true", help="measure all GPUs only (e.g. under a profiler)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    count = torch.cuda.device_count()
    rows = []
    if not (args.all_only and count > 1):
        rows.append(measure([0], args.batch, args.concurrency, args.seconds, args.pinned))
    if count > 1:
        rows.append(measure(list(range(count)), args.batch, args.concurrency, args.seconds, args.pinned))
    name = torch.cuda.get_device_name(0)
    lines = [f"# Runner throughput, 1 vs {count} GPUs ({name})", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- command: `python bench/multi_gpu_probe.py --batch {args.batch} --concurrency {args.concurrency} "
             f"--seconds {args.seconds}{' --pinned' if args.pinned else ''}`",
             f"- requests of ({args.batch}, 3, 16, 32, 32) FP32 from host memory, {args.concurrency} outstanding; "
             + ("inputs in pinned memory, sent to the GPU in place (the shared-memory path)" if args.pinned else
                "the runner stages each through pinned memory")
             + " and its GPU's copy/compute streams (no gRPC)", "",
             "| GPUs | samples/s | scaling | mean utilisation per GPU (NVML) |", "|---|---:|---:|---|"]
    base = rows[0]["samples_per_s"]  # with --all-only: relative to itself
    for r in rows:
        util = ", ".join(f"gpu{i} {u:.0f} %" for i, u in r["util"].items())
        lines.append(f"| {','.join(map(str, r['gpus']))} | {r['samples_per_s']:.0f} | "
                     f"{r['samples_per_s'] / base:.2f}x | {util} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
