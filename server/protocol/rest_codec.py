"""The Open Inference Protocol's REST bodies <-> its protobuf messages, so that the REST front end (``rest.py``)
serves through the same inference path, checks and shared-memory registry as gRPC.

An inference request is a JSON object, optionally followed by raw tensor bytes (Triton's binary-tensor
extension): the ``Inference-Header-Content-Length`` header says how long the JSON part is, and each input
whose ``parameters`` carry ``binary_data_size`` takes that many of the bytes after it, in the order of the
inputs. Binary inputs are viewed in the received body, not copied; JSON ``data`` (numbers, flat or nested)
becomes the tensor's wire bytes once. The response is JSON, with the outputs asked for as binary (the request's
``binary_data_output``, or an output's ``binary_data``) appended the same way.

Every message's numbers go out as JSON numbers (protobuf's own JSON form writes 64-bit integers as strings,
which no v2 REST client expects). JSON is read and written by orjson: strict (no NaN or Infinity literals, a
depth limit) and an order of magnitude faster than the standard library on tensors of numbers, which matters
because parsing holds the interpreter.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import orjson
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from voxserve.datatypes import INPUT_DATATYPES, WIRE_DTYPE, float32_to_bf16_bits
from voxserve.proto import pb

from ..core.errors import invalid, shown
from .codec import REGION_PARAM
from .wire import InferRequest

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_SIZE = "binary_data_size"
BINARY_DATA, BINARY_OUTPUT = "binary_data", "binary_data_output"
TIMEOUT_PARAM = "timeout"  # tritonclient.http's per-request timeout, in microseconds
_INT64 = (-(1 << 63), (1 << 63) - 1)
_INTEGER_TYPES = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT32,
                            FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_FIXED64})


@dataclass(frozen=True)
class RestInfer:
    """A decoded REST inference request: the protocol's request, which outputs go back as binary, and the
    client's timeout (seconds) if it sent one."""

    request: InferRequest
    binary_outputs: frozenset[str] | None  # None: every output (binary_data_output)
    timeout_s: float | None


def message_json(message: Message) -> dict:
    """``message`` as the JSON object the REST form uses: field names as in the .proto, every scalar field (its
    default too), set sub-messages and oneof members, enums by name, bytes as base64, integers as numbers."""
    out: dict[str, object] = {}
    for fd in message.DESCRIPTOR.fields:
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {k: _json_value(value_fd, v) for k, v in getattr(message, fd.name).items()}
        elif _repeated(fd):
            out[fd.name] = [_json_value(fd, v) for v in getattr(message, fd.name)]
        elif (fd.message_type is not None or fd.containing_oneof is not None) and not message.HasField(fd.name):
            continue
        else:
            out[fd.name] = _json_value(fd, getattr(message, fd.name))
    return out


def _repeated(fd: FieldDescriptor) -> bool:
    is_repeated = getattr(fd, "is_repeated", None)  # protobuf 6.33+ (``label`` is deprecated there)
    return bool(is_repeated) if is_repeated is not None else fd.label == FieldDescriptor.LABEL_REPEATED


def _json_value(fd: FieldDescriptor, value):
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return message_json(value)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        named = fd.enum_type.values_by_number.get(value)
        return named.name if named is not None else value
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    return value


def parameter_json(parameter: pb.InferParameter):
    """An InferParameter's value as a JSON value."""
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def _set_parameter(target: pb.InferParameter, value, what: str) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise invalid(f"{what} is {shown(str(value))}: out of the range of a 64-bit integer")
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    elif isinstance(value, str):
        target.string_param = value
    else:
        raise invalid(f"{what} is a JSON {type(value).__name__}; a parameter is a boolean, number or string")


def _set_parameters(target, parameters, what: str, skip: frozenset[str] = frozenset()) -> None:
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise invalid(f"{what} 'parameters' must be a JSON object")
    for key, value in parameters.items():
        if key not in skip:
            _set_parameter(target[key], value, f"{what} parameter '{shown(key)}'")


