"""The GRPCInferenceService servicer: a thin translator between the protocol and the runner."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from voxserve import __version__
from voxserve.proto import config_pb, pb

from . import codec
from .batching import DeadlineExceeded, QueueFull
from .codec import ModelSpec
from .errors import ServingError, runner_error, unavailable
from .metrics import Metrics
from .runner import Runner
from .shm import SharedMemoryRegistry
from .stats import Duration, ModelStats
from .wire import InferRequest, parse_infer_request

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
PLATFORM = "voxserve_fused_conv3d"
EXTENSIONS = ("model_configuration", "statistics", "streaming", "system_shared_memory")
STREAM_WINDOW = 64  # requests of one ModelStreamInfer stream in progress at once


@dataclass
class ServingState:
    """What the servicer serves; filled in as start-up proceeds."""

    spec: ModelSpec | None = None
    runner: Runner | None = None
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
    """Stands in for a request whose bytes are not a valid protobuf message."""

    type_name: str
    nbytes: int

    def error(self) -> ServingError:
        return ServingError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request body ({self.nbytes} bytes) is not a valid {self.type_name} message")


def _tolerant_parser(message_cls):
    # Inference requests keep their tensor bytes as views of the received buffer (server/wire.py).
    parse_fn = parse_infer_request if message_cls is pb.ModelInferRequest else message_cls.FromString

    def parse(data: bytes):
        try:
            return parse_fn(data)
        except DecodeError:
            return MalformedRequest(message_cls.DESCRIPTOR.full_name, len(data))

    return parse


def add_to_server(servicer: InferenceService, server: grpc.aio.Server) -> None:
    """Register the service like the generated helper does, but answer undecodable bodies with INVALID_ARGUMENT.

    gRPC's default for a body protobuf cannot parse is UNKNOWN with a Python
    exception name in it; a client's garbage deserves INVALID_ARGUMENT.
    """
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        behavior = getattr(servicer, method.name, None)
        if behavior is None:  # not offered: gRPC answers UNIMPLEMENTED
            continue
        request_cls = GetMessageClass(method.input_type)
        response_cls = GetMessageClass(method.output_type)
        parse = _tolerant_parser(request_cls)
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                behavior, request_deserializer=parse, response_serializer=response_cls.SerializeToString)
        else:  # ModelInfer answers a malformed body itself (and counts it), without a wrapper per call
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                behavior if method.name == "ModelInfer" else _reject_malformed(behavior),
                request_deserializer=parse, response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _reject_malformed(behavior):
    async def handle(request, context):
        if isinstance(request, MalformedRequest):
            exc = request.error()
            await context.abort(exc.code, exc.message)
        return await behavior(request, context)

    return handle


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


class InferenceService:
    def __init__(self, state: ServingState, metrics: Metrics, model_name: str, model_version: str,
                 shm: SharedMemoryRegistry | None = None) -> None:
        self.shm = shm
        self.state = state
        self.metrics = metrics
        self.model_name = model_name
        self.model_version = model_version

    # --- health and metadata -------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, context):
        await self._check_model(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="voxserve", version=__version__, extensions=list(EXTENSIONS))

    async def ModelMetadata(self, request, context):
        spec = await self._check_model(request.name, request.version, context)
        response = pb.ModelMetadataResponse(name=self.model_name, versions=[self.model_version], platform=PLATFORM)
        if spec is not None:
            for datatype in ("FP32", "FP16", "BF16"):
                response.inputs.add(name=codec.INPUT_NAME, datatype=datatype, shape=[-1, spec.cin, -1, -1, -1])
            response.outputs.add(name=codec.OUTPUT_NAME, datatype="FP32", shape=[-1, spec.cout])
        return response

    async def ModelConfig(self, request, context):
        spec = await self._check_model(request.name, request.version, context)
        config = config_pb.ModelConfig(name=self.model_name, platform=PLATFORM, backend="voxserve",
                                       max_batch_size=self.state.max_batch)
        if spec is not None:
            config.input.add(name=codec.INPUT_NAME, data_type=config_pb.TYPE_FP32, dims=[spec.cin, -1, -1, -1])
            config.output.add(name=codec.OUTPUT_NAME, data_type=config_pb.TYPE_FP32, dims=[spec.cout])
            config.parameters["kernel_size"].string_value = str(spec.k)
        devices = [d for d in self.state.device.split(",") if d]
        gpu = bool(devices) and devices[0].startswith("cuda")
        kind = config_pb.ModelInstanceGroup.KIND_GPU if gpu else config_pb.ModelInstanceGroup.KIND_CPU
        group = config.instance_group.add(name=f"{self.model_name}_0", count=max(1, len(devices)), kind=kind)
        if gpu:
            group.gpus.extend(int(d.partition(":")[2] or 0) for d in devices)
        runner = self.state.runner
        if runner is not None and runner.batching.enabled:
            config.dynamic_batching.max_queue_delay_microseconds = int(runner.batching.max_delay_s * 1e6)
        config.parameters["device"].string_value = self.state.device
        config.parameters["kernel"].string_value = self.state.kernel
        config.parameters["accepted_input_datatypes"].string_value = "FP32,FP16,BF16"
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        if request.name:
            await self._check_model(request.name, request.version, context)
        s = self.state.stats.combined()  # with --replicas: every replica's figures
        stats = pb.ModelStatistics(
            name=self.model_name, version=self.model_version, last_inference=s.last_inference_ms,
            inference_count=s.inference_count, execution_count=s.execution_count,
            inference_stats=pb.InferStatistics(
                success=_duration(s.success), fail=_duration(s.fail), queue=_duration(s.queue),
                compute_input=_duration(s.compute_input), compute_infer=_duration(s.compute_infer),
                compute_output=_duration(s.compute_output)),
        )
        for size, b in s.batches.items():
            stats.batch_stats.add(batch_size=size, compute_input=_duration(b.compute_input),
                                  compute_infer=_duration(b.compute_infer), compute_output=_duration(b.compute_output))
        return pb.ModelStatisticsResponse(model_stats=[stats])

    # --- system shared memory ----------------------------------------------------

    async def SystemSharedMemoryRegister(self, request, context):
        await self._shm_call(context, self.shm.register, request.name, request.key, request.offset,
                             request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._shm_call(context, self.shm.unregister, request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def SystemSharedMemoryStatus(self, request, context):
        regions = await self._shm_call(context, self.shm.status, request.name)
        response = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            response.regions[r.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return response

    async def _shm_call(self, context, fn, *args):
        if self.shm is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server does not offer system shared memory")
        try:
            return fn(*args)
        except ServingError as exc:
            await context.abort(exc.code, exc.message)

    # --- inference -----------------------------------------------------------

    async def ModelInfer(self, request, context):
        try:
            return await self._infer(request, context.time_remaining())
        except ServingError as exc:
            await context.abort(exc.code, exc.message)

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests on one stream run concurrently (so they batch with each other and with everyone else's)
        and are answered in the order they came. At most STREAM_WINDOW are taken in at a time: past that the
        stream is not read until the oldest has been answered, so a client that sends without reading is
        held back by HTTP/2 flow control, not buffered. Errors go in the message, not the stream's status,
        so one bad request does not end the stream."""
        window = asyncio.Semaphore(STREAM_WINDOW)
        pending: collections.deque[asyncio.Future] = collections.deque()  # in the order they came
        arrived = asyncio.Event()
        reading = True

        async def take_in() -> None:
            nonlocal reading
            try:
                async for request in request_iterator:
                    await window.acquire()
                    pending.append(asyncio.ensure_future(self._stream_answer(request)))
                    arrived.set()
            finally:
                reading = False
                arrived.set()

        reader = asyncio.create_task(take_in())
        try:
            while pending or reading:
                if not pending:
                    arrived.clear()
                    await arrived.wait()
                    continue
                try:
                    yield await pending[0]
                finally:
                    pending.popleft().cancel()  # a no-op once answered; the work of a dropped stream stops
                    window.release()
            await reader  # the stream's own failure, if reading it failed
        finally:
            reader.cancel()
            for left in pending:
                left.cancel()
            if reader.done() and not reader.cancelled():
                reader.exception()  # seen here: the stream's end says the rest

    async def _stream_answer(self, request: InferRequest | MalformedRequest) -> pb.ModelStreamInferResponse:
        try:
            return pb.ModelStreamInferResponse(infer_response=await self._infer(request))
        except ServingError as exc:
            response = pb.ModelStreamInferResponse(error_message=f"{exc.code.name}: {exc.message}")
            if isinstance(request, InferRequest):  # which request it answers, as a response would say
                response.infer_response.model_name = self.model_name
                response.infer_response.id = request.message.id
            return response

    async def _infer(self, parsed: InferRequest | MalformedRequest,
                     timeout_s: float | None = None) -> pb.ModelInferResponse:
        arrived = time.perf_counter_ns()
        m = self.metrics.series
        m.inflight.inc()
        self.state.inflight += 1
        admitted = False
        code = grpc.StatusCode.OK
        try:
            if isinstance(parsed, MalformedRequest):
                raise parsed.error()
            request = parsed.message
            spec, runner = self.state.spec, self.state.runner
            if self.state.draining:
                raise unavailable(f"model '{self.model_name}' is shutting down; retry on another replica")
            self.state.accepted += 1  # no await since the check above: a drain cannot start in between
            self.state.admitted_total += 1
            admitted = True
            if runner is not None and runner.device_lost is not None:
                raise runner.lost_error()
            if not self.state.ready or spec is None or runner is None:
                codec.check_model(self.model_name, self.model_version, request.model_name, request.model_version)
                raise unavailable(f"model '{self.model_name}' is not ready yet (loading or warming up)")
            try:
                runner.admit()  # refuse before decoding: overload must cost as little as possible
                if codec.input_in_shared_memory(request):  # a tensor-sized copy: off the event loop
                    decoded = await asyncio.to_thread(codec.decode_request, request, spec, self.shm, parsed.raw)
                else:
                    decoded = codec.decode_request(request, spec, self.shm, parsed.raw)
                m.input_bytes.inc(decoded.array.nbytes)
                result = await runner.run(decoded.array, decoded.datatype, timeout_s)
            except (QueueFull, DeadlineExceeded) as exc:
                raise runner_error(exc, self.model_name) from None
            response = codec.encode_response(request, spec, result.output, decoded, self.shm)
            elapsed = time.perf_counter_ns() - arrived
            self.state.stats.record_success(decoded.samples, elapsed, result.queue_ns)
            m.samples.inc(decoded.samples)
            return response
        except ServingError as exc:
            code = exc.code
            self.state.stats.record_failure(time.perf_counter_ns() - arrived)
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            self.state.stats.record_failure(time.perf_counter_ns() - arrived)
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            self.state.stats.record_failure(time.perf_counter_ns() - arrived)
            log.exception("inference failed")
            raise ServingError(grpc.StatusCode.INTERNAL, "inference failed inside the server; see its log") from None
        finally:
            self.state.inflight -= 1
            if admitted:
                self.state.accepted -= 1
            m.inflight.dec()
            self.metrics.count_request(code.name)
            m.request_duration.observe((time.perf_counter_ns() - arrived) / 1e9)

    async def _check_model(self, name: str, version: str, context) -> ModelSpec | None:
        try:
            codec.check_model(self.model_name, self.model_version, name, version)
        except ServingError as exc:
            await context.abort(exc.code, exc.message)
        return self.state.spec
