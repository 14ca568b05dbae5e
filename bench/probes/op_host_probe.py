"""The host's cost of one batch-1 call of the fused op, by way of calling it, back to back on one thread.

Rows: a plain torch launch (for scale), ``kernels.cuda.forward`` (the ctypes launch),
``torch.ops.voxserve.fused_forward`` (the dispatcher),
``kernels.fused_forward`` (the public function: eager CUDA calls skip the dispatcher), and eager PyTorch's
whole five-op model. Each: ``--calls`` calls enqueued back to back after a warm-up, wall time per call.

    python bench/probes/op_host_probe.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import time

import torch

from voxserve.kernels import cuda as fused_cuda
from voxserve.kernels import fused_forward, reference, reference_weights


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    w, b = (t.cuda() for t in reference_weights())
    x = torch.randn((1, 3, 16, 32, 32), device="cuda")
    y = torch.empty(16, device="cuda")
    rows = [
        ("plain torch launch (y.add_(1))", lambda: y.add_(1)),
        ("kernels.cuda.forward (ctypes launch)", lambda: fused_cuda.forward(x, w, b)),
        ("torch.ops.voxserve.fused_forward (dispatcher)", lambda: torch.ops.voxserve.fused_forward(x, w, b, "fp32")),
        ("kernels.fused_forward (public; eager skips the dispatcher)", lambda: fused_forward(x, w, b)),
        ("eager PyTorch, the five-op model", lambda: reference(x, w, b)),
    ]
    print(f"{torch.cuda.get_device_name()}; batch 1 (1, 3, 16, 32, 32); {args.calls} calls per row")
    print("| call | host us per call |")
    print("|---|---:|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn, args.calls):.1f} |", flush=True)


if __name__ == "__main__":
    main()
