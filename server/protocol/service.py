"""The GRPCInferenceService, one gRPC service served by two servicers: the control RPCs (health, metadata,
configuration, statistics, shared-memory registration: ``control.py``) and the inference hot path (ModelInfer,
ModelStreamInfer: ``inference.py``). Here: what both share, and the registration of their methods."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from voxserve.proto import pb

from ..core.errors import ServingError, Status
from ..core.executor import Executor
from ..core.stats import ModelStats
from .admission import RpcLimiter
from .codec import ModelSpec
from .status import abort
from .wire import parse_infer_request

if TYPE_CHECKING:
    from .control import ControlService
    from .inference import InferenceService

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
PLATFORM = "voxserve_fused_conv3d"
EXTENSIONS = ("model_configuration", "statistics", "streaming", "system_shared_memory")
# Listed only by a server with a device layer (control.py): a CPU server answers the CUDA RPCs UNIMPLEMENTED.
CUDA_SHM_EXTENSION = "cuda_shared_memory"


@dataclass
class ServingState:
    """What the servicer serves; filled in as start-up proceeds."""

    spec: ModelSpec | None = None
    runner: Executor | None = None
    device: str = ""
    kernel: str = ""
    max_batch: int = 0
    ready: bool = False
    draining: bool = False
    inflight: int = 0  # inference requests inside the servicer now
    accepted: int = 0  # of those, the ones admitted for work (past the shutdown check): a drain waits for these
    admitted_total: int = 0  # every request ever admitted (the drain's closing log line accounts for them)
    stats: ModelStats = field(default_factory=ModelStats)


@dataclass(frozen=True)
class MalformedRequest:
    """Stands in for a request whose bytes are not a valid message (protobuf, or a REST body): it goes through the
    inference path like any request, to be answered INVALID_ARGUMENT and counted once. ``detail``: what is wrong,
    where the parser can say."""

    type_name: str
    nbytes: int
    detail: str = ""

    def error(self) -> ServingError:
        return ServingError(Status.INVALID_ARGUMENT, self.detail or
                            f"request body ({self.nbytes} bytes) is not a valid {self.type_name} message")


def _tolerant_parser(message_cls):
    # Inference requests keep their tensor bytes as views of the received buffer (server/protocol/wire.py).
    parse_fn = parse_infer_request if message_cls is pb.ModelInferRequest else message_cls.FromString

    def parse(data: bytes):
        try:
            return parse_fn(data)
        except DecodeError:
            return MalformedRequest(message_cls.DESCRIPTOR.full_name, len(data))

    return parse


def add_to_server(control: ControlService, inference: InferenceService, server: grpc.aio.Server,
                  limiter: RpcLimiter) -> None:
    """Register the service like the generated helper does, with every method counted against ``limiter``, and
    undecodable bodies answered INVALID_ARGUMENT.

    gRPC's default for a body protobuf cannot parse is UNKNOWN with a Python exception name in it; a client's
    garbage deserves INVALID_ARGUMENT. ModelInfer is registered as client-streaming (the wire is the same) and
    reads its one message itself: a message the transport refuses (over --max-message-bytes) then still reaches
    the servicer, as the end of the input, and is counted like any other refused request.
    """
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        control_behavior = getattr(control, method.name, None)
        behavior = _control_rpc(control_behavior) if control_behavior else getattr(inference, method.name, None)
        if behavior is None:  # not offered: gRPC answers UNIMPLEMENTED
            continue
        request_cls = GetMessageClass(method.input_type)
        response_cls = GetMessageClass(method.output_type)
        kwargs = {"request_deserializer": _tolerant_parser(request_cls),
                  "response_serializer": response_cls.SerializeToString}
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behavior, **kwargs)
        elif method.name == "ModelInfer":  # answers a malformed body itself (and counts it)
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(behavior, **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_reject_malformed(behavior), **kwargs)
    server.add_generic_rpc_handlers((limiter.service(SERVICE_NAME, handlers),))


def _control_rpc(behavior):
    """A control method (request -> response, or ServingError) as a gRPC handler."""
    async def handle(request, context):
        try:
            return await behavior(request)
        except ServingError as exc:
            await abort(context, exc)

    return handle


def _reject_malformed(behavior):
    async def handle(request, context):
        if isinstance(request, MalformedRequest):
            exc = request.error()
            await abort(context, exc)
        return await behavior(request, context)

    return handle
