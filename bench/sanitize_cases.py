"""A few fused-kernel launches for compute-sanitizer (memcheck/racecheck): every path, small shapes.

    compute-sanitizer --tool memcheck python bench/sanitize_cases.py
"""

import torch

from voxserve.kernels import cuda as cuda_kernels
from voxserve.kernels import reference_float64

gen = torch.Generator().manual_seed(1)
cases = [
    ((2, 3, 16, 32, 32), 16, 3, torch.float32, "contiguous", 1),
    ((2, 3, 16, 32, 32), 16, 3, torch.float32, "contiguous", 2),
    ((3, 3, 7, 37, 41), 16, 3, torch.float32, "contiguous", 2),
    ((1, 3, 40, 12, 8), 16, 3, torch.float32, "contiguous", 2),
    ((2, 3, 16, 32, 32), 16, 3, torch.float32, "contiguous", 3),
    ((3, 3, 7, 37, 41), 16, 3, torch.float32, "contiguous", 3),
    ((1, 3, 16, 32, 32), 16, 3, torch.float32, "contiguous", 3),
    ((2, 3, 5, 64, 68), 16, 3, torch.float32, "contiguous", 3),
    ((2, 3, 16, 32, 32), 16, 3, torch.float32, "contiguous", 5),
    ((3, 3, 7, 37, 41), 16, 3, torch.float32, "contiguous", 5),
    ((1, 3, 16, 32, 32), 16, 3, torch.float32, "contiguous", 5),
    ((2, 3, 5, 64, 68), 16, 3, torch.float32, "contiguous", 5),
    ((2, 3, 7, 37, 40), 16, 3, torch.float16, "contiguous", 5),
    ((1, 3, 16, 32, 32), 16, 3, torch.bfloat16, "contiguous", 5),
    ((2, 3, 16, 32, 32), 16, 3, torch.float32, "contiguous", 4),
    ((3, 3, 7, 37, 41), 16, 3, torch.float32, "contiguous", 4),
    ((1, 3, 5, 9, 17), 16, 3, torch.float16, "contiguous", 0),
    ((2, 3, 6, 7, 9), 16, 3, torch.float32, "permuted", 0),
    ((2, 4, 6, 7, 9), 20, 2, torch.bfloat16, "contiguous", 0),
    ((1, 2, 9, 9, 9), 64, 7, torch.float32, "permuted", 0),
]
for shape, cout, k, dtype, layout, variant in cases:
    w = (torch.randn(cout, shape[1], k, k, k, generator=gen) * 0.3).cuda()
    b = (torch.randn(cout, generator=gen) * 0.1).cuda()
    x = torch.randn(shape, generator=gen)
    if layout == "permuted":
        x = x.permute(0, 2, 3, 4, 1).contiguous().permute(0, 4, 1, 2, 3)
    x = x.cuda().to(dtype)
    ref = reference_float64(x, w, b)
    for precision, bound in (("fp32", 1e-5), ("tf32", 5e-3)) if variant in (0, 3, 5) else (("fp32", 1e-5),):
        out = cuda_kernels.forward(x, w, b, variant, precision)
        err = float((out.double().cpu() - ref).norm() / ref.norm())
        print(f"{shape} cout={cout} k={k} {dtype} {layout} V={variant} {precision}: rel err {err:.1e}")
        assert err <= bound
print("sanitize cases done")
