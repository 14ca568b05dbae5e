"""The inference hot path of the GRPCInferenceService: ModelInfer and ModelStreamInfer, from the received message
to the encoded response, each request counted once under the code its client is sent, and (with --tracing,
--access-log) traced and logged once where it ends."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

from voxserve.proto import pb

from .. import tracing
from ..core.batching import BatchResult, DeadlineExceeded, QueueFull, Stopped
from ..core.errors import ServingError, Status, internal, invalid, runner_error, unavailable
from ..metrics import INPUT_PATHS, Metrics
from . import codec
from .admission import ByteBudget, current_call, in_progress
from .service import SERVICE_NAME, MalformedRequest, ServingState
from .shm import SharedMemoryRegistry
from .status import grpc_code
from .wire import InferRequest

if TYPE_CHECKING:
    from ..logs import AccessLog

log = logging.getLogger(__name__)

STREAM_WINDOW = 64  # requests of one ModelStreamInfer stream in progress at once
# The client's deadline passes a little before the server's (the server counts from when the headers arrived), and
# the client then resets the stream. So a call cancelled within the larger of DEADLINE_SLACK_S and
# DEADLINE_SLACK_SHARE of its timeout before its deadline was cancelled by it; and a response ready within
# DEADLINE_SLACK_S of it would reach a client that has stopped waiting.
DEADLINE_SLACK_S = 0.005
DEADLINE_SLACK_SHARE = 0.1
# A shared-memory copy's room in --max-shm-inflight-bytes is given back when the copy is freed, and at the latest
# this long after its request ended (what a CPU execution of the copy, left running by a cancelled request,
# normally takes at most).
COPY_RELEASE_GRACE_S = 5.0
INFER, STREAM_INFER = "ModelInfer", "ModelStreamInfer"


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


@dataclass(frozen=True)
class HttpCall:
    """A REST request as ``infer`` sees the call it came on (for a gRPC call: its ServicerContext), for the trace
    and the access record: its route, headers (a W3C traceparent among them), peer, and its HTTP status once
    known (``http_status`` maps the code it ends with)."""

    route: str
    headers: Mapping[str, str]
    remote: str
    http_status: Callable[[Status], int]

    def invocation_metadata(self) -> Mapping[str, str]:
        return self.headers

    def peer(self) -> str:
        return self.remote


def _held_bytes(request: InferRequest | MalformedRequest) -> int:
    """The memory a request received holds until it is answered: its message and its tensor bytes."""
    if isinstance(request, MalformedRequest):
        return request.nbytes
    return request.message.ByteSize() + sum(len(raw) for raw in request.raw)


class InferenceService:
    def __init__(self, state: ServingState, metrics: Metrics, model_name: str, model_version: str,
                 shm: SharedMemoryRegistry | None = None, stream_idle_timeout_s: float = 0.0,
                 max_shm_inflight_bytes: int = 2**31, tracer: tracing.Tracer | None = None,
                 access_log: AccessLog | None = None, max_message_bytes: int = 2**31) -> None:
        self.shm = shm
        self.state = state
        self.metrics = metrics
        self.model_name = model_name
        self.model_version = model_version
        self.stream_idle_timeout_s = stream_idle_timeout_s
        # What one stream's requests taken in and not yet answered may hold: as much as one request may be.
        self.stream_window_bytes = max_message_bytes
        self._streams: set[_Stream] = set()
        # The server's private copies of shared-memory inputs, held from the copy until the copy is freed.
        self.shm_budget = ByteBudget(max_shm_inflight_bytes, "shared-memory input", "--max-shm-inflight-bytes")
        self.tracer = tracer
        self.access_log = access_log
        # The one check a request makes for both (--tracing, --access-log): with both off, nothing else.
        self._observed = tracer is not None or access_log is not None
        # Who a call's client is, for the access log (behind a native front end: who it says; partner.py).
        self.peer_of: Callable[..., str] = lambda call: call.peer()

    @property
    def observed(self) -> bool:
        """Whether requests are traced or access-logged (another transport then passes its call's details)."""
        return self._observed

    def close_streams(self, reason: str) -> None:
        """End every ModelStreamInfer stream once what it has in progress is answered (the drain)."""
        for stream in list(self._streams):
            stream.close(reason)

    # --- inference -----------------------------------------------------------

    async def ModelInfer(self, request_iterator, context):
        timeout_s = context.time_remaining()
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        slack_s = max(DEADLINE_SLACK_S, DEADLINE_SLACK_SHARE * (timeout_s or 0))
        started = time.perf_counter_ns() if self._observed else 0
        try:
            parsed = await context.read()
        except asyncio.CancelledError:  # the call ended (its deadline, the client) while its message arrived
            admitted = current_call()  # or its slot went to another connection's call (admission.py)
            code = (Status.UNAVAILABLE if admitted is not None and admitted.preempted is not None
                    else self._end_code(context, deadline, slack_s, Status.CANCELLED))
            self.metrics.count_request(code.name)
            if self._observed:
                self._observe(context, INFER, None, code, "the call ended before its message arrived", None, None,
                              (started, 0, 0, time.perf_counter_ns()))
            raise
        if parsed is grpc.aio.EOF:  # the transport ended the call before its message could be read
            # (over --max-message-bytes, unless the call's deadline came or the client went away). grpcio ends a
            # call the same ways (this EOF, or the cancel above) whether its message was over the limit or its
            # client reset it while the message arrived, and context.cancelled() is False in both: the count
            # says RESOURCE_EXHAUSTED here and CANCELLED there, which is each ending's likelier cause.
            code = self._end_code(context, deadline, slack_s, Status.RESOURCE_EXHAUSTED)
            self.metrics.count_request(code.name)
            if self._observed:
                self._observe(context, INFER, None, code, "the request message was not received", None, None,
                              (started, 0, 0, time.perf_counter_ns()))
            await self._abort(context, code, "the request message was not received")
        in_progress()  # (from now on, never ended for another call)
        try:
            return await self.infer(parsed, deadline, slack_s, context)
        except ServingError as exc:
            await self._abort(context, exc.code, exc.message)

    @staticmethod
    async def _abort(context, code: Status, message: str) -> None:
        """End the call with ``code``; one the client already ended (its deadline, a cancel) ends quietly: gRPC
        logs a failed status send as an error, and a client's deadline is no error of the server's."""
        if context.cancelled():
            raise asyncio.CancelledError
        try:
            await context.abort(grpc_code(code), message)
        except grpc.aio.AbortError:
            raise
        except Exception:  # the status could not be sent: the client ended the call in the meantime
            raise asyncio.CancelledError from None

    @staticmethod
    def _end_code(context, deadline: float | None, slack_s: float, otherwise: Status) -> Status:
        """The code a client sees for a call that ended before the server answered it: its deadline's, if that was
        within ``slack_s``; CANCELLED if the client went away; else ``otherwise``."""
        if deadline is not None and deadline - asyncio.get_running_loop().time() <= slack_s:
            return Status.DEADLINE_EXCEEDED
        return Status.CANCELLED if context.cancelled() else otherwise

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests on one stream run concurrently (so they batch with each other and with everyone else's)
        and are answered in the order they came. At most STREAM_WINDOW are taken in at a time, holding at most
        --max-message-bytes between them (one request always): past that the stream is not read until the oldest
        have been answered, so a client that sends without reading is held back by HTTP/2 flow control, not
        buffered, and a stream holds no more memory than one call may. Errors go in the message, not the stream's
        status, so one bad request does not end the stream. A stream with nothing in progress that receives nothing for
        --stream-idle-timeout-s, and every stream when the server drains, stops being read: what it has in
        progress is answered, then it ends UNAVAILABLE."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop.time())
        window = asyncio.Semaphore(STREAM_WINDOW)
        room = ByteBudget(self.stream_window_bytes, "a stream's request", "--max-message-bytes")
        pending: collections.deque[asyncio.Task] = collections.deque()  # in the order they came
        held: collections.deque[int] = collections.deque()  # the bytes of each of them
        arrived = asyncio.Event()
        reading = True

        async def take_in() -> None:
            nonlocal reading
            try:
                async for request in request_iterator:
                    stream.last_message = loop.time()
                    await window.acquire()
                    nbytes = min(_held_bytes(request), room.limit)
                    await room.acquire(nbytes)
                    held.append(nbytes)
                    pending.append(asyncio.ensure_future(self._stream_answer(request, context)))
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
                    room.release(held.popleft())
                    if admitted is not None:  # an answer is activity: the client's next message may follow
                        admitted.touch()
            if stream.close_reason is not None:
                await self._abort(context, Status.UNAVAILABLE, stream.close_reason)
            await reader  # the stream's own failure, if reading it failed
        finally:
            self._streams.discard(stream)
            if stream.idle_timer is not None:
                stream.idle_timer.cancel()
            reader.cancel()
            for left in pending:
                # One that never started is counted here: its own accounting never ran.
                coro = left.get_coro()
                unstarted = inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED
                if left.cancel() and unstarted:
                    self.metrics.count_request(Status.CANCELLED.name)
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

    async def _stream_answer(self, request: InferRequest | MalformedRequest, call) -> pb.ModelStreamInferResponse:
        try:
            return pb.ModelStreamInferResponse(infer_response=await self.infer(request, call=call,
                                                                                method=STREAM_INFER))
        except ServingError as exc:
            response = pb.ModelStreamInferResponse(error_message=f"{exc.code.name}: {exc.message}")
            if isinstance(request, InferRequest):  # which request it answers, as a response would say
                response.infer_response.model_name = self.model_name
                if len(request.message.id) <= codec.MAX_ID_CHARS:
                    response.infer_response.id = request.message.id
            return response

    def _draining_message(self) -> str:
        return f"model '{self.model_name}' is shutting down; retry on another replica"

    async def infer(self, parsed: InferRequest | MalformedRequest, deadline: float | None = None,
                     cancel_slack_s: float = DEADLINE_SLACK_S, call=None,
                     method: str = INFER) -> pb.ModelInferResponse:
        """One request, start to finish, counted exactly once under the code its client is sent. ``deadline``:
        the call's, in event-loop time (a stream's requests have none of their own); a cancellation within
        ``cancel_slack_s`` of it is its deadline's. ``call``: the gRPC call of ``method`` it came on (its
        metadata and peer: for the trace and the access log)."""
        arrived = time.perf_counter_ns()
        m = self.metrics.series
        m.inflight.inc()
        self.state.inflight += 1
        admitted = False
        served = True  # False: the request names a model this server does not serve
        code = Status.OK
        held = 0  # shared-memory bytes taken from the budget
        decoded: codec.InferInput | None = None  # with ``held``: its array is the private copy they are for
        result: BatchResult | None = None
        error = ""  # what the client is told when the code is not OK
        # When the request was decoded (and handed to the runner) and when its result came back: its stages.
        decoded_ns = returned_ns = 0
        executing = False
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
                shm_bytes = codec.shared_memory_input_bytes(request, self.shm)
                if shm_bytes is not None:  # a tensor-sized copy, bounded in total, made off the event loop
                    await self.shm_budget.acquire(shm_bytes)
                    held = shm_bytes
                    copying = asyncio.ensure_future(
                        asyncio.to_thread(codec.decode_request, request, spec, self.shm, parsed.raw))
                    try:
                        decoded = await asyncio.shield(copying)
                    except asyncio.CancelledError:  # the copy goes on in its thread: it keeps its bytes till freed
                        copying.add_done_callback(functools.partial(self._release_when_copied, held))
                        held = 0
                        raise
                    if self.shm is not None and self.shm.in_place(decoded.array):  # DMA'd from the client's pages:
                        self.shm_budget.release(held)  # no copy to bound
                        held = 0
                else:
                    decoded = await codec.decode_mapped(request, spec, self.shm, parsed.raw)
                m.input_bytes[decoded.path].inc(decoded.array.nbytes)
                decoded_ns = time.perf_counter_ns()
                waiting = runner.run(decoded.array, decoded.datatype, timeout_s)
                executing = True  # until its answer is back, an execution may be reading the input
                try:
                    result = await waiting
                except Exception:  # answered with an error: none of its executions runs any more (batching.py)
                    executing = False
                    raise
                executing = False
                returned_ns = time.perf_counter_ns()
            except (QueueFull, DeadlineExceeded, Stopped) as exc:
                raise (runner_error(exc, self.model_name) or exc) from None
            _check_finite(result.output)
            if deadline is not None and deadline - asyncio.get_running_loop().time() <= DEADLINE_SLACK_S:
                # Too late for the client, which stops waiting before the server's deadline (see DEADLINE_SLACK_S):
                # say so rather than send what nobody reads.
                raise ServingError(Status.DEADLINE_EXCEEDED, "the request's deadline passed while it ran")
            if decoded.output_shm is not None and not decoded.output_on_device:
                await codec.store_output(decoded.output_shm, result.output, self.shm)
            response = codec.encode_response(request, spec, result.output, decoded)
            elapsed = time.perf_counter_ns() - arrived
            self.state.stats.record_success(decoded.samples, elapsed, result.queue_ns)
            m.samples.inc(decoded.samples)
            return response
        except ServingError as exc:
            code, error = exc.code, exc.message
            self.state.stats.record_failure(time.perf_counter_ns() - arrived)
            raise
        except asyncio.CancelledError:
            code, error = Status.CANCELLED, "the call was cancelled"
            if deadline is not None and deadline - asyncio.get_running_loop().time() <= cancel_slack_s:
                code, error = Status.DEADLINE_EXCEEDED, "the call's deadline passed"
            self.state.stats.record_failure(time.perf_counter_ns() - arrived)
            raise
        except Exception:
            code, error = Status.INTERNAL, "inference failed inside the server"
            self.state.stats.record_failure(time.perf_counter_ns() - arrived)
            log.exception("inference failed")
            raise internal("inference failed inside the server; see its log") from None
        finally:
            ended = time.perf_counter_ns()
            if self._observed:
                self._observe(call, method, parsed, code, error, decoded, result,
                              (arrived, decoded_ns, returned_ns, ended))
            if decoded is not None and decoded.lease is not None and not executing:
                # A tensor in a client's CUDA memory: no execution reads it any more, so its mapping may close now
                # (a failure's traceback could keep the tensor, and its lease, alive until a collection). While an
                # execution may (a request cancelled as it ran), the lease goes with the tensor.
                decoded.lease.release()
                if decoded.output_lease is not None:
                    decoded.output_lease.release()
            if held:
                self._release_when_freed(decoded.array if decoded is not None else None, held)
                decoded = None  # the frame may outlive the call (a kept traceback): hold no copy
            self.state.inflight -= 1
            if admitted:
                self.state.accepted -= 1
            m.inflight.dec()
            self.metrics.count_request(code.name, served)
            if served:
                m.request_duration.observe((ended - arrived) / 1e9)

    def account(self, codes: np.ndarray, served: np.ndarray, elapsed_ns: np.ndarray, queue_ns: np.ndarray,
                samples: np.ndarray, input_bytes: np.ndarray, paths: np.ndarray) -> None:
        """Count requests another process answered (a native front end's: partner.py) as this one counts its own:
        voxserve_requests_total by code, their durations, samples and input bytes by path, and ModelStatistics. One
        array element per request: its gRPC status code, whether it named the served model, nanoseconds from
        arrival to the end and in the queue, samples, input bytes and their path (an index in INPUT_PATHS)."""
        m, stats = self.metrics.series, self.state.stats
        ok = codes == Status.OK.value
        if ok.any():
            served_samples = int(samples[ok].sum())
            stats.record_success(served_samples, int(elapsed_ns[ok].sum()), int(queue_ns[ok].sum()), int(ok.sum()))
            m.samples.inc(served_samples)
        if not ok.all():
            stats.record_failure(int(elapsed_ns[~ok].sum()), int((~ok).sum()))
        for index, path in enumerate(INPUT_PATHS):
            nbytes = int(input_bytes[paths == index].sum())
            if nbytes:
                m.input_bytes[path].inc(nbytes)
        for (code, named), n in collections.Counter(zip(codes.tolist(), served.tolist(), strict=True)).items():
            self.metrics.count_request(Status.of(code).name, bool(named), n)
        for seconds in (elapsed_ns[served != 0] / 1e9).tolist():  # (a histogram takes its observations one by one)
            m.request_duration.observe(seconds)

    def _observe(self, call, method: str, parsed: InferRequest | MalformedRequest | None, code: Status, error: str,
                 decoded: codec.InferInput | None, result: BatchResult | None,
                 stamps: tuple[int, int, int, int]) -> None:
        """Trace (--tracing) and log (--access-log) one request that has ended with ``code``. ``stamps``
        (perf_counter_ns): when it arrived, was decoded, came back from the runner (0: it did not get that far),
        ended. Never raises: the request's own accounting comes after it."""
        arrived, decoded_ns, returned_ns, ended = stamps
        try:
            request = parsed.message if isinstance(parsed, InferRequest) else None
            # A client's text, bounded: a span's attributes have no length limit unless the operator sets one.
            limit = codec.MAX_ID_CHARS
            request_id = request.id[:limit] if request is not None else ""
            model = request.model_name[:limit] if request is not None else self.model_name
            version = (request.model_version[:limit] if request is not None else "") or self.model_version
            samples = decoded.samples if decoded is not None else 0
            nbytes = decoded.array.nbytes if decoded is not None else 0
            http = call if isinstance(call, HttpCall) else None
            http_status = http.http_status(code) if http is not None else None
            if self.tracer is not None:
                attributes: dict[str, tracing.AttributeValue] = {
                    tracing.MODEL_NAME: model, tracing.MODEL_VERSION: version, tracing.BATCH_SIZE: samples,
                    tracing.INPUT_BYTES: nbytes}
                if http is not None:
                    attributes[tracing.HTTP_REQUEST_METHOD] = "POST"
                    attributes[tracing.HTTP_ROUTE] = http.route
                    attributes[tracing.HTTP_STATUS_CODE] = http_status or 0
                else:
                    attributes.update({tracing.RPC_SYSTEM: "grpc", tracing.RPC_SERVICE: SERVICE_NAME,
                                       tracing.RPC_METHOD: method,
                                       tracing.RPC_GRPC_STATUS_CODE: grpc_code(code).value[0]})
                if request_id:
                    attributes[tracing.REQUEST_ID] = request_id
                if decoded is not None:
                    attributes[tracing.DATATYPE] = decoded.datatype
                if result is not None:
                    attributes[tracing.EXECUTION_SAMPLES] = result.batch_samples
                trace = self.tracer.request("http" if http is not None else "grpc",
                                            f"POST {http.route}" if http is not None else method,
                                            call.invocation_metadata() if call is not None else None,
                                            arrived, attributes)
                trace.stages(arrived, decoded_ns, returned_ns, ended, None if result is None else result.queue_ns)
                trace.finish(code.name, error, ended)
            if self.access_log is not None:
                self.access_log.record(transport="http" if http is not None else "grpc",
                                       method=f"POST {http.route}" if http is not None else method, code=code.name,
                                       duration_ms=(ended - arrived) / 1e6, model=model,
                                       peer=self.peer_of(call) if call is not None else None,
                                       request_id=request_id or None,
                                       input_bytes=nbytes, samples=samples, http_status=http_status)
        except Exception:
            log.exception("tracing or access-logging a request failed")

    def _release_when_copied(self, nbytes: int, copying: asyncio.Future) -> None:
        """``copying`` (a cancelled request's copy, made on in its thread) has ended: its room goes back once
        its copy is freed."""
        failed = copying.cancelled() or copying.exception() is not None
        self._release_when_freed(None if failed else copying.result().array, nbytes)

    def _release_when_freed(self, copy: object, nbytes: int) -> None:
        """Give ``nbytes`` back to the shared-memory budget once ``copy``'s memory is freed: a request ended early
        (cancelled, past its deadline) may leave its copy in a thread still copying or computing. At the latest
        COPY_RELEASE_GRACE_S after now, whatever still holds it: a reference kept by mistake must not lock the
        budget, and with it every later shared-memory request. Memory that is not the copy's own (a pinned or
        arena block, pooled and bounded apart) is given back now."""
        owner = _memory_owner(copy)
        if owner is None:
            self.shm_budget.release(nbytes)
            return
        loop = asyncio.get_running_loop()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.shm_budget.release(nbytes)

        def freed() -> None:  # on whichever thread drops the last reference
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits for room any more
                loop.call_soon_threadsafe(release)

        weakref.finalize(owner, freed)
        loop.call_later(COPY_RELEASE_GRACE_S, release)


def _memory_owner(array: object) -> np.ndarray | None:
    """The array that owns ``array``'s memory, through views and buffers, if it is a numpy array of its own (not a
    tensor where it lies in a client's CUDA memory)."""
    while isinstance(array, np.ndarray):
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
    if math.isfinite(output.sum()):  # each value is a mean of probabilities: no finite row makes the sum overflow
        return
    finite = np.isfinite(output)
    if not finite.all():
        rows = np.flatnonzero(~finite.all(axis=1))
        raise invalid(f"input '{codec.INPUT_NAME}' sample {int(rows[0])} (of {output.shape[0]}; {rows.size} such) "
                      f"gives a non-finite output: it holds NaN or infinite values, or values so large that the "
                      f"convolution overflows float32")
