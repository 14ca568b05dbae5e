"""The model's compute: its reference definition, the ``voxserve::fused_forward`` op and the op's CUDA kernel.

- ``reference``: the model as plain PyTorch, the definition every fast path is checked against.
- ``ops``: the op boundary (declaration, CPU and fake implementations, argument checks).
- ``build``: compiling ``csrc/fused.cu`` with nvcc (architecture list, cache); runs without a GPU.
- ``cuda``: loading the built library and launching it (the op's CUDA kernel, plans, stream notifications,
  span copies).
- ``graphs``: CUDA graphs of the op, one per input bucket.
"""

from . import cuda as cuda  # registers the op's CUDA kernel (built lazily, on first use)
from .ops import ERROR_BOUNDS, PRECISIONS, SUPPORTED_INPUT_DTYPES, check_arguments, fused_forward
from .reference import reference, reference_float64, reference_weights

__all__ = [
    "ERROR_BOUNDS",
    "PRECISIONS",
    "SUPPORTED_INPUT_DTYPES",
    "check_arguments",
    "fused_forward",
    "reference",
    "reference_float64",
    "reference_weights",
]
