"""The model's compute: the reference implementation and the fused-op boundary."""

from .ops import SUPPORTED_INPUT_DTYPES, check_arguments, fused_forward
from .reference import reference, reference_float64, reference_weights

__all__ = [
    "SUPPORTED_INPUT_DTYPES",
    "check_arguments",
    "fused_forward",
    "reference",
    "reference_float64",
    "reference_weights",
]
