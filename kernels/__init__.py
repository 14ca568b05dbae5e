"""The model's compute: the reference implementation and the fused-op boundary."""

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
