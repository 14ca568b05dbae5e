"""`voxserve bench`: a load generator for Open Inference Protocol servers, in the spirit of perf_analyzer.

For each concurrency level, that many asyncio workers send the same pre-serialised ModelInfer
request back to back for a duration or a number of requests (``--streaming``: as messages of one
ModelStreamInfer stream per connection instead of one call each); the report gives throughput
(requests/s, samples/s, MB/s of input tensor data and of request messages on the wire) and latency
percentiles per level, the first error of a level that had any (status and message), and the server's own
queue/compute split from ModelStatistics. It works against any Open Inference Protocol server (the report
names the server from its ServerMetadata). ``--compare-raw`` sends the same bytes, in the same run, to a
trivial sink server in another process: the gRPC transport's ceiling on this machine.
Needs only grpcio, protobuf and numpy (matplotlib for --plot, cuda-bindings for --cuda-shared-memory).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import multiprocessing
import os
import queue
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import numpy as np

from voxserve.datatypes import to_wire
from voxserve.proto import pb

from .client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Client,
    InferenceError,
    _channel_options,
    build_request,
    build_shm_request,
)
from .cuda import CudaBuffer, require_device
from .security import PLAINTEXT, Credentials
from .shm import SharedMemoryBuffer

INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
START_TIMEOUT_S = 120.0  # for --processes to import, connect and meet
STATS_METHOD = "/inference.GRPCInferenceService/ModelStatistics"


@dataclass
class LevelResult:
    target: str  # the server's name ("voxserve", "triton", ...) or "raw sink"
    concurrency: int
    requests: int
    errors: int
    seconds: float
    samples_per_request: int
    request_bytes: int  # input tensor bytes per request (in shared memory or on the wire)
    wire_bytes: int = 0  # the serialised request message's bytes (what crosses the socket)
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    server_queue_ms: float | None = None  # mean per request, from ModelStatistics
    server_compute_ms: float | None = None  # mean per execution
    server_executions: int | None = None  # the model's executions (batches) over the level, from ModelStatistics
    wall_start: float = field(default=0.0, repr=False)  # time.time() of the first request sent
    wall_end: float = field(default=0.0, repr=False)
    # (status name, details) -> count, for every failed request, in the order first seen (summary(): the first)
    failures: collections.Counter = field(default_factory=collections.Counter, repr=False)

    @property
    def first_error(self) -> tuple[str, str] | None:
        """(status name, message) of the first failed request, None when none failed."""
        return next(iter(self.failures), None)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("latencies_ms", "failures")}
        d.update(requests_per_s=self.rps, samples_per_s=self.rps * self.samples_per_request,
                 mb_per_s=self.rps * self.request_bytes / 1e6, wire_mb_per_s=self.rps * self.wire_bytes / 1e6,
                 p50_ms=self.percentile(50), p90_ms=self.percentile(90), p99_ms=self.percentile(99),
                 first_error=None)
        if self.first_error is not None:
            d["first_error"] = dict(zip(("status", "message"), self.first_error, strict=True))
        return d


async def _stats(channel: grpc.aio.Channel, model: str, metadata) -> pb.ModelStatistics | None:
    call = channel.unary_unary(STATS_METHOD, request_serializer=pb.ModelStatisticsRequest.SerializeToString,
                               response_deserializer=pb.ModelStatisticsResponse.FromString)
    try:
        return (await call(pb.ModelStatisticsRequest(name=model), timeout=10, metadata=metadata)).model_stats[0]
    except (grpc.RpcError, IndexError):
        return None


class _Stream:
    """One ModelStreamInfer stream that several workers share. One task writes the requests in the order
    they were handed in and the server answers in that order, so the n-th answer is the n-th request's."""

    def __init__(self, channel: grpc.aio.Channel, metadata) -> None:
        self.call = channel.stream_stream(STREAM_METHOD)(metadata=metadata)  # bytes in, bytes out
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.outbox: asyncio.Queue[tuple[bytes, asyncio.Future]] = asyncio.Queue()
        self.failure: StreamError | None = None  # once the stream has ended: every later request fails at once
        self.tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]

    async def __call__(self, payload: bytes, timeout: float, metadata=None) -> None:
        """Send one request and wait for its answer; raise grpc.RpcError-like errors as a unary call would."""
        if self.failure is not None:
            raise self.failure
        future = asyncio.get_running_loop().create_future()
        self.outbox.put_nowait((payload, future))
        try:
            error = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise StreamError(f"no answer within {timeout} s") from None
        if error:
            raise StreamError(error)

    async def _write(self) -> None:
        while True:
            payload, future = await self.outbox.get()
            self.waiting.append(future)  # before the write: its answer cannot come earlier
            try:
                await self.call.write(payload)
            except (grpc.RpcError, asyncio.InvalidStateError) as exc:  # the stream has ended
                self._fail(StreamError(f"the stream ended: {exc!r}"))
                return

    async def _read(self) -> None:
        failure = StreamError("the stream ended")
        try:
            async for raw in self.call:
                future = self.waiting.popleft()
                if not future.done():  # else it timed out meanwhile
                    future.set_result(pb.ModelStreamInferResponse.FromString(raw).error_message)
        except grpc.RpcError as exc:
            failure = StreamError(f"the stream failed: {exc.code().name}")
        finally:
            self._fail(failure)

    def _fail(self, failure: StreamError) -> None:
        """The stream is over: fail what waits for an answer or to be sent, and whatever comes later."""
        self.failure = self.failure or failure
        while not self.outbox.empty():
            self.waiting.append(self.outbox.get_nowait()[1])
        for future in self.waiting:
            if not future.done():
                future.set_exception(self.failure)
        self.waiting.clear()

    async def close(self) -> None:
        self.tasks[0].cancel()
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
            await self.call.done_writing()
        self.call.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class StreamError(grpc.RpcError):
    """A request answered with an error message on a stream (or lost with its stream)."""


