"""Protocol <-> model translation: decode and validate a ModelInferRequest, encode the response.

Every rejection is a ServingError naming the field, the value and the limit.
Input bytes are viewed, not copied: ``np.frombuffer`` over the request's bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from voxserve.datatypes import INPUT_DATATYPES, ITEMSIZE, WIRE_DTYPE
from voxserve.proto import pb

from ..core.devicemem import DeviceArray, RegionTensor
from ..core.errors import ServingError, exhausted, invalid, not_found, shown, unimplemented
from . import wire
from .cudashm import MAP_ROUNDS, NotMappedHere

if TYPE_CHECKING:
    from .cudashm import Lease

INPUT_NAME = "input"
OUTPUT_NAME = "output"
DIM_NAMES = ("N", "Cin", "D", "H", "W")
REGION_PARAM, OFFSET_PARAM, SIZE_PARAM = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"
CLASSIFICATION_PARAM = "classification"  # Triton's classification extension (not offered: refused, never ignored)
# The request id is echoed in the response: a longer one is refused, so that no client makes the server hold
# copies of an upload it chose to make large (an unread response keeps its id in memory).
MAX_ID_CHARS = 256


@dataclass(frozen=True)
class ModelSpec:
    """What a request is checked against."""

    name: str
    version: str
    cin: int
    cout: int
    k: int
    max_request_samples: int
    max_request_voxels: int = 1 << 25


@dataclass(frozen=True)
class SharedMemoryRef:
    region: str
    offset: int
    byte_size: int | None  # None: not given (outputs)


@dataclass(frozen=True)
class InferInput:
    array: np.ndarray | DeviceArray | RegionTensor  # wire-typed view (N, Cin, D, H, W); BF16 as uint16 bits
    datatype: str
    typed_response: bool  # the client sent typed contents: answer the same way
    output_shm: SharedMemoryRef | None = None  # write the output there instead of into the response
    path: str = "wire"  # how its bytes came: wire, system_shm (in place or a private copy), cuda_shm (where they lie)
    lease: Lease | None = None  # cuda_shm: what keeps the client's memory mapped (release() when no longer read)
    output_lease: Lease | None = None  # the output's, when the execution writes it into a CUDA region (below)

    @property
    def output_on_device(self) -> bool:
        """Whether the execution itself writes the output into the client's CUDA region (the input's ``result``):
        nothing to store after it."""
        return isinstance(self.array, (DeviceArray, RegionTensor)) and self.array.result is not None

    @property
    def samples(self) -> int:
        return int(self.array.shape[0])


def check_model(served_name: str, served_version: str, name: str, version: str, reveal: bool = True) -> None:
    """NOT_FOUND unless (name, version) addresses the served model (an empty version means any). ``reveal``:
    whether the message may name what is served (not to a caller who may not have authenticated)."""
    if name != served_name:
        served = f"; this server serves '{served_name}'" if reveal else ""
        raise not_found(f"model '{shown(name)}' is not served here{served}")
    if version and version != served_version:
        available = f"; available: '{served_version}'" if reveal else ""
        raise not_found(f"model '{shown(name)}' has no version '{shown(version)}'{available}")


def _check_shape(spec: ModelSpec, shape: list[int]) -> tuple[int, ...]:
    if (len(shape) == 5 and shape[1] == spec.cin and 1 <= shape[0] <= spec.max_request_samples
            and min(shape[2], shape[3], shape[4]) >= spec.k
            and shape[0] * shape[2] * shape[3] * shape[4] <= spec.max_request_voxels):
        return tuple(shape)  # a valid shape (every request that is served) in one test; else the rule it breaks:
    if len(shape) != 5:
        raise invalid(f"input '{INPUT_NAME}' has shape {shown(str(shape))} (rank {len(shape)}); "
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
    voxels = shape[0] * shape[2] * shape[3] * shape[4]  # Python ints: exact for any int64 the client sends
    if voxels > spec.max_request_voxels:
        raise exhausted(f"input '{INPUT_NAME}' shape {shape} holds {voxels} voxels (N x D x H x W); at most "
                        f"{spec.max_request_voxels} are accepted per request (--max-request-voxels)")
    return tuple(int(d) for d in shape)


def _shm_ref(parameters, what: str) -> SharedMemoryRef | None:
    """The shared-memory parameters of a tensor, checked for type and sign; None when it has none."""
    if REGION_PARAM not in parameters:
        for param in (OFFSET_PARAM, SIZE_PARAM):
            if param in parameters:
                raise invalid(f"{what} sets '{param}' without '{REGION_PARAM}'")
        return None
    region = parameters[REGION_PARAM]
    if region.WhichOneof("parameter_choice") != "string_param":
        raise invalid(f"{what}: '{REGION_PARAM}' must be a string parameter")
    values = {}
    for param in (OFFSET_PARAM, SIZE_PARAM):
        if param in parameters:
            p = parameters[param]
            kind = p.WhichOneof("parameter_choice")
            if kind not in ("int64_param", "uint64_param"):
                raise invalid(f"{what}: '{param}' must be an integer parameter")
            values[param] = getattr(p, kind)
            if values[param] < 0:
                raise invalid(f"{what}: '{param}' is {values[param]}; it must be >= 0")
    return SharedMemoryRef(region.string_param, values.get(OFFSET_PARAM, 0), values.get(SIZE_PARAM))


def shared_memory_input_bytes(request: pb.ModelInferRequest, shm=None) -> int | None:
    """The bytes a request's system shared-memory input declares (decoding it copies that many), or None when its
    input is not in shared memory, or is in a CUDA region of ``shm`` (read where it lies: no copy). Only its type is
    checked here; decode_request checks it against the shape."""
    for tensor in request.inputs:
        if REGION_PARAM in tensor.parameters:
            ref = _shm_ref(tensor.parameters, f"input '{shown(tensor.name)}'")
            if ref is None:
                return 0
            if shm is not None and shm.cuda is not None and shm.cuda.holds(ref.region):
                return None  # nothing to copy (decoded with open_here=False: a region not mapped here yet is mapped
                # on the registry's thread first, by the caller)
            return ref.byte_size or 0
    return None


def decode_request(request: pb.ModelInferRequest, spec: ModelSpec, shm=None,
                   raw_contents: Sequence[bytes | memoryview] | None = None, open_here: bool = True) -> InferInput:
    """Validate ``request`` against the model and return its input as an array (a zero-copy view of
    raw bytes; a private copy of system shared memory; for CUDA shared memory the tensor where it lies, a
    ``DeviceArray``). ``shm``: the SharedMemoryRegistry, if the server has one (with its CUDA regions,
    ``shm.cuda``, if it has those).
    ``raw_contents``: the raw tensor bytes when they were kept out of the message (server/protocol/wire.py).
    ``open_here`` false (on an event loop): a CUDA region not mapped in this process yet raises NotMappedHere, and
    nothing is held; the caller maps it off the loop (``map_here``) and decodes again."""
    if raw_contents is None:
        raw_contents = request.raw_input_contents
    check_model(spec.name, spec.version, request.model_name, request.model_version)
    if len(request.inputs) != 1:
        names = shown(str([t.name for t in request.inputs]))
        raise invalid(f"request has {len(request.inputs)} inputs {names}; model '{spec.name}' takes exactly one, "
                      f"'{INPUT_NAME}'")
    tensor = request.inputs[0]
    if tensor.name != INPUT_NAME:
        raise invalid(f"unknown input '{shown(tensor.name)}'; model '{spec.name}' has one input, '{INPUT_NAME}'")
    input_shm = _shm_ref(tensor.parameters, f"input '{INPUT_NAME}'")
    output_shm = _shm_ref(request.outputs[0].parameters, f"output '{OUTPUT_NAME}'") if request.outputs else None
    if (input_shm or output_shm) and shm is None:
        raise unimplemented("this server does not offer system shared memory")
    if tensor.datatype not in INPUT_DATATYPES:
        raise invalid(f"input '{INPUT_NAME}' has datatype '{shown(tensor.datatype)}'; supported: "
                      f"{', '.join(INPUT_DATATYPES)}")
    requested = [o.name for o in request.outputs]
    for name in requested:
        if name != OUTPUT_NAME:
            raise invalid(f"unknown output '{shown(name)}' requested; model '{spec.name}' has one output, "
                          f"'{OUTPUT_NAME}'")
    if len(requested) > 1:
        raise invalid(f"output '{OUTPUT_NAME}' is requested {len(requested)} times; request it at most once")
    if requested and CLASSIFICATION_PARAM in request.outputs[0].parameters:
        raise unimplemented(f"output '{OUTPUT_NAME}': '{CLASSIFICATION_PARAM}' (the classification extension's "
                            f"top classes) is not offered; request the probabilities and take the top classes")

    shape = _check_shape(spec, list(tensor.shape))
    elements = 1
    for dim in shape:
        elements *= dim  # Python ints: no overflow, whatever the client sent
    datatype = tensor.datatype
    # The typed-contents fields the client set (ListFields lists only non-empty ones, in field order).
    typed = [fd.name for fd, _ in tensor.contents.ListFields()] if tensor.HasField("contents") else []
    if output_shm is not None:
        needed = shape[0] * spec.cout * 4
        if output_shm.byte_size is None:
            raise invalid(f"output '{OUTPUT_NAME}' is in shared memory but sets no '{SIZE_PARAM}'; the protocol "
                          f"requires it (here at least {needed} bytes, the [{shape[0]}, {spec.cout}] FP32 output)")
        if output_shm.byte_size < needed:
            raise invalid(f"output '{OUTPUT_NAME}': {SIZE_PARAM} {output_shm.byte_size} is less than the "
                          f"{needed} bytes of the [{shape[0]}, {spec.cout}] FP32 output")
        output_shm = SharedMemoryRef(output_shm.region, output_shm.offset, needed)

    if input_shm is not None:
        if raw_contents or typed:
            raise invalid(f"input '{INPUT_NAME}' is in shared memory and must carry no other data")
        expected = elements * ITEMSIZE[datatype]
        if input_shm.byte_size is None:
            raise invalid(f"input '{INPUT_NAME}' is in shared memory but sets no '{SIZE_PARAM}'; the protocol "
                          f"requires it (here {expected} bytes, shape {list(shape)} of {datatype})")
        if input_shm.byte_size != expected:
            raise invalid(f"input '{INPUT_NAME}' shape {list(shape)} of {datatype} needs {expected} bytes; "
                          f"'{SIZE_PARAM}' is {input_shm.byte_size}")
        if shm.cuda is not None and shm.cuda.holds(input_shm.region):  # read where it lies: no copy
            array, lease = shm.cuda.read(input_shm.region, input_shm.offset, shape, WIRE_DTYPE[datatype],
                                         f"input '{INPUT_NAME}'", open_here)
            try:
                array, output_lease = _output_on_device(array, output_shm, shm.cuda, spec.cout, open_here)
            except BaseException:
                if lease is not None:
                    lease.release()
                raise
            return InferInput(array, datatype, False, output_shm, "cuda_shm", lease, output_lease)
        array = shm.read_tensor(input_shm.region, input_shm.offset, shape, WIRE_DTYPE[datatype],
                                f"input '{INPUT_NAME}'")
        return InferInput(array, datatype, False, output_shm, "system_shm")

    if raw_contents:
        if typed:
            raise invalid(f"input '{INPUT_NAME}' sets both raw_input_contents and contents.{typed[0]}; send one")
        if len(raw_contents) != 1:
            raise invalid(f"raw_input_contents has {len(raw_contents)} entries; expected 1, one per "
                          f"input")
        raw = raw_contents[0]
        expected = elements * ITEMSIZE[datatype]
        if len(raw) != expected:
            raise invalid(f"input '{INPUT_NAME}' shape {list(shape)} of {datatype} needs {expected} bytes; "
                          f"raw_input_contents[0] holds {len(raw)}")
        return InferInput(np.frombuffer(raw, dtype=WIRE_DTYPE[datatype]).reshape(shape), datatype, False,
                          output_shm)

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
    return InferInput(wire.packed_floats(tensor.contents).reshape(shape), datatype, True, output_shm)


async def decode_mapped(request: pb.ModelInferRequest, spec: ModelSpec, shm=None,
                        raw_contents: Sequence[bytes | memoryview] | None = None) -> InferInput:
    """decode_request on an event loop, which never opens a CUDA handle: a region another replica registered and
    this process has not mapped yet is mapped on the registry's opening thread (``map_here``), then the request is
    decoded again; refused once it was registered anew MAP_ROUNDS times while it was being mapped. A region that
    does not open is refused by the decode after it, in the request's words, without opening it again."""
    rounds = 0
    while True:
        try:
            return decode_request(request, spec, shm, raw_contents, open_here=False)
        except NotMappedHere as missing:
            if rounds == MAP_ROUNDS:
                raise missing.remapped_too_often() from None
            rounds += 1
            with contextlib.suppress(ServingError):
                await shm.cuda.map_here(missing.name, "a request's tensor")


