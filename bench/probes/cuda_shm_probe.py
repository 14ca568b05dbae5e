"""Where a CUDA shared-memory request's time goes inside the server, stage by stage, on one GPU.

A child process (the client) allocates device memory with voxserve.client.CudaBuffer, fills it with a batch and
exports its handle; this process (the server's side, without gRPC) opens it through the server's own device layer
and registry and times, back to back (median of ``--iterations``, CUDA synchronised around each):

    kernel, torch tensor      fused_forward on a tensor of torch's own allocator (the kernel's floor)
    kernel, client memory     fused_forward on the client's memory, viewed in place
    run_device_arrays         Model.run_device_arrays: view, kernel, the output back to the host
    output write              CudaDeviceMemory.write of the N x Cout FP32 output into the client's region
    registry read + release   CudaSharedMemoryRegistry.read (lease, DeviceArray) and the lease's release
    Runner.run, c=1           the in-process executor (batcher, submit thread), one request at a time
    Runner.run, c=16          sixteen at once (per request)

    python bench/probes/cuda_shm_probe.py [--batch 128] [--iterations 200] [--out bench/results/cuda-shm-probe.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from voxserve.kernels import fused_forward
from voxserve.server.core.batching import BatchingConfig
from voxserve.server.core.devicemem import CudaDeviceMemory
from voxserve.server.core.model import Model
from voxserve.server.core.runner import Runner
from voxserve.server.core.stats import ModelStats
from voxserve.server.core.weights import default_weights
from voxserve.server.metrics import Metrics, latency_buckets
from voxserve.server.protocol.cudashm import CudaSharedMemoryRegistry

CHILD = r"""
import json, sys
import numpy as np
from voxserve.client import CudaBuffer
x = np.load(sys.argv[1])
buf = CudaBuffer(x.nbytes + 4 * x.shape[0] * 64, 0)
buf.write(x)
print(json.dumps({"handle": buf.region.raw_handle.hex(), "size": buf.byte_size}), flush=True)
sys.stdin.readline()  # until the probe is done
"""


def timed(fn, iterations: int) -> float:
    """Median microseconds of ``fn`` (CUDA synchronised before and after each call)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


async def runner_rate(runner: Runner, registry: CudaSharedMemoryRegistry, shape: tuple[int, ...], concurrency: int,
                      requests: int) -> float:
    """Microseconds per request through Runner.run with ``concurrency`` in flight."""
    async def one() -> None:
        array, lease = registry.read("probe", 0, shape, np.dtype(np.float32), "input")
        try:
            await runner.run(array, "FP32")
        finally:
            lease.release()

    for _ in range(20):
        await one()
    t0 = time.perf_counter()
    for _ in range(requests // concurrency):
        await asyncio.gather(*(one() for _ in range(concurrency)))
    return (time.perf_counter() - t0) / (requests // concurrency * concurrency) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD here)")
    args = ap.parse_args()
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    shape = (args.batch, 3, 16, 32, 32)
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    model = Model(default_weights(), torch.device("cuda:0"), "fused-cuda", 128)
    path = Path("/tmp/cuda_shm_probe_x.npy")
    np.save(path, x)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    rows: list[tuple[str, float]] = []
    try:
        exported = json.loads(child.stdout.readline())  # type: ignore[union-attr]
        devices = CudaDeviceMemory()
        registry = CudaSharedMemoryRegistry(devices, 4)
        t0 = time.perf_counter()
        asyncio.run(registry.register("probe", bytes.fromhex(exported["handle"]), 0, exported["size"]))
        rows.append(("registration (the checking child included)", (time.perf_counter() - t0) * 1e6))
        array, lease = registry.read("probe", 0, shape, np.dtype(np.float32), "input")
        here = torch.as_tensor(array, device="cuda:0")
        own = torch.from_numpy(x).cuda()
        w, b = model.weight_on_device, model.bias_on_device
        assert torch.equal(here, own), "the client's memory does not hold the batch"
        p, n = model.precision, args.iterations
        rows.append(("kernel, torch tensor", timed(lambda t=own: fused_forward(t, w, b, p), n)))
        rows.append(("kernel, client memory", timed(lambda t=here: fused_forward(t, w, b, p), n)))
        rows.append(("run_device_arrays", timed(lambda a=array: model.run_device_arrays([a], "FP32"), n)))
        out = np.zeros((args.batch, model.cout), np.float32).tobytes()
        out_at = array.address + x.nbytes
        rows.append(("output write", timed(lambda: devices.write(out_at, out, 0), args.iterations)))

        def read_release() -> None:
            _, held = registry.read("probe", 0, shape, np.dtype(np.float32), "input")
            held.release()

        rows.append(("registry read + release", timed(read_release, args.iterations)))
        del here, array
        lease.release()

        async def rates() -> list[tuple[str, float]]:
            metrics = Metrics("voxnet", latency_buckets(""), gpu_metrics=False)
            runner = Runner([model], ModelStats(), metrics, BatchingConfig(True, 0.0, 512))
            try:
                return [(f"Runner.run, c={c}", await runner_rate(runner, registry, shape, c, args.iterations))
                        for c in (1, 16)]
            finally:
                await runner.close()

        rows += asyncio.run(rates())
        registry.close()
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(30)
    lines = [f"# CUDA shared memory inside the server, stage by stage: {torch.cuda.get_device_name()}", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; command: "
             f"`python bench/probes/cuda_shm_probe.py --batch {args.batch} --iterations {args.iterations}`; "
             f"commit {commit}",
             f"- batch {list(shape)} FP32 ({x.nbytes / 1e6:.1f} MB) in a client process's cudaMalloc'd memory", "",
             "| stage | us (median) |", "|---|---:|", *(f"| {name} | {us:.1f} |" for name, us in rows)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