def _failure(exc: grpc.RpcError) -> tuple[str, str]:
    """A failed request's status name and details; a StreamError has no status of its own (the server's
    error_message on a stream carries none), so it is named by its class."""
    code = getattr(exc, "code", None)
    if callable(code):
        return code().name, exc.details() or ""
    return type(exc).__name__, str(exc)


async def run_level(url: str, payload: bytes, samples: int, tensor_bytes: int, concurrency: int, *,
                    duration_s: float | None,
                    requests: int | None, model: str, target: str, timeout_s: float = 120.0,
                    progress: bool = False, credentials: Credentials = PLAINTEXT,
                    connections: int = 1, statistics: bool = True, streaming: bool = False,
                    ready: Callable[[], None] | None = None) -> LevelResult:
    """Drive one concurrency level; exactly one of duration_s / requests bounds it. The workers share
    ``connections`` connections round-robin (a server of several replicas serves each on one replica);
    ``streaming``: each connection carries one ModelStreamInfer stream that its workers' requests travel on;
    ``statistics``: ask the server's ModelStatistics before and after (a server without them: no split).
    The project's one closed-loop driver: voxserve.testing.load.closed_loop reports a level of it by status."""
    metadata = credentials.metadata()
    async with contextlib.AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(
            credentials.channel(url, _channel_options(DEFAULT_MAX_MESSAGE_BYTES), aio=True))
            for _ in range(max(1, min(connections, concurrency)))]
        channel = channels[0]
        if streaming:
            calls = [_Stream(ch, metadata) for ch in channels]
            for stream in calls:
                stack.push_async_callback(stream.close)
        else:  # bytes in, bytes out: no client-side (de)serialisation
            calls = [ch.unary_unary(INFER_METHOD) for ch in channels]
        before = await _stats(channel, model, metadata) if statistics else None
        result = LevelResult(target, concurrency, 0, 0, 0.0, samples, tensor_bytes, len(payload))
        if ready is not None:  # connected: wait for the other load processes (blocks this loop, idle anyway)
            ready()
        result.wall_start = time.time()
        started = time.perf_counter()
        more = level_gate(requests, duration_s)

        async def worker(call) -> None:
            while more():
                t0 = time.perf_counter()
                try:
                    await call(payload, timeout=timeout_s, metadata=metadata)
                    result.latencies_ms.append((time.perf_counter() - t0) * 1e3)
                    result.requests += 1
                except grpc.RpcError as exc:
                    result.errors += 1
                    result.failures[_failure(exc)] += 1

        async def report() -> None:
            while True:
                await asyncio.sleep(1.0)
                print(f"\r  {target} c={concurrency}: {result.requests} requests, "
                      f"{time.perf_counter() - started:.0f} s", end="", file=sys.stderr, flush=True)

        reporter = asyncio.create_task(report()) if progress else None
        await asyncio.gather(*(worker(calls[i % len(calls)]) for i in range(concurrency)))
        result.seconds = time.perf_counter() - started
        result.wall_end = time.time()
        if reporter is not None:
            reporter.cancel()
            print(file=sys.stderr)
        after = await _stats(channel, model, metadata) if statistics else None
        _server_split(result, before, after)
        return result


