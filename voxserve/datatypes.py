"""Tensor datatypes on the wire (Open Inference Protocol names) and their numpy forms.

Torch-free: the client and the server both use it.
"""

from __future__ import annotations

import numpy as np

# Datatypes voxserve accepts for its input; the output is always FP32.
INPUT_DATATYPES = ("FP32", "FP16", "BF16")

# Every datatype the protocol names, with its element size (BYTES has none).
ITEMSIZE = {
    "BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8,
    "INT8": 1, "INT16": 2, "INT32": 4, "INT64": 8,
    "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2,
}  # fmt: skip

# The numpy dtype that holds each input datatype's wire bytes (BF16 as raw bits).
WIRE_DTYPE: dict[str, np.dtype] = {"FP32": np.dtype("<f4"), "FP16": np.dtype("<f2"), "BF16": np.dtype("<u2")}

# Short names used on command lines.
CLI_DTYPES = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16"}


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even) and return their uint16 bits."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    nan = np.isnan(x)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = rounded.astype("<u2")
    rounded[nan] = 0x7FC0
    return rounded


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bits (uint16) to float32 values, exactly."""
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def to_wire(x: np.ndarray, datatype: str) -> bytes:
    """Encode a float array as the row-major little-endian bytes of ``datatype``."""
    if datatype == "BF16":
        return float32_to_bf16_bits(np.asarray(x, dtype=np.float32)).tobytes()
    return np.ascontiguousarray(x, dtype=WIRE_DTYPE[datatype]).tobytes()


def from_wire(raw: bytes, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Decode wire bytes of ``datatype`` into a float32 array of ``shape``."""
    arr = np.frombuffer(raw, dtype=WIRE_DTYPE[datatype]).reshape(shape)
    return bf16_bits_to_float32(arr) if datatype == "BF16" else arr.astype(np.float32, copy=False)