def _field(obj: dict, key: str, kind: type | tuple[type, ...], what: str, required: bool = False):
    value = obj.get(key)
    if value is None:
        if required:
            raise invalid(f"{what} has no '{key}'")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = {str: "a string", list: "a JSON array", dict: "a JSON object", int: "an integer"}.get(
            kind if isinstance(kind, type) else list, "of another type")
        raise invalid(f"{what} '{key}' must be {expected}")
    return value


def json_length(header_length: str | None, body_bytes: int) -> int:
    """The length of the JSON part of a body of ``body_bytes`` whose Inference-Header-Content-Length header is
    ``header_length`` (None: all of it); INVALID_ARGUMENT unless it is a plain decimal count within the body."""
    if header_length is None:
        return body_bytes
    text = header_length.strip()
    if not (text.isascii() and text.isdigit()):
        raise invalid(f"header {HEADER_LENGTH} is {shown(header_length)!r}; expected a byte count (decimal digits)")
    length = int(text)
    if not 0 < length <= body_bytes:
        raise invalid(f"header {HEADER_LENGTH} is {length}; the body has {body_bytes} bytes, and the JSON part "
                      f"must be 1 to {body_bytes} of them")
    return length


def parse_infer(body: bytes | bytearray | memoryview, header_length: str | None, model_name: str,
                model_version: str) -> RestInfer:
    """Decode a REST inference request for ``model_name`` (``model_version``: the URL's, empty for any).
    Raises ServingError (INVALID_ARGUMENT) naming what is wrong."""
    view = memoryview(body)
    json_end = json_length(header_length, len(view))
    try:
        doc = orjson.loads(view[:json_end])
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc):
            raise invalid("the request's JSON is nested too deeply") from None
        raise invalid(f"the request's JSON is not valid: {shown(str(exc), 120)}") from None
    if not isinstance(doc, dict):
        raise invalid("the request's JSON must be an object with 'inputs'")

    message = pb.ModelInferRequest(model_name=model_name, model_version=model_version)
    request_id = _field(doc, "id", str, "the request")
    if request_id is not None:
        message.id = request_id
    parameters = _field(doc, "parameters", dict, "the request") or {}
    binary_all = parameters.get(BINARY_OUTPUT, False)
    if not isinstance(binary_all, bool):
        raise invalid(f"request parameter '{BINARY_OUTPUT}' must be true or false")
    timeout_s = None
    timeout_us = parameters.get(TIMEOUT_PARAM)
    if timeout_us is not None:
        if not isinstance(timeout_us, int) or isinstance(timeout_us, bool) or timeout_us < 0:
            raise invalid(f"request parameter '{TIMEOUT_PARAM}' must be a count of microseconds >= 0")
        timeout_s = timeout_us / 1e6 if timeout_us else None
    _set_parameters(message.parameters, parameters, "the request", frozenset({BINARY_OUTPUT, TIMEOUT_PARAM}))

    raw: list[memoryview] = []
    offset = json_end
    inputs = _field(doc, "inputs", list, "the request", required=True)
    for i, entry in enumerate(inputs):
        what = f"inputs[{i}]"
        if not isinstance(entry, dict):
            raise invalid(f"{what} must be a JSON object")
        name = _field(entry, "name", str, what, required=True)
        what = f"input '{shown(name)}'"
        datatype = _field(entry, "datatype", str, what, required=True)
        shape = _field(entry, "shape", list, what, required=True)
        if not all(isinstance(d, int) and not isinstance(d, bool) and _INT64[0] <= d <= _INT64[1] for d in shape):
            raise invalid(f"{what} 'shape' must be a list of integers")
        tensor = message.inputs.add(name=name, datatype=datatype, shape=shape)
        tensor_parameters = _field(entry, "parameters", dict, what) or {}
        _set_parameters(tensor.parameters, tensor_parameters, what, frozenset({BINARY_SIZE}))
        size = tensor_parameters.get(BINARY_SIZE)
        data = entry.get("data")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise invalid(f"{what} parameter '{BINARY_SIZE}' must be a byte count >= 0")
            if data is not None:
                raise invalid(f"{what} has both 'data' and binary data ('{BINARY_SIZE}'); send one")
            if offset + size > len(view):
                raise invalid(f"{what}: '{BINARY_SIZE}' {size} runs past the body's end (the binary part has "
                              f"{len(view) - offset} bytes left at this input)")
            raw.append(view[offset:offset + size])
            offset += size
        elif data is not None:
            raw.append(memoryview(_json_tensor(data, datatype, shape, what)))
    if offset != len(view):
        raise invalid(f"the body has {len(view) - offset} bytes after the JSON and the inputs' "
                      f"'{BINARY_SIZE}' bytes; every byte must belong to an input")

    binary_outputs: set[str] = set()
    outputs = _field(doc, "outputs", list, "the request") or []
    for i, entry in enumerate(outputs):
        what = f"outputs[{i}]"
        if not isinstance(entry, dict):
            raise invalid(f"{what} must be a JSON object")
        name = _field(entry, "name", str, what, required=True)
        output = message.outputs.add(name=name)
        output_parameters = _field(entry, "parameters", dict, f"output '{shown(name)}'") or {}
        binary = output_parameters.get(BINARY_DATA, False)
        if not isinstance(binary, bool):
            raise invalid(f"output '{shown(name)}' parameter '{BINARY_DATA}' must be true or false")
        if binary:
            binary_outputs.add(name)
        _set_parameters(output.parameters, output_parameters, f"output '{shown(name)}'", frozenset({BINARY_DATA}))
    return RestInfer(InferRequest(message, raw), None if binary_all else frozenset(binary_outputs), timeout_s)