def level_gate(requests: int | None, duration_s: float | None) -> Callable[[], bool]:
    """Whether a level's worker may send one more request: ``requests`` in all (each call that says yes takes
    one), or until ``duration_s`` from now."""
    issued = 0
    stop_at = time.perf_counter() + duration_s if duration_s is not None else None

    def more() -> bool:
        nonlocal issued
        if requests is not None:
            if issued >= requests:
                return False
            issued += 1
            return True
        return stop_at is not None and time.perf_counter() < stop_at

    return more


def _level_process(results, url: str, payload: bytes, samples: int, tensor_bytes: int, concurrency: int,
                   duration_s: float | None, requests: int | None, model: str, target: str, timeout_s: float,
                   credentials: Credentials, connections: int, streaming: bool, start, driver, options) -> None:
    """One of --processes: connect, start with the others (``start``: a barrier of all of them and the
    parent), drive its share of the level, send back the result."""
    try:
        r = asyncio.run(driver(url, payload, samples, tensor_bytes, concurrency, duration_s=duration_s,
                               requests=requests, model=model, target=target, timeout_s=timeout_s,
                               credentials=credentials, connections=connections, statistics=False,
                               streaming=streaming, ready=lambda: start.wait(START_TIMEOUT_S), **options))
        results.put((r.requests, r.errors, r.wall_start, r.wall_end, r.latencies_ms, r.failures))
    except BaseException as exc:  # the parent must not wait for a result that will never come
        results.put(exc)
        raise


