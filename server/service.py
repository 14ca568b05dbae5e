"""The GRPCInferenceService servicer: a thin translator between the protocol and the runner."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from voxserve import __version__
from voxserve.proto import config_pb, pb

from . import codec
from .admission import ByteBudget, RpcLimiter, current_call
from .batching import DeadlineExceeded, QueueFull
from .codec import ModelSpec
from .errors import ServingError, invalid, runner_error, unavailable
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
# The client's deadline passes a little before the server's (the server counts from when the headers arrived), and
# the client then resets the stream. So a call cancelled within the larger of DEADLINE_SLACK_S and
# DEADLINE_SLACK_SHARE of its timeout before its deadline was cancelled by it; and a response ready within
# DEADLINE_SLACK_S of it would reach a client that has stopped waiting.
DEADLINE_SLACK_S = 0.005
DEADLINE_SLACK_SHARE = 0.1


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


def add_to_server(servicer: InferenceService, server: grpc.aio.Server, limiter: RpcLimiter) -> None:
    """Register the service like the generated helper does, with every method counted against ``limiter``, and
    undecodable bodies answered INVALID_ARGUMENT.

    gRPC's default for a body protobuf cannot parse is UNKNOWN with a Python exception name in it; a client's
    garbage deserves INVALID_ARGUMENT. ModelInfer is registered as client-streaming (the wire is the same) and
    reads its one message itself: a message the transport refuses (over --max-message-bytes) then still reaches
    the servicer, as the end of the input, and is counted like any other refused request.
    """
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        behavior = getattr(servicer, method.name, None)
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


def _reject_malformed(behavior):
    async def handle(request, context):
        if isinstance(request, MalformedRequest):
            exc = request.error()
            await context.abort(exc.code, exc.message)
        return await behavior(request, context)

    return handle


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


class _Stream:
    """One open ModelStreamInfer call, as the drain and the idle timer see it."""

    __slots__ = ("close_reason", "idle_timer", "last_message", "reader")

    def __init__(self, now: float) -> None:
        self.reader: asyncio.Task[None] | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.last_message = now
        self.close_reason: str | None = None

    def close(self, reason: str) -> None:
        """Stop reading: what the stream has in progress is answered, then it ends UNAVAILABLE with ``reason``."""
        if self.close_reason is None:
            self.close_reason = reason
            if self.reader is not None:
                self.reader.cancel()


class InferenceService:
    def __init__(self, state: ServingState, metrics: Metrics, model_name: str, model_version: str,
                 shm: SharedMemoryRegistry | None = None, stream_idle_timeout_s: float = 0.0,
                 max_shm_inflight_bytes: int = 2**31) -> None:
        self.shm = shm
        self.state = state
        self.metrics = metrics
        self.model_name = model_name
        self.model_version = model_version
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self._streams: set[_Stream] = set()
        # The server's private copies of shared-memory inputs, held from the copy until the response.
        self.shm_budget = ByteBudget(max_shm_inflight_bytes, "shared-memory input", "--max-shm-inflight-bytes")

    def close_streams(self, reason: str) -> None:
        """End every ModelStreamInfer stream once what it has in progress is answered (the drain)."""
        for stream in list(self._streams):
            stream.close(reason)

    # --- health and metadata -------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, context):
        # A probe, open to callers without a token under --open-health: a wrong name learns nothing of what is served.
        await self._check_model(request.name, request.version, context, reveal=False)
        return pb.ModelReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="voxserve", version=__version__, extensions=list(EXTENSIONS))

    async def ModelMetadata(self, request, context):
        spec = await self._check_model(request.name, request.version, context)
        response = pb.ModelMetadataResponse(name=self.model_name, versions=[self.model_version], platform=PLATFORM)
        if spec is not None:
            # Each tensor once: generic v2 clients build one input per entry. FP16 and BF16 are accepted too
            # (ModelConfig's parameter accepted_input_datatypes says so).
            response.inputs.add(name=codec.INPUT_NAME, datatype="FP32", shape=[-1, spec.cin, -1, -1, -1])
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

    async def ModelInfer(self, request_iterator, context):
        timeout_s = context.time_remaining()
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        slack_s = max(DEADLINE_SLACK_S, DEADLINE_SLACK_SHARE * (timeout_s or 0))
        try:
            parsed = await context.read()
        except asyncio.CancelledError:  # the call ended (its deadline, the client) while its message arrived
            self.metrics.count_request(self._end_code(context, deadline, slack_s, grpc.StatusCode.CANCELLED).name)
            raise
        if parsed is grpc.aio.EOF:  # the transport ended the call before its message could be read
            # (over --max-message-bytes, unless the call's deadline came or the client went away)
            code = self._end_code(context, deadline, slack_s, grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.metrics.count_request(code.name)
            await self._abort(context, code, "the request message was not received")
        try:
            return await self._infer(parsed, deadline, slack_s)
        except ServingError as exc:
            await self._abort(context, exc.code, exc.message)

    @staticmethod
    async def _abort(context, code: grpc.StatusCode, message: str) -> None:
        """End the call with ``code``; one the client already ended (its deadline, a cancel) ends quietly: gRPC
        logs a failed status send as an error, and a client's deadline is no error of the server's."""
        if context.cancelled():
            raise asyncio.CancelledError
        try:
            await context.abort(code, message)
        except grpc.aio.AbortError:
            raise
        except Exception:  # the status could not be sent: the client ended the call in the meantime
            raise asyncio.CancelledError from None

    @staticmethod
    def _end_code(context, deadline: float | None, slack_s: float, otherwise: grpc.StatusCode) -> grpc.StatusCode:
        """The code a client sees for a call that ended before the server answered it: its deadline's, if that was
        within ``slack_s``; CANCELLED if the client went away; else ``otherwise``."""
        if deadline is not None and deadline - asyncio.get_running_loop().time() <= slack_s:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED if context.cancelled() else otherwise

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests on one stream run concurrently (so they batch with each other and with everyone else's)
        and are answered in the order they came. At most STREAM_WINDOW are taken in at a time: past that the
        stream is not read until the oldest has been answered, so a client that sends without reading is
        held back by HTTP/2 flow control, not buffered. Errors go in the message, not the stream's status,
        so one bad request does not end the stream. A stream with nothing in progress that receives nothing for
        --stream-idle-timeout-s, and every stream when the server drains, stops being read: what it has in
        progress is answered, then it ends UNAVAILABLE."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop.time())
        window = asyncio.Semaphore(STREAM_WINDOW)
        pending: collections.deque[asyncio.Future] = collections.deque()  # in the order they came
        arrived = asyncio.Event()
        reading = True

        async def take_in() -> None:
            nonlocal reading
            try:
                async for request in request_iterator:
                    stream.last_message = loop.time()
                    await window.acquire()
                    pending.append(asyncio.ensure_future(self._stream_answer(request)))
                    arrived.set()
            finally:
                reading = False
                arrived.set()

        if self.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._draining_message())
        stream.reader = reader = asyncio.create_task(take_in())
        self._streams.add(stream)
        if (admitted := current_call()) is not None:  # the limiter may end it for another client while idle
            admitted.busy = lambda: bool(pending)
            admitted.on_preempt = stream.close
        if self.stream_idle_timeout_s > 0:
            self._watch_idle(stream, pending)
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
            if stream.close_reason is not None:
                await self._abort(context, grpc.StatusCode.UNAVAILABLE, stream.close_reason)
            await reader  # the stream's own failure, if reading it failed
        finally:
            self._streams.discard(stream)
            if stream.idle_timer is not None:
                stream.idle_timer.cancel()
            reader.cancel()
            for left in pending:
                # One that never started is counted here: its own accounting never ran.
                unstarted = inspect.getcoroutinestate(left.get_coro()) == inspect.CORO_CREATED
                if left.cancel() and unstarted:
                    self.metrics.count_request(grpc.StatusCode.CANCELLED.name)
            if reader.done() and not reader.cancelled():
                reader.exception()  # seen here: the stream's end says the rest

    def _watch_idle(self, stream: _Stream, pending: collections.deque) -> None:
        """Arm a timer that closes ``stream`` once it has had nothing in progress and no message for the idle
        timeout; it re-arms itself from the last message, so it costs nothing per message."""
        loop = asyncio.get_running_loop()
        timeout = self.stream_idle_timeout_s

        def check() -> None:
            due = stream.last_message + timeout
            if pending or loop.time() < due:
                stream.idle_timer = loop.call_at(max(due, loop.time() + timeout / 4) if pending else due, check)
            else:
                stream.close(f"stream idle for {timeout:g} s (--stream-idle-timeout-s); open a new one to send more")

        stream.idle_timer = loop.call_at(stream.last_message + timeout, check)

    async def _stream_answer(self, request: InferRequest | MalformedRequest) -> pb.ModelStreamInferResponse:
        try:
            return pb.ModelStreamInferResponse(infer_response=await self._infer(request))
        except ServingError as exc:
            response = pb.ModelStreamInferResponse(error_message=f"{exc.code.name}: {exc.message}")
            if isinstance(request, InferRequest):  # which request it answers, as a response would say
                response.infer_response.model_name = self.model_name
                if len(request.message.id) <= codec.MAX_ID_CHARS:
                    response.infer_response.id = request.message.id
            return response

    def _draining_message(self) -> str:
        return f"model '{self.model_name}' is shutting down; retry on another replica"

    async def _infer(self, parsed: InferRequest | MalformedRequest, deadline: float | None = None,
                     cancel_slack_s: float = DEADLINE_SLACK_S) -> pb.ModelInferResponse:
        """One request, start to finish, counted exactly once under the code its client is sent. ``deadline``:
        the call's, in event-loop time (a stream's requests have none of their own); a cancellation within
        ``cancel_slack_s`` of it is its deadline's."""
        arrived = time.perf_counter_ns()
        m = self.metrics.series
        m.inflight.inc()
        self.state.inflight += 1
        admitted = False
        served = True  # False: the request names a model this server does not serve
        code = grpc.StatusCode.OK
        held = 0  # shared-memory bytes taken from the budget
        copy = None  # the private copy they are for
        try:
            if isinstance(parsed, MalformedRequest):
                raise parsed.error()
            request = parsed.message
            if request.model_name != self.model_name or (request.model_version
                                                         and request.model_version != self.model_version):
                served = False
                codec.check_model(self.model_name, self.model_version, request.model_name, request.model_version)
            if len(request.id) > codec.MAX_ID_CHARS:
                raise invalid(f"request id has {len(request.id)} characters; at most {codec.MAX_ID_CHARS} are "
                              f"accepted (it is echoed in the response)")
            spec, runner = self.state.spec, self.state.runner
            if self.state.draining:
                raise unavailable(self._draining_message())
            self.state.accepted += 1  # no await since the check above: a drain cannot start in between
            self.state.admitted_total += 1
            admitted = True
            if runner is not None and runner.device_lost is not None:
                raise runner.lost_error()
            if not self.state.ready or spec is None or runner is None:
                raise unavailable(f"model '{self.model_name}' is not ready yet (loading or warming up)")
            timeout_s = None if deadline is None else deadline - asyncio.get_running_loop().time()
            try:
                runner.admit()  # refuse before decoding: overload must cost as little as possible
                shm_bytes = codec.shared_memory_input_bytes(request)
                if shm_bytes is not None:  # a tensor-sized copy, bounded in total, made off the event loop
                    await self.shm_budget.acquire(shm_bytes)
                    held = shm_bytes
                    copying = asyncio.ensure_future(
                        asyncio.to_thread(codec.decode_request, request, spec, self.shm, parsed.raw))
                    try:
                        decoded = await asyncio.shield(copying)
                    except asyncio.CancelledError:  # the copy goes on in its thread: it keeps its bytes till freed
                        copying.add_done_callback(lambda done, n=held: self._release_when_freed(
                            None if done.cancelled() or done.exception() else done.result().array, n))
                        held = 0
                        raise
                    copy = decoded.array
                else:
                    decoded = codec.decode_request(request, spec, self.shm, parsed.raw)
                m.input_bytes.inc(decoded.array.nbytes)
                result = await runner.run(decoded.array, decoded.datatype, timeout_s)
            except (QueueFull, DeadlineExceeded) as exc:
                raise runner_error(exc, self.model_name) from None
            _check_finite(result.output)
            if deadline is not None and deadline - asyncio.get_running_loop().time() <= DEADLINE_SLACK_S:
                # Too late for the client, which stops waiting before the server's deadline (see DEADLINE_SLACK_S):
                # say so rather than send what nobody reads.
                raise ServingError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed while it ran")
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
            if deadline is not None and deadline - asyncio.get_running_loop().time() <= cancel_slack_s:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            self.state.stats.record_failure(time.perf_counter_ns() - arrived)
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            self.state.stats.record_failure(time.perf_counter_ns() - arrived)
            log.exception("inference failed")
            raise ServingError(grpc.StatusCode.INTERNAL, "inference failed inside the server; see its log") from None
        finally:
            if held:
                self._release_when_freed(copy, held)
                copy = decoded = None  # the frame may outlive the call (a kept traceback): hold no copy
            self.state.inflight -= 1
            if admitted:
                self.state.accepted -= 1
            m.inflight.dec()
            self.metrics.count_request(code.name, served)
            if served:
                m.request_duration.observe((time.perf_counter_ns() - arrived) / 1e9)

    def _release_when_freed(self, copy: np.ndarray | None, nbytes: int) -> None:
        """Give ``nbytes`` back to the shared-memory budget once ``copy``'s memory is freed: a request ended early
        (cancelled, past its deadline) may leave its copy in a thread still copying or computing. Memory that is
        not the copy's own (a pinned or arena block, pooled and bounded apart) is given back now."""
        owner = _memory_owner(copy)
        if owner is None:
            self.shm_budget.release(nbytes)
            return
        loop = asyncio.get_running_loop()

        def freed() -> None:  # on whichever thread drops the last reference
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits for room any more
                loop.call_soon_threadsafe(self.shm_budget.release, nbytes)

        weakref.finalize(owner, freed)

    async def _check_model(self, name: str, version: str, context, reveal: bool = True) -> ModelSpec | None:
        try:
            codec.check_model(self.model_name, self.model_version, name, version, reveal)
        except ServingError as exc:
            await context.abort(exc.code, exc.message)
        return self.state.spec


def _memory_owner(array: np.ndarray | None) -> np.ndarray | None:
    """The array that owns ``array``'s memory, through views and buffers, if it is a numpy array of its own."""
    while array is not None:
        base = array.base
        if base is None:
            return array if array.flags.owndata else None
        if isinstance(base, memoryview):
            base = base.obj
        if not isinstance(base, np.ndarray):
            return None
        array = base
    return None


def _check_finite(output) -> None:
    """INVALID_ARGUMENT naming the first sample whose output is not finite. A sample's output row depends on that
    sample alone, so a NaN or infinity in its input (or values so large that the convolution overflows float32)
    shows up as a non-finite row: checking the (N, Cout) output costs nothing next to scanning the input."""
    finite = np.isfinite(output)
    if not finite.all():
        rows = np.flatnonzero(~finite.all(axis=1))
        raise invalid(f"input '{codec.INPUT_NAME}' sample {int(rows[0])} (of {output.shape[0]}; {rows.size} such) "
                      f"gives a non-finite output: it holds NaN or infinite values, or values so large that the "
                      f"convolution overflows float32")
