"""Time a tensor-core kernel under forced tilings, one process each: variant 3 (mma.sync,
VOXSERVE_TC_PLAN=warps,rows[,chunks]) or 5 (warpgroup, VOXSERVE_WG_PLAN=warpgroups,rows[,chunks]).

    python bench/kernel_plan_sweep.py --shape 128,3,16,32,32 --plans "5,15;4,8;4,12,2" [--precision tf32]
    python bench/kernel_plan_sweep.py --variant 5 --plans "1,10;1,6;2,30"

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
variant = int(sys.argv[4])
t = time_fn(lambda x: cuda.forward(x, w, b, variant, sys.argv[3]), inputs, 30, 10)
p = cuda.plan(inputs[0], variant=variant, precision=sys.argv[3])
print(f"{t * 1e6:.1f} us  ({p['kernel']}: {p['threads'] // 32} warps, {p['rows']} rows, "
      f"{p['tiles_h']}x{p['tiles_w']} tiles, {p['chunks']} chunks)")
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="128,3,16,32,32")
    parser.add_argument("--plans", default="5,15;5,10;4,8;4,12;6,12;4,16;5,15,2;4,8,2")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--variant", type=int, choices=(3, 5), default=3)
    args = parser.parse_args(argv)
    var = "VOXSERVE_TC_PLAN" if args.variant == 3 else "VOXSERVE_WG_PLAN"
    here = os.path.dirname(os.path.abspath(__file__))
    for plan in ["auto", *args.plans.split(";")]:
        env = dict(os.environ)
        env.pop(var, None)
        if plan != "auto":
            env[var] = plan
        cmd = [sys.executable, "-c", CHILD, here, args.shape, args.precision, str(args.variant)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        result = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr.strip()[-300:]
        print(f"{args.shape} {args.precision} plan {plan:>8}: {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