def run_level_processes(url: str, payload: bytes, samples: int, tensor_bytes: int, concurrency: int, *,
                        processes: int, duration_s: float | None, requests: int | None, model: str, target: str,
                        timeout_s: float = 120.0, progress: bool = False, credentials: Credentials = PLAINTEXT,
                        connections: int = 1, streaming: bool = False, statistics: bool = True,
                        driver: Callable[..., Awaitable[LevelResult]] | None = None,
                        driver_options: dict | None = None) -> LevelResult:
    """``run_level`` (or ``driver``, a module-level coroutine function taking run_level's arguments and
    ``driver_options``: another protocol's driver) spread over ``processes`` load processes (each its own event
    loop and connections), for servers that one Python client process cannot saturate; the workers, connections
    and requests are split as evenly as they go and the latencies merged."""
    processes = max(1, min(processes, concurrency))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    start = ctx.Barrier(processes + 1)
    children = []
    for i in range(processes):
        share = concurrency // processes + (i < concurrency % processes)
        conns = max(1, connections // processes + (i < connections % processes))
        reqs = None if requests is None else requests // processes + (i < requests % processes)
        children.append(ctx.Process(target=_level_process, daemon=True, args=(
            results, url, payload, samples, tensor_bytes, share, duration_s, reqs, model, target, timeout_s,
            credentials, conns, streaming, start, driver or run_level, driver_options or {})))
    before = asyncio.run(_stats_once(url, model, credentials)) if statistics else None
    for child in children:
        child.start()
    merged = LevelResult(target, concurrency, 0, 0, 0.0, samples, tensor_bytes, len(payload))
    try:
        # Every process sends for the same window: started one by one, each would have the server to itself
        # for a while and their summed rates would overstate what they reach together.
        start.wait(START_TIMEOUT_S)
        started = time.time()
        for done in range(processes):
            while True:
                try:
                    part = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not any(c.is_alive() for c in children) and results.empty():
                        raise RuntimeError("the load processes exited without a result") from None
                    if progress:
                        print(f"\r  {target} c={concurrency}: {done} of {processes} load processes done, "
                              f"{time.time() - started:.0f} s", end="", file=sys.stderr, flush=True)
            if isinstance(part, BaseException):
                raise RuntimeError(f"a load process failed: {part!r}")
            n, errors, wall_start, wall_end, latencies, failures = part
            merged.requests += n
            merged.errors += errors
            merged.failures.update(failures)
            merged.wall_start = min(merged.wall_start or wall_start, wall_start)
            merged.wall_end = max(merged.wall_end, wall_end)
            merged.latencies_ms.extend(latencies)
        merged.seconds = merged.wall_end - merged.wall_start  # from the first request sent to the last answer
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.terminate()
        if progress:
            print(file=sys.stderr)
    after = asyncio.run(_stats_once(url, model, credentials)) if statistics else None
    _server_split(merged, before, after)
    return merged


def run_level_over(url: str, payload: bytes, samples: int, tensor_bytes: int, concurrency: int, *,
                   processes: int = 1, driver: Callable[..., Coroutine[Any, Any, LevelResult]] | None = None,
                   driver_options: dict | None = None, **options) -> LevelResult:
    """One level: ``run_level`` (or ``driver``, as for run_level_processes) in this process, or spread over
    ``processes`` load processes where more than one would have workers (run_level_processes). ``options``:
    run_level's keyword arguments."""
    if min(processes, concurrency) > 1:
        return run_level_processes(url, payload, samples, tensor_bytes, concurrency, processes=processes,
                                   driver=driver, driver_options=driver_options, **options)
    return asyncio.run((driver or run_level)(url, payload, samples, tensor_bytes, concurrency,
                                             **(driver_options or {}), **options))


async def _stats_once(url: str, model: str, credentials: Credentials) -> pb.ModelStatistics | None:
    async with credentials.channel(url, _channel_options(DEFAULT_MAX_MESSAGE_BYTES), aio=True) as channel:
        return await _stats(channel, model, credentials.metadata())


def _server_split(result: LevelResult, before: pb.ModelStatistics | None, after: pb.ModelStatistics | None) -> None:
    """The server's mean queue time per request and compute time per execution over the level."""
    if before is None or after is None:
        return
    result.server_executions = after.execution_count - before.execution_count
    s0, s1 = before.inference_stats, after.inference_stats
    if s1.queue.count > s0.queue.count:
        result.server_queue_ms = (s1.queue.ns - s0.queue.ns) / (s1.queue.count - s0.queue.count) / 1e6
    if s1.compute_infer.count > s0.compute_infer.count:
        result.server_compute_ms = ((s1.compute_infer.ns - s0.compute_infer.ns)
                                    / (s1.compute_infer.count - s0.compute_infer.count) / 1e6)


def _sink_main(port_queue) -> None:
    """A trivial ModelInfer (and ModelStreamInfer) sink: accepts any body, answers a fixed small response."""
    async def serve() -> None:
        reply = pb.ModelInferResponse(model_name="sink").SerializeToString()
        stream_reply = pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(model_name="sink")
                                                   ).SerializeToString()

        async def handle(request: bytes, context) -> bytes:
            return reply

        async def handle_stream(requests, context):
            async for _ in requests:
                yield stream_reply

        server = grpc.aio.server(options=_channel_options(DEFAULT_MAX_MESSAGE_BYTES))
        handler = grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(handle),
                                               "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                                                   handle_stream)})
        server.add_generic_rpc_handlers((handler,))
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


