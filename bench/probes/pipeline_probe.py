"""The host's cost of one GPU execution in the serving pipeline: the library's one call (native path) against the
torch calls it replaced, per batch size and source kind.

Each row: ``submit`` + ``wait``/``finish`` back to back on one thread, ``--executions`` times after a warm-up (so
small batches replay their CUDA graph), timed by the wall clock and by this thread's CPU clock.

    python bench/probes/pipeline_probe.py [--executions 2000] [--device-arrays]

``--device-arrays``: instead, executions of K full batches (128 samples) lying in device memory, as requests in
clients' CUDA shared memory reach the pipeline (DeviceArrays, one library call each: read in place for K = 1,
gathered device to device into the slot for more), K = 1, 2, 4, with their outputs left on the host or written
into device memory as well; the model's max_batch is 512, as with ``--max-batch 512``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from voxserve.server.core.devicemem import DeviceArray
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


def device_arrays(executions: int) -> None:
    """The rows of ``--device-arrays`` (see the module's docstring)."""
    model = Model(default_weights(), torch.device("cuda:0"), "fused-cuda", 512)
    pipeline = model.pipeline
    x = torch.randn((4 * 128, 3, 16, 32, 32), device="cuda:0")
    out = torch.empty((4 * 128, model.cout), device="cuda:0")
    print(f"{torch.cuda.get_device_name()}; {executions} executions per row, submit + wait back to back")
    print("| requests of 128 samples per execution | output | wall us per execution | CPU us per execution |")
    print("|---:|---|---:|---:|")
    row_bytes = x[:128].nbytes
    for k in (1, 2, 4):
        for into in (False, True):
            arrays = [DeviceArray(x.data_ptr() + i * row_bytes, (128, 3, 16, 32, 32), np.dtype(np.float32), 0, x,
                                  DeviceArray(out.data_ptr() + i * 128 * model.cout * 4, (128, model.cout),
                                              np.dtype(np.float32), 0, out) if into else None)
                      for i in range(k)]
            wall, cpu = measure(pipeline, arrays, executions)
            print(f"| {k} | {'device memory too' if into else 'host'} | {wall:.1f} | {cpu:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--executions", type=int, default=2000)
    ap.add_argument("--device-arrays", action="store_true", help="executions of full batches in device memory")
    args = ap.parse_args()
    if args.device_arrays:
        device_arrays(args.executions)
        return
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