def _json_tensor(data, datatype: str, shape: list[int], what: str) -> bytes:
    """JSON ``data`` (numbers, row-major, flat or nested as the shape) as the tensor's wire bytes."""
    if datatype not in INPUT_DATATYPES:
        return b""  # the inference path names the datatypes it takes
    if not isinstance(data, list):
        raise invalid(f"{what} 'data' must be a JSON array of numbers")
    numbers = f"{what} 'data' must hold numbers only (no booleans, strings or nulls), flat or nested as the shape"
    try:
        values = np.array(data)  # numpy infers the kind: anything but numbers shows as another kind
    except (ValueError, TypeError, OverflowError):  # ragged nesting; integers beyond int64
        raise invalid(numbers) from None
    if values.dtype.kind not in "iuf":
        raise invalid(numbers)
    elements = 1
    for dim in shape:
        elements *= max(dim, 0)
    if values.size != elements:
        raise invalid(f"{what} 'data' holds {values.size} values; shape {shape} needs {elements}")
    if values.ndim > 1 and list(values.shape) != list(shape):
        raise invalid(f"{what} 'data' is nested as {list(values.shape)}; nest it as the shape {list(shape)} or "
                      f"send it flat")
    with np.errstate(over="ignore"):  # a value beyond the type's range becomes infinite: the output check names it
        if datatype == "BF16":
            return float32_to_bf16_bits(values.astype(np.float32)).tobytes()
        return values.astype(WIRE_DTYPE[datatype]).tobytes()


def encode_infer(response: pb.ModelInferResponse, binary_outputs: frozenset[str] | None) -> tuple[bytes, int | None]:
    """The REST body of ``response`` and the length of its JSON part when binary outputs follow it (None: all
    JSON). Outputs in shared memory carry their parameters and no data."""
    doc: dict = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = {k: parameter_json(v) for k, v in response.parameters.items()}
    tails: list[bytes] = []
    outputs = []
    raw = iter(response.raw_output_contents)
    for tensor in response.outputs:
        entry: dict = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        parameters = {k: parameter_json(v) for k, v in tensor.parameters.items()}
        if tensor.HasField("contents"):
            entry["data"] = list(tensor.contents.fp32_contents)
        elif REGION_PARAM not in parameters:  # not in shared memory: its bytes are the next raw output
            data = next(raw)
            if binary_outputs is None or tensor.name in binary_outputs:
                parameters[BINARY_SIZE] = len(data)
                tails.append(data)
            else:
                entry["data"] = np.frombuffer(data, dtype=WIRE_DTYPE[tensor.datatype]).tolist()
        if parameters:
            entry["parameters"] = parameters
        outputs.append(entry)
    doc["outputs"] = outputs
    header = orjson.dumps(doc)
    if not tails:
        return header, None
    return b"".join((header, *tails)), len(header)