@contextlib.contextmanager
def raw_sink() -> Iterator[str]:
    """A trivial ModelInfer sink in another process, for the raw gRPC ceiling; yields its address."""
    ctx = multiprocessing.get_context("spawn")
    port_queue = ctx.Queue()
    sink = ctx.Process(target=_sink_main, args=(port_queue,), daemon=True)
    sink.start()
    try:
        yield f"127.0.0.1:{port_queue.get(timeout=60)}"
    finally:
        sink.terminate()
        sink.join(10)


def format_table(results: list[LevelResult]) -> str:
    """One row per level. "tensor MB/s": input tensor bytes per second, wherever they travel (on the wire, or in
    shared memory); "wire MB/s": request messages' bytes per second through the socket."""
    width = max([10, *(len(r.target) for r in results)])
    header = (f"{'target':<{width}} {'conc':>5} {'req/s':>9} {'samples/s':>10} {'tensor MB/s':>11} {'wire MB/s':>9} "
              f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'errors':>6} {'srv queue ms':>12} {'srv compute ms':>14}")
    rows = [header, "-" * len(header)]
    for r in results:
        q = f"{r.server_queue_ms:.2f}" if r.server_queue_ms is not None else "-"
        c = f"{r.server_compute_ms:.2f}" if r.server_compute_ms is not None else "-"
        rows.append(f"{r.target:<{width}} {r.concurrency:>5} {r.rps:>9.1f} {r.rps * r.samples_per_request:>10.1f} "
                    f"{r.rps * r.request_bytes / 1e6:>11.1f} {r.rps * r.wire_bytes / 1e6:>9.2f} "
                    f"{r.percentile(50):>8.2f} {r.percentile(90):>8.2f} {r.percentile(99):>8.2f} {r.errors:>6} "
                    f"{q:>12} {c:>14}")
    return "\n".join(rows)


def format_errors(results: list[LevelResult]) -> str:
    """A line per level that had errors: how many, and the first one's status and message."""
    lines = []
    for r in results:
        if r.first_error is not None:
            status, message = r.first_error
            lines.append(f"{r.target} c={r.concurrency}: {r.errors} of {r.errors + r.requests} requests failed; "
                         f"the first: {status}: {message}")
    return "\n".join(lines)


