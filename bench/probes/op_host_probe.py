"""The host's cost of one batch-1 call of the fused op, by way of calling it, back to back on one thread.

Rows: a plain torch launch (for scale), ``kernels.cuda.forward`` (the ctypes launch; one launch, and two with
a workspace), ``torch.ops.voxserve.fused_forward`` (the dispatcher),
``kernels.fused_forward`` (the public function: eager CUDA calls skip the dispatcher), and eager PyTorch's
whole five-op model. Two columns: ``--calls`` calls enqueued back to back after a warm-up, wall time per call
(the slower of the host and the GPU); and the host alone: ``--behind`` calls enqueued behind a GPU kept busy by
a sleep kernel, so that none waits for the GPU. Then the parts of one ``kernels.cuda.forward`` call, each timed
alone the same way: its argument-layout lookup, the allocations, the weights' host copy lookup, the current
stream, and the library call with its arguments ready (one launch with the layout's fixed arguments in a struct,
as forward() calls it; the same with all 16 arguments; two launches with a workspace).

    python bench/probes/op_host_probe.py [--calls 5000] [--behind 200]
"""

from __future__ import annotations

import argparse
import time

import torch

from voxserve.kernels import cuda as fused_cuda
from voxserve.kernels import fused_forward, reference, reference_weights

SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU clock: longer than any row's --behind calls take to enqueue


def per_call_us(fn, calls: int, behind_sleep: bool = False) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    if behind_sleep:
        torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def both(fn, args) -> str:
    return f"{per_call_us(fn, args.calls):.1f} | {per_call_us(fn, args.behind, behind_sleep=True):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--behind", type=int, default=200, help="calls timed behind the sleeping GPU (the launch queue "
                    "holds about a thousand kernels; more would wait for it)")
    args = ap.parse_args()
    w, b = (t.cuda() for t in reference_weights())
    x = torch.randn((1, 3, 16, 32, 32), device="cuda")
    y = torch.empty(16, device="cuda")
    rows = [
        ("plain torch launch (y.add_(1))", lambda: y.add_(1)),
        ("kernels.cuda.forward (ctypes launch)", lambda: fused_cuda.forward(x, w, b)),
        ("kernels.cuda.forward, workspace and two launches", lambda: fused_cuda.forward(x, w, b, one_launch=False)),
        ("torch.ops.voxserve.fused_forward (dispatcher)", lambda: torch.ops.voxserve.fused_forward(x, w, b, "fp32")),
        ("kernels.fused_forward (public; eager skips the dispatcher)", lambda: fused_forward(x, w, b)),
        ("eager PyTorch, the five-op model", lambda: reference(x, w, b)),
    ]
    print(f"{torch.cuda.get_device_name()}; batch 1 (1, 3, 16, 32, 32); {args.calls} calls per row back to back, "
          f"{args.behind} behind a sleeping GPU")
    header = "| us per call, back to back | host alone |\n|---|---:|---:|"
    print(f"| call {header}")
    for name, fn in rows:
        print(f"| {name} | {both(fn, args)} |", flush=True)
    print()
    print(f"| part of kernels.cuda.forward {header}")
    for name, fn in launch_parts(x, w, b):
        print(f"| {name} | {both(fn, args)} |", flush=True)


def launch_parts(x, w, b):
    """Each step of kernels.cuda.forward on its own, as it runs for a layout seen before."""
    fused_cuda.forward(x, w, b)
    lib = fused_cuda.library().lib
    prep = fused_cuda._prepared[fused_cuda._layout_key(x, w, b, "fp32")]
    out = torch.empty(prep.n, prep.cout, device=prep.device)
    workspace = torch.empty(prep.floats, device=prep.device)
    w_host, b_host = fused_cuda._host_weights.get(w, b)
    stream = fused_cuda._raw_stream(prep.index)
    layout = prep.layout
    head = (x.data_ptr(), layout.dtype, layout.sizes, layout.strides, prep.cout, layout.k, w.data_ptr(), b.data_ptr(),
            w_host.data_ptr(), b_host.data_ptr(), out.data_ptr())
    tail = (0, layout.precision, prep.index, stream)
    two = (*head, workspace.data_ptr(), *tail)
    one = (*head, None, *tail)
    packed = (prep.layout_ptr, x.data_ptr(), w.data_ptr(), b.data_ptr(), w_host.data_ptr(), b_host.data_ptr(),
              out.data_ptr(), None, stream, 0)
    return [
        ("layout key and lookup", lambda: fused_cuda._prepared.get(fused_cuda._layout_key(x, w, b, "fp32"))),
        ("torch.empty of the output", lambda: torch.empty(prep.n, prep.cout, device=prep.device, dtype=torch.float32)),
        ("the same, its shape as a tuple", lambda: torch.empty((prep.n, prep.cout), device=prep.device,
                                                               dtype=torch.float32)),
        ("torch.empty of the workspace", lambda: torch.empty(prep.floats, device=prep.device, dtype=torch.float32)),
        ("weights' host copy lookup", lambda: fused_cuda._host_weights.get(w, b)),
        ("current raw stream", lambda: fused_cuda._raw_stream(prep.index)),
        ("five data_ptr() calls", lambda: (x.data_ptr(), w.data_ptr(), b.data_ptr(), out.data_ptr(),
                                           workspace.data_ptr())),
        ("voxserve_forward_layout, arguments ready (one launch; what forward calls)",
         lambda: lib.voxserve_forward_layout(*packed)),
        ("voxserve_forward, arguments ready (one launch, 16 arguments)", lambda: lib.voxserve_forward(*one)),
        ("voxserve_forward, arguments ready (workspace, two launches)", lambda: lib.voxserve_forward(*two)),
    ]


if __name__ == "__main__":
    main()
