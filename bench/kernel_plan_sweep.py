"""Time the tensor-core kernel under forced tilings (VOXSERVE_TC_PLAN=warps,rows[,chunks]), one process each.

    python bench/kernel_plan_sweep.py --shape 128,3,16,32,32 --plans "5,15;4,8;4,12,2" [--precision tf32]

A tuning aid for make_plan in kernels/csrc/fused.cu: prints median microseconds per call (CUDA events,
inputs rotated beyond L2, blocks of 10 back-to-back calls, as bench/kernel_bench.py) for the planner's
own choice ("auto") and each forced plan.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from kernel_bench import time_fn
from voxserve.kernels import cuda, reference_weights
shape = tuple(int(v) for v in sys.argv[2].split(","))
w, b = (t.cuda() for t in reference_weights())
sets = max(4, int(3 * 50 * 2**20 // (4 * torch.Size(shape).numel())) + 1)
inputs = [torch.randn(shape, device="cuda") for _ in range(min(sets, 512))]
t = time_fn(lambda x: cuda.forward(x, w, b, 3, sys.argv[3]), inputs, 30, 10)
p = cuda.plan(inputs[0], variant=3, precision=sys.argv[3])
print(f"{t * 1e6:.1f} us  ({p['threads'] // 32} warps x {p['rows'] // (p['threads'] // 32)} rows, "
      f"{p['tiles_h']}x{p['tiles_w']} tiles, {p['chunks']} chunks)")
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="128,3,16,32,32")
    parser.add_argument("--plans", default="5,15;5,10;4,8;4,12;6,12;4,16;5,15,2;4,8,2")
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    for plan in ["auto", *args.plans.split(";")]:
        env = dict(os.environ)
        env.pop("VOXSERVE_TC_PLAN", None)
        if plan != "auto":
            env["VOXSERVE_TC_PLAN"] = plan
        out = subprocess.run([sys.executable, "-c", CHILD, here, args.shape, args.precision], env=env,
                             capture_output=True, text=True)
        result = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr.strip()[-300:]
        print(f"{args.shape} {args.precision} plan {plan:>8}: {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