def format_bytes(n: float) -> str:
    """A byte count in the unit that reads best (B, kB, MB, GB; decimal)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def plot(results: list[LevelResult], path: str, title: str = ""):
    """p50 and p99 latency against throughput, a line per target (log latency axis, ticks in plain ms);
    writes ``path`` and returns the figure."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(8, 5))  # not pyplot's: nothing is kept once it is written
    ax = fig.subplots()
    for i, target in enumerate(sorted({r.target for r in results})):
        rs = [r for r in results if r.target == target]
        x = [r.rps * r.samples_per_request for r in rs]
        color = f"C{i}"
        ax.plot(x, [r.percentile(99) for r in rs], marker="o", color=color, label=f"{target} p99")
        ax.plot(x, [r.percentile(50) for r in rs], marker="s", linestyle="--", color=color, label=f"{target} p50")
        for r, xi in zip(rs, x, strict=True):
            ax.annotate(f"c={r.concurrency}", (xi, r.percentile(99)), fontsize=8, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("throughput (samples/s)")
    ax.set_ylabel("latency (ms), log scale")
    ax.set_yscale("log")
    # Ticks written as numbers of ms, not powers of ten, and dense enough that a latency range within one
    # decade still gets some: 1, 2, 5, 10, 20, ... over a wide range, every 1..9 x 10^n over a narrow one.
    ms = [v for r in results for v in (r.percentile(50), r.percentile(99)) if v == v and v > 0]
    subs: tuple[float, ...] = (1.0, 2.0, 5.0)
    if ms:
        lo, hi = min(ms) / 1.5, max(ms) * 1.5
        ax.set_ylim(lo, hi)
        if hi / lo < 10:
            subs = tuple(float(k) for k in range(1, 10))
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def _server_name(url: str, credentials: Credentials) -> str | None:
    """The server's ServerMetadata name and version ("triton 2.51.0"); None when it does not answer."""
    try:
        with Client(url, timeout_s=10, credentials=credentials) as c:
            meta = c.server_metadata()
    except Exception:  # unreachable, refused, not a v2 server: the levels will report it
        return None
    return f"{meta.name} {meta.version}".strip() or None


def setup_shared_memory(url: str, x: np.ndarray, datatype: str, model: str,
                        credentials: Credentials = PLAINTEXT) -> tuple[bytes, Callable[[], None]]:
    """Put ``x`` in a new /dev/shm segment, register it and an output region with the server, and return a
    serialised request that references both (a few hundred bytes) and a function that undoes it all."""
    wire = to_wire(x, datatype)
    tag = f"voxbench_{os.getpid()}_{next(_shm_ids)}"
    shm_in = SharedMemoryBuffer(f"{tag}_in", len(wire))
    shm_in.write(np.frombuffer(wire, np.uint8))
    with Client(url, model=model, credentials=credentials) as c:
        out_bytes = 4 * x.shape[0] * c._output_width()
        shm_out = SharedMemoryBuffer(f"{tag}_out", out_bytes)
        c.register_system_shared_memory(f"{tag}_in", shm_in.key, shm_in.size)
        c.register_system_shared_memory(f"{tag}_out", shm_out.key, shm_out.size)
    payload = build_shm_request(tuple(x.shape), model, datatype, f"{tag}_in", output_region=f"{tag}_out",
                                output_byte_size=out_bytes).SerializeToString()

    def cleanup() -> None:
        try:
            with Client(url, model=model, credentials=credentials) as c:
                for region in (f"{tag}_in", f"{tag}_out"):
                    _unregister(c, region)
        finally:
            shm_in.close()
            shm_out.close()

    return payload, cleanup


_shm_ids = itertools.count()
CUDA_ALIGN_BYTES = 256  # where the output starts in the bench's CUDA region (cudaMalloc's own alignment)


def setup_cuda_shared_memory(url: str, x: np.ndarray, datatype: str, model: str,
                             credentials: Credentials = PLAINTEXT,
                             device_id: int = 0) -> tuple[bytes, Callable[[], None]]:
    """Put ``x`` in device memory of this process (cudaMalloc on ``device_id``, with room for the output after
    it), register it as one CUDA shared-memory region, and return a serialised request whose input and output
    lie there and a function that undoes it all. Needs cuda-bindings (``voxserve[cuda]``) and a CUDA device."""
    require_device(device_id)  # before the server is asked anything: the reason is this process's
    wire = to_wire(x, datatype)
    tag = f"voxbench_cuda_{os.getpid()}_{next(_shm_ids)}"
    with Client(url, model=model, credentials=credentials) as c:
        out_bytes = 4 * x.shape[0] * c._output_width()
        out_offset = -(-len(wire) // CUDA_ALIGN_BYTES) * CUDA_ALIGN_BYTES
        buf = CudaBuffer(out_offset + out_bytes, device_id)
        try:
            buf.write(np.frombuffer(wire, np.uint8))
            c.register_cuda_region(tag, buf.region)
        except BaseException:
            buf.close()
            raise
    payload = build_shm_request(tuple(x.shape), model, datatype, tag, output_region=tag, output_offset=out_offset,
                                output_byte_size=out_bytes).SerializeToString()

    def cleanup() -> None:
        try:
            with Client(url, model=model, credentials=credentials) as c:
                _unregister(c, tag, cuda=True)
        finally:
            buf.close()

    return payload, cleanup


def _unregister(client: Client, region: str, patience_s: float = 10.0, cuda: bool = False) -> None:
    """Unregister a region (``cuda``: a CUDA one), trying again for a while: Triton refuses while a request that
    used it is still being released, which can be a moment after its answer came ("Cannot unregister ... it is
    currently in use")."""
    deadline = time.monotonic() + patience_s
    unregister = client.unregister_cuda_shared_memory if cuda else client.unregister_system_shared_memory
    while True:
        try:
            unregister(region)
            return
        except InferenceError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main(args) -> int:
    """The CLI's `bench` (arguments from voxserve.cli)."""
    shape = (args.batch, *args.shape)
    creds = args.credentials
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    payload = build_request(x, args.model_name, args.dtype).SerializeToString()
    tensor_bytes = len(to_wire(x, args.dtype))
    cleanup = None
    if args.shared_memory:
        payload, cleanup = setup_shared_memory(args.url, x, args.dtype, args.model_name, creds)
    elif args.cuda_shared_memory:
        payload, cleanup = setup_cuda_shared_memory(args.url, x, args.dtype, args.model_name, creds,
                                                    args.cuda_device)
    memory = "system" if args.shared_memory else "cuda" if args.cuda_shared_memory else None
    levels = args.concurrency
    duration = None if args.requests else args.duration
    results: list[LevelResult] = []
    server = _server_name(args.url, creds)
    targets = [((server or "server").split()[0], args.url, creds)]
    with contextlib.ExitStack() as stack:
        if args.compare_raw:
            # The sink is plaintext and local: with TLS to voxserve the comparison includes TLS's cost.
            targets.append(("raw sink", stack.enter_context(raw_sink()), PLAINTEXT))
        if cleanup is not None:
            stack.callback(cleanup)
        for target, url, target_creds in targets:
            for c in levels:
                common = dict(duration_s=duration, requests=args.requests, model=args.model_name, target=target,
                              timeout_s=args.timeout_s, progress=not args.json, credentials=target_creds,
                              connections=args.connections, streaming=args.streaming,
                              statistics=target != "raw sink")
                results.append(run_level_over(url, payload, args.batch, tensor_bytes, c, processes=args.processes,
                                              **common))
    if args.json:
        print(json.dumps({"shape": list(shape), "dtype": args.dtype, "request_bytes": len(payload),
                          "tensor_bytes": tensor_bytes, "shared_memory": bool(args.shared_memory),
                          "cuda_shared_memory": bool(args.cuda_shared_memory), "server": server,
                          "streaming": bool(args.streaming),
                          "levels": [r.summary() for r in results]}, indent=2))
    else:
        where = {"system": "in shared memory", "cuda": f"in CUDA shared memory (device {args.cuda_device})",
                 None: "in the message"}[memory]
        how = ", on streams (ModelStreamInfer)" if args.streaming else ""
        print(f"server: {server or '(no ServerMetadata answer)'} at {args.url}")
        print(f"request: {shape} {args.dtype}: {format_bytes(tensor_bytes)} of input tensor {where}, "
              f"{format_bytes(len(payload))} request message on the wire{how}")
        print(format_table(results))
        errors = format_errors(results)
        if errors:
            print(errors)
    if args.plot:
        kind = {None: "", "system": ", shared memory", "cuda": ", CUDA shared memory"}[memory]
        title = (f"{shape} {args.dtype}{kind}"
                 f"{', streaming' if args.streaming else ''}\n{server or 'server'} at {args.url}, "
                 f"client on {socket.gethostname()}")
        plot(results, args.plot, title)
        # stderr beside --json, whose stdout is the JSON alone
        print(f"plot written to {os.path.abspath(args.plot)}", file=sys.stderr if args.json else sys.stdout)
    failed = sum(r.errors for r in results)
    return 1 if failed and failed == sum(r.errors + r.requests for r in results) else 0
