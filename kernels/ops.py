"""The op boundary: ``fused_forward(x, weight, bias, precision="fp32") -> (N, Cout)`` float32.

One custom op, ``voxserve::fused_forward``, declared once with torch.library.
Its CPU implementation is the reference (computed in float32, in chunks of
samples or tiles of one sample, so memory stays bounded); its CUDA
implementation is the one-pass fused kernel (``kernels/csrc``), registered
when that kernel is built and loaded. A fake (meta) implementation lets the
op run under torch.compile and CUDA graphs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from .reference import reference

# The CPU path materialises the conv output of one chunk of samples, or of one
# tile of a sample too large for a chunk; this caps that intermediate whatever
# the batch and sample sizes (peak memory: kernels/NOTES.md, "The CPU path").
_CPU_CHUNK_BYTES = 64 * 1024 * 1024
# The conv output of one batch of tiles of such a sample: small enough that it and the activation after it
# stay in a 32 MiB L3 (single-threaded, 1.5x faster than 64 MiB batches), large enough that the calls are
# few: each call's parallel regions wait on every thread, and on contended cores 2 MiB batches ran 3-8x slower.
_CPU_TILE_BYTES = 8 * 1024 * 1024

# The input datatypes (voxserve.datatypes.INPUT_DATATYPES) as torch dtypes, in the order of the CUDA launcher's
# dtype codes (kernels/cuda.py).
TORCH_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED_INPUT_DTYPES = tuple(TORCH_DTYPES.values())

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


def _ranges(size: int, parts: int) -> list[tuple[int, int]]:
    # [start, stop) of `parts` pieces of `size` whose lengths differ by one at most.
    q, r = divmod(size, parts)
    bounds = [i * q + min(i, r) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _split(size: int, min_parts: int) -> list[tuple[int, int]]:
    # Like _ranges with at least min_parts pieces, and when split, neither piece length held by one
    # piece alone, so every tile shape of a sample occurs at least twice (see _cpu_forward_tiled).
    # parts == size (all of length one) always qualifies.
    if min_parts <= 1:
        return [(0, size)]
    parts = next(m for m in range(min_parts, size + 1) if size % m != 1 and m - size % m != 1)
    return _ranges(size, parts)


def _cpu_forward_tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One sample (1, Cin, D, H, W) in tiles of its conv output; returns (Cout,) float32.

    Tiles are whole output planes while one fits, else rows of a plane, else runs of one row, each at
    most a third of the budget (_CPU_TILE_BYTES, or the cap if smaller). Output rows [d0, d1) need
    input rows [d0, d1 + k - 1), likewise along H and W. Softmax is per voxel, so each tile's
    probabilities are exact, and the sample's mean is the voxel-weighted mean of its tiles' means,
    summed in float64 so that many tiles add nothing to the fp32 error bound. Tiles of one shape go to
    ``reference`` two or more at a time (their conv output within the budget in all): torch's CPU
    conv3d takes oneDNN for a batch, but for one sample of small depth x height it takes vol2col,
    whose buffer is Cin*k^3/Cout times the output (5x at the reference weights) and which runs
    several times slower. Each batch's input is converted to float32 on its own, never the sample's.
    """
    cout, cin, k = weight.shape[0], weight.shape[1], weight.shape[2]
    out_d, out_h, out_w = (size - k + 1 for size in x.shape[2:])
    budget = min(_CPU_CHUNK_BYTES, _CPU_TILE_BYTES)
    voxels = max(1, budget // (3 * cout * 4))
    if out_h * out_w <= voxels:
        parts = (-(-out_d // (voxels // (out_h * out_w))), 1, 1)
    elif out_w <= voxels:
        parts = (out_d, -(-out_h // (voxels // out_w)), 1)
    else:
        parts = (out_d, out_h, -(-out_w // voxels))
    by_shape: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    for d0, d1 in _split(out_d, parts[0]):
        for h0, h1 in _split(out_h, parts[1]):
            for w0, w1 in _split(out_w, parts[2]):
                by_shape.setdefault((d1 - d0, h1 - h0, w1 - w0), []).append((d0, h0, w0))
    total = torch.zeros(cout, dtype=torch.float64)
    for (td, th, tw), origins in by_shape.items():
        # At least 3 tiles fit a batch, so balanced batches of a shape held twice or more hold 2 or more.
        per_batch = max(3, budget // (cout * td * th * tw * 4))
        for first, last in _ranges(len(origins), -(-len(origins) // per_batch)):
            tiles = torch.empty(last - first, cin, td + k - 1, th + k - 1, tw + k - 1, dtype=torch.float32)
            for tile, (d0, h0, w0) in zip(tiles, origins[first:last], strict=True):
                tile.copy_(x[0, :, d0 : d0 + td + k - 1, h0 : h0 + th + k - 1, w0 : w0 + tw + k - 1])
            means = reference(tiles, weight, bias)
            total += means.to(torch.float64).sum(dim=0) * (td * th * tw)
    return (total / (out_d * out_h * out_w)).to(torch.float32)


def _cpu_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n, _, d, h, w = x.shape
    cout, k = weight.shape[0], weight.shape[2]
    per_sample = cout * (d - k + 1) * (h - k + 1) * (w - k + 1) * 4
    out = torch.empty(n, cout, dtype=torch.float32)
    with torch.no_grad():
        if 3 * per_sample > _CPU_CHUNK_BYTES:
            for i in range(n):
                out[i] = _cpu_forward_tiled(x[i : i + 1], weight, bias)
            return out
        chunk = _CPU_CHUNK_BYTES // per_sample
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


# The op's CUDA kernel (set by cuda.py): eager calls on plain CUDA tensors go to it directly, since the
# dispatcher's round trip through a Python custom op costs more host time than the launch itself. It checks
# its arguments as check_arguments and check_precision do, once per argument layout (cuda.forward).
_cuda_kernel: Callable[..., torch.Tensor] | None = None


def fused_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """The whole model in one op: (N, Cin, D, H, W) -> (N, Cout) float32 on x's device.

    x may be float32, float16 or bfloat16 (converted to float32 on load) and
    need not be contiguous; weight and bias are float32 on x's device.
    precision: "fp32" (default) or "tf32" (PRECISIONS).
    """
    kernel = _cuda_kernel
    if (kernel is not None and type(x) is torch.Tensor and x.is_cuda
            and not (x.requires_grad or weight.requires_grad or bias.requires_grad)
            and not torch.compiler.is_compiling()):
        # What the dispatcher would call, without it: under torch.compile, fake tensors, or autograd the op
        # goes through torch.ops as usual.
        return kernel(x, weight, bias, precision)
    check_arguments(x, weight, bias)
    check_precision(precision)
    return torch.ops.voxserve.fused_forward(x, weight, bias, precision)
