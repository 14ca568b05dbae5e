"""Protocol <-> model translation: decode and validate a ModelInferRequest, encode the response.

Every rejection is a ServingError naming the field, the value and the limit.
Input bytes are viewed, not copied: ``np.frombuffer`` over the request's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from voxserve.datatypes import INPUT_DATATYPES, ITEMSIZE, WIRE_DTYPE
from voxserve.proto import pb

from .errors import exhausted, invalid, not_found, unimplemented

INPUT_NAME = "input"
OUTPUT_NAME = "output"
DIM_NAMES = ("N", "Cin", "D", "H", "W")
_SHARED_MEMORY_PARAMS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
_TYPED_FIELDS = ("bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents",
                 "fp32_contents", "fp64_contents", "bytes_contents")


@dataclass(frozen=True)
class ModelSpec:
    """What a request is checked against."""

    name: str
    version: str
    cin: int
    cout: int
    k: int
    max_request_samples: int


@dataclass(frozen=True)
class InferInput:
    array: np.ndarray  # wire-typed view (N, Cin, D, H, W); BF16 as uint16 bits
    datatype: str
    typed_response: bool  # the client sent typed contents: answer the same way

    @property
    def samples(self) -> int:
        return int(self.array.shape[0])


def check_model(served_name: str, served_version: str, name: str, version: str) -> None:
    """NOT_FOUND unless (name, version) addresses the served model (an empty version means any)."""
    if name != served_name:
        raise not_found(f"model '{name}' is not served here; this server serves '{served_name}'")
    if version and version != served_version:
        raise not_found(f"model '{name}' has no version '{version}'; available: '{served_version}'")


def _check_shape(spec: ModelSpec, shape: list[int]) -> tuple[int, ...]:
    if len(shape) != 5:
        raise invalid(f"input '{INPUT_NAME}' has shape {shape} (rank {len(shape)}); "
                      f"expected rank 5: [N, {spec.cin}, D, H, W]")
    for axis, (dim, label) in enumerate(zip(shape, DIM_NAMES, strict=True)):
        if dim < 1:
            raise invalid(f"input '{INPUT_NAME}' dimension {axis} ({label}) is {dim}; every dimension must be >= 1")
    if shape[1] != spec.cin:
        raise invalid(f"input '{INPUT_NAME}' has {shape[1]} channels (dimension 1); the model expects Cin={spec.cin}")
    for axis in (2, 3, 4):
        if shape[axis] < spec.k:
            raise invalid(f"input '{INPUT_NAME}' {DIM_NAMES[axis]}={shape[axis]} is smaller than the kernel size "
                          f"k={spec.k}; D, H and W must each be >= {spec.k}")
    if shape[0] > spec.max_request_samples:
        raise exhausted(f"input '{INPUT_NAME}' has N={shape[0]} samples; at most {spec.max_request_samples} "
                        f"are accepted per request (--max-request-samples)")
    return tuple(int(d) for d in shape)


def decode_request(request: pb.ModelInferRequest, spec: ModelSpec) -> InferInput:
    """Validate ``request`` against the model and return its input as a zero-copy array view."""
    check_model(spec.name, spec.version, request.model_name, request.model_version)
    if len(request.inputs) != 1:
        names = [t.name for t in request.inputs]
        raise invalid(f"request has {len(request.inputs)} inputs {names}; model '{spec.name}' takes exactly one, "
                      f"'{INPUT_NAME}'")
    tensor = request.inputs[0]
    if tensor.name != INPUT_NAME:
        raise invalid(f"unknown input '{tensor.name}'; model '{spec.name}' has one input, '{INPUT_NAME}'")
    for param in _SHARED_MEMORY_PARAMS:
        if param in tensor.parameters:
            raise unimplemented(f"input '{INPUT_NAME}' uses parameter '{param}': this server does not support "
                                f"shared-memory inputs yet; send the tensor in raw_input_contents")
    if tensor.datatype not in INPUT_DATATYPES:
        raise invalid(f"input '{INPUT_NAME}' has datatype '{tensor.datatype}'; supported: "
                      f"{', '.join(INPUT_DATATYPES)}")
    requested = [o.name for o in request.outputs]
    for name in requested:
        if name != OUTPUT_NAME:
            raise invalid(f"unknown output '{name}' requested; model '{spec.name}' has one output, '{OUTPUT_NAME}'")
    if len(requested) > 1:
        raise invalid(f"output '{OUTPUT_NAME}' is requested {len(requested)} times; request it at most once")

    shape = _check_shape(spec, list(tensor.shape))
    elements = 1
    for dim in shape:
        elements *= dim  # Python ints: no overflow, whatever the client sent
    datatype = tensor.datatype
    typed = [f for f in _TYPED_FIELDS if len(getattr(tensor.contents, f))]

    if request.raw_input_contents:
        if typed:
            raise invalid(f"input '{INPUT_NAME}' sets both raw_input_contents and contents.{typed[0]}; send one")
        if len(request.raw_input_contents) != 1:
            raise invalid(f"raw_input_contents has {len(request.raw_input_contents)} entries; expected 1, one per "
                          f"input")
        raw = request.raw_input_contents[0]
        expected = elements * ITEMSIZE[datatype]
        if len(raw) != expected:
            raise invalid(f"input '{INPUT_NAME}' shape {list(shape)} of {datatype} needs {expected} bytes; "
                          f"raw_input_contents[0] holds {len(raw)}")
        return InferInput(np.frombuffer(raw, dtype=WIRE_DTYPE[datatype]).reshape(shape), datatype, False)

    if not typed:
        raise invalid(f"input '{INPUT_NAME}' carries no data: set raw_input_contents or contents.fp32_contents")
    if datatype != "FP32":
        raise invalid(f"input '{INPUT_NAME}' is {datatype}: {datatype} travels only in raw_input_contents "
                      f"(typed contents exist for FP32 only)")
    if typed != ["fp32_contents"]:
        raise invalid(f"input '{INPUT_NAME}' is FP32 but sets contents.{next(f for f in typed if f != 'fp32_contents')}"
                      f"; FP32 data goes in contents.fp32_contents")
    values = tensor.contents.fp32_contents
    if len(values) != elements:
        raise invalid(f"input '{INPUT_NAME}' shape {list(shape)} needs {elements} values; contents.fp32_contents "
                      f"holds {len(values)}")
    return InferInput(np.asarray(values, dtype=np.float32).reshape(shape), datatype, True)


def encode_response(request: pb.ModelInferRequest, spec: ModelSpec, output: np.ndarray,
                    typed: bool) -> pb.ModelInferResponse:
    """Build the response: FP32 (N, Cout) in raw_output_contents, or typed if the request was typed."""
    response = pb.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=request.id)
    tensor = response.outputs.add(name=OUTPUT_NAME, datatype="FP32", shape=list(output.shape))
    out = np.ascontiguousarray(output, dtype="<f4")
    if typed:
        tensor.contents.fp32_contents.extend(out.ravel().tolist())
    else:
        response.raw_output_contents.append(out.tobytes())
    return response
