"""The host's cost of one GPU execution in the serving pipeline: the library's one call (native path) against the
torch calls it replaced, per batch size and source kind.

Each row: ``submit`` + ``wait``/``finish`` back to back on one thread, ``--executions`` times after a warm-up (so
small batches replay their CUDA graph), timed by the wall clock and by this thread's CPU clock.

    python bench/probes/pipeline_probe.py [--executions 2000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from voxserve.server.core.model import Model
from voxserve.server.core.pipeline import CudaPipeline, pinned_buffer
from voxserve.server.core.weights import default_weights


def measure(pipeline: CudaPipeline, arrays: list[np.ndarray], executions: int) -> tuple[float, float]:
    for _ in range(20):
        pipeline.wait(pipeline.submit(arrays, "FP32"))
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(executions):
        pipeline.wait(pipeline.submit(arrays, "FP32"))
    return (time.perf_counter() - w0) / executions * 1e6, (time.thread_time() - c0) / executions * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--executions", type=int, default=2000)
    args = ap.parse_args()
    model = Model(default_weights(), torch.device("cuda:0"), "fused-cuda", 128)
    native = model.pipeline
    plain = CudaPipeline(model.device, model.cout, model.compute, model.graphs)
    rng = np.random.default_rng(0)
    print(f"{torch.cuda.get_device_name()}; {args.executions} executions per row, submit + wait back to back")
    print("| batch | source | path | wall us per execution | CPU us per execution |")
    print("|---:|---|---|---:|---:|")
    for n in (1, 8, 128):
        x = rng.standard_normal((n, 3, 16, 32, 32), dtype=np.float32)
        pinned = np.frombuffer(pinned_buffer(x.nbytes), dtype=np.float32).reshape(x.shape)
        pinned[...] = x
        for source, arrays in (("pageable", [x]), ("page-locked", [pinned])):
            for name, pipeline in (("native (one library call)", native), ("torch calls", plain)):
                runs = args.executions if n < 128 else max(args.executions // 10, 50)
                wall, cpu = measure(pipeline, arrays, runs)
                print(f"| {n} | {source} | {name} | {wall:.1f} | {cpu:.1f} |", flush=True)


if __name__ == "__main__":
    main()
