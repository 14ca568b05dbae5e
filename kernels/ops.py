"""The op boundary: ``fused_forward(x, weight, bias, precision="fp32") -> (N, Cout)`` float32.

One custom op, ``voxserve::fused_forward``, declared once with torch.library.
Its CPU implementation is the reference (computed in float32, in batch chunks
so memory stays bounded); its CUDA implementation is the one-pass fused kernel
(``kernels/csrc``), registered when that kernel is built and loaded. A fake
(meta) implementation lets the op run under torch.compile and CUDA graphs.
"""

from __future__ import annotations

import torch

from .reference import reference

# The CPU path materialises the conv output of one chunk of samples; this caps
# that intermediate (per chunk) whatever the batch size.
_CPU_CHUNK_BYTES = 64 * 1024 * 1024

SUPPORTED_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Arithmetic modes. "fp32": float32 products and sums everywhere (3xTF32 on the tensor cores keeps float32
# accuracy). "tf32": the tensor-core kernel multiplies in TF32 (inputs and weights rounded to 10-bit
# mantissas, float32 accumulation); other kernels, and the CPU, stay float32.
PRECISIONS = ("fp32", "tf32")
# Relative error bound (Frobenius norm over the (N, Cout) output, against float64) each mode is tested to.
ERROR_BOUNDS = {"fp32": 1e-5, "tf32": 5e-3}


def check_arguments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Raise ValueError naming the offending argument when the shapes do not fit the model."""
    if x.dim() != 5:
        raise ValueError(f"x must be 5-D (N, Cin, D, H, W); got shape {tuple(x.shape)}")
    if weight.dim() != 5 or weight.shape[2] != weight.shape[3] or weight.shape[3] != weight.shape[4]:
        raise ValueError(f"weight must be (Cout, Cin, k, k, k); got shape {tuple(weight.shape)}")
    cout, cin, k = weight.shape[0], weight.shape[1], weight.shape[2]
    if bias.shape != (cout,):
        raise ValueError(f"bias must be ({cout},) to match weight; got shape {tuple(bias.shape)}")
    if x.shape[1] != cin:
        raise ValueError(f"x has {x.shape[1]} channels but the weights expect Cin={cin}")
    if x.shape[0] < 1:
        raise ValueError("x must hold at least one sample")
    if min(x.shape[2:]) < k:
        raise ValueError(f"x's spatial size {tuple(x.shape[2:])} is smaller than the kernel size k={k}")
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16; got {x.dtype}")
    if weight.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"weight and bias must be float32; got {weight.dtype} and {bias.dtype}")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")


def _cpu_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n, _, d, h, w = x.shape
    cout, k = weight.shape[0], weight.shape[2]
    per_sample = cout * (d - k + 1) * (h - k + 1) * (w - k + 1) * 4
    chunk = max(1, _CPU_CHUNK_BYTES // per_sample)
    out = torch.empty(n, cout, dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, n, chunk):
            part = x[start : start + chunk].to(torch.float32)
            out[start : start + chunk] = reference(part, weight, bias)
    return out


@torch.library.custom_op("voxserve::fused_forward", mutates_args=())
def _fused_forward_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      precision: str = "fp32") -> torch.Tensor:
    # The default implementation serves the CPU (float32 in every mode); CUDA gets the fused kernel (cuda.py).
    return _cpu_forward(x, weight, bias)


@_fused_forward_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def fused_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """The whole model in one op: (N, Cin, D, H, W) -> (N, Cout) float32 on x's device.

    x may be float32, float16 or bfloat16 (converted to float32 on load) and
    need not be contiguous; weight and bias are float32 on x's device.
    precision: "fp32" (default) or "tf32" (PRECISIONS).
    """
    check_arguments(x, weight, bias)
    check_precision(precision)
    return torch.ops.voxserve.fused_forward(x, weight, bias, precision)