def _output_on_device(array, output: SharedMemoryRef | None, cuda, cout: int, open_here: bool = True):
    """The input, and the output's lease: where the input lies in CUDA memory and the output goes to a CUDA region on
    the same device, the input with that span as its ``result``, whose output the execution writes there on the
    device (a DeviceArray here: ``attach_result``; or, in a front end, a RegionTensor naming the output region for
    the engine). As it came, and None, otherwise (the output is stored after the execution), and for an output
    offset that is not a whole float (a copy from the host takes it, a kernel's store would not)."""
    if (not isinstance(array, (DeviceArray, RegionTensor)) or output is None or output.offset % 4
            or not cuda.holds(output.region)):
        return array, None
    what = f"output '{OUTPUT_NAME}'"
    if isinstance(array, DeviceArray):
        return array, cuda.attach_result(array, output.region, output.offset, cout, what, open_here)
    target, _ = cuda.read(output.region, output.offset, (array.shape[0], cout), np.dtype("<f4"), what, open_here)
    if isinstance(target, RegionTensor) and array.kind == target.kind == "cuda" and target.device_id == array.device_id:
        return dataclasses.replace(array, result=(target.region, target.offset)), None
    return array, None


async def store_output(ref: SharedMemoryRef, output: np.ndarray, shm) -> None:
    """Write the FP32 (N, Cout) output into the shared-memory region the request named (before the response that
    says it is there): a system region's bytes here, a CUDA region's by its registry (which, in a front end, asks
    the engine that maps it)."""
    data = np.ascontiguousarray(output, dtype="<f4").tobytes()
    if shm.cuda is not None and shm.cuda.holds(ref.region):
        await shm.cuda.store(ref.region, ref.offset, data, f"output '{OUTPUT_NAME}'")
    else:
        shm.write(ref.region, ref.offset, data, f"output '{OUTPUT_NAME}'")


def encode_response(request: pb.ModelInferRequest, spec: ModelSpec, output: np.ndarray,
                    decoded: InferInput) -> pb.ModelInferResponse:
    """Build the response: FP32 (N, Cout) in raw_output_contents, typed if the request was typed, or only the
    tensor's description when it went to the requested shared-memory region (``store_output``, done first)."""
    response = pb.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=request.id)
    tensor = response.outputs.add(name=OUTPUT_NAME, datatype="FP32", shape=list(output.shape))
    out = np.ascontiguousarray(output, dtype="<f4")
    if decoded.output_shm is not None:
        ref = decoded.output_shm
        tensor.parameters[REGION_PARAM].string_param = ref.region
        tensor.parameters[SIZE_PARAM].int64_param = out.nbytes
    elif decoded.typed_response:
        tensor.contents.fp32_contents.extend(out.ravel().tolist())
    else:
        response.raw_output_contents.append(out.tobytes())
    return response
