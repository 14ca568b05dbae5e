"""One fused-kernel launch per variant at a shape, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:fused_tile --launch-skip 1 --launch-count 1 \
        python bench/profile_kernel.py --variant 204
"""

import argparse

import torch

from voxserve.kernels import cuda as cuda_kernels
from voxserve.kernels import reference_weights

parser = argparse.ArgumentParser()
parser.add_argument("--variant", type=int, default=0)
parser.add_argument("--shape", default="128,3,16,32,32")
args = parser.parse_args()
w, b = (t.cuda() for t in reference_weights())
x = torch.randn(tuple(int(v) for v in args.shape.split(",")), device="cuda")
for _ in range(2):
    cuda_kernels.forward(x, w, b, args.variant)
torch.cuda.synchronize()
