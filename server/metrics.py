"""Every Prometheus metric the server exports, defined in one place; other modules only observe them.

Names are part of the product (base units, ``_total``, ``_seconds``, ``_bytes``).
Each server owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from voxserve import __version__

from .topology.ports import bind_address

log = logging.getLogger(__name__)

# Sub-millisecond GPU executions up to multi-second CPU batches.
LATENCY_BUCKETS_S: Sequence[float] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS: Sequence[float] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# The model label of requests for a model that is not served here.
UNKNOWN_MODEL = "unknown"


def parse_buckets(text: str) -> tuple[float, ...]:
    """'0.001,0.01,0.1' -> (0.001, 0.01, 0.1); ValueError unless positive and increasing."""
    values = tuple(float(v) for v in text.split(",") if v.strip())
    if not values or any(v <= 0 for v in values) or any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError(f"{text!r}: need positive, strictly increasing bucket bounds")
    return values


def latency_buckets(text: str) -> tuple[float, ...]:
    """--latency-buckets-s: its buckets, or the defaults when empty."""
    return parse_buckets(text) if text else tuple(LATENCY_BUCKETS_S)


class NvmlCollector(Collector):
    """GPU utilisation and memory from NVML, read when Prometheus scrapes (never on the request path)."""

    def __init__(self, pynvml, count: int) -> None:
        self._nvml = pynvml
        self._count = count

    @classmethod
    def create(cls) -> NvmlCollector | None:
        """A collector for the visible GPUs, or None where NVML or GPUs are absent."""
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # no driver, no library, no GPU: no GPU metrics
            log.debug("no GPU metrics: %s", exc)
            return None
        return cls(pynvml, count) if count > 0 else None

    def collect(self):
        util = GaugeMetricFamily("voxserve_gpu_utilization_ratio", "GPU busy fraction over the driver's last "
                                 "sample period (NVML).", labels=["gpu"])
        used = GaugeMetricFamily("voxserve_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=["gpu"])
        total = GaugeMetricFamily("voxserve_gpu_memory_total_bytes", "GPU memory size (NVML).", labels=["gpu"])
        for i in range(self._count):
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
                rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # a GPU that stops answering: skip it in this scrape
                log.warning("NVML query for GPU %d failed: %s", i, exc)
                continue
            util.add_metric([str(i)], rates.gpu / 100.0)
            used.add_metric([str(i)], float(memory.used))
            total.add_metric([str(i)], float(memory.total))
        yield from (util, used, total)


INPUT_PATHS = ("wire", "system_shm", "cuda_shm")  # voxserve_input_bytes' paths (codec.InferInput.path)


class ModelSeries(NamedTuple):
    """The one-model series of the metrics each request or execution updates."""

    request_duration: Histogram
    queue_duration: Histogram
    compute_duration: Histogram
    batch_size: Histogram
    samples: Counter
    input_bytes: dict[str, Counter]  # by path (INPUT_PATHS)
    inflight: Gauge


class Metrics:
    def __init__(self, model: str, latency_buckets_s: Sequence[float] = LATENCY_BUCKETS_S,
                 gpu_metrics: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        r = self.registry
        self.requests = Counter("voxserve_requests", "Inference requests by final gRPC status code.",
                                ["model", "code"], registry=r)
        self.request_duration = Histogram("voxserve_request_duration_seconds",
                                          "Request latency, arrival to response sent.", ["model"],
                                          buckets=latency_buckets_s, registry=r)
        self.queue_duration = Histogram("voxserve_queue_duration_seconds",
                                        "Time a request waited before its execution started.", ["model"],
                                        buckets=latency_buckets_s, registry=r)
        self.compute_duration = Histogram("voxserve_compute_duration_seconds",
                                          "Device time of one executed batch.", ["model"],
                                          buckets=latency_buckets_s, registry=r)
        self.batch_size = Histogram("voxserve_batch_size", "Samples per executed batch.", ["model"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.execution_failures = Counter("voxserve_execution_failures",
                                          "Executions that failed on the device, by reason (out_of_memory, "
                                          "device_error).", ["model", "reason"], registry=r)
        self.samples = Counter("voxserve_samples", "Samples inferred successfully.", ["model"], registry=r)
        self.input_bytes = Counter("voxserve_input_bytes", "Input tensor bytes received, by the path they took: wire "
                                   "(in the request), system_shm (copied from a client's segment), cuda_shm (read "
                                   "where they lie in a client's GPU memory).", ["model", "path"], registry=r)
        # multiprocess_mode: how the supervisor of --replicas combines its replicas' values
        # (server/topology/supervisor.py; ignored in a single process).
        self.inflight = Gauge("voxserve_inflight_requests", "Inference requests being served now.", ["model"],
                              registry=r, multiprocess_mode="livesum")
        self.queue_depth = Gauge("voxserve_queue_depth", "Requests waiting for the runner.", ["model"], registry=r,
                                 multiprocess_mode="livesum")
        self.model_ready = Gauge("voxserve_model_ready", "1 when the model serves requests.", ["model"], registry=r,
                                 multiprocess_mode="livemin")
        self.startup_duration = Gauge("voxserve_startup_duration_seconds",
                                      "Start-up time by phase: weights (read and checked), kernel (fused kernel "
                                      "built or loaded), warmup (models on their devices, checked vs float64).",
                                      ["model", "phase"], registry=r, multiprocess_mode="livemax")
        self.build_info = Gauge("voxserve_build_info", "Constant 1, labelled with version, device and kernel.",
                                ["version", "device", "kernel"], registry=r, multiprocess_mode="livemax")
        for gauge in (self.inflight, self.queue_depth, self.model_ready):
            gauge.labels(model).set(0)
        # The model's series of the per-request metrics, looked up once: labels() takes a lock and builds a key
        # on every call, several times per request.
        self.series = ModelSeries(
            self.request_duration.labels(model), self.queue_duration.labels(model),
            self.compute_duration.labels(model), self.batch_size.labels(model), self.samples.labels(model),
            {path: self.input_bytes.labels(model, path) for path in INPUT_PATHS}, self.inflight.labels(model))
        self._requests_by_code: dict[str, Counter] = {}
        for reason in ("out_of_memory", "device_error"):  # present from the start, so rates and alerts see 0
            self.execution_failures.labels(model, reason)
        self.http_server: MetricsHTTPServer | None = None
        self.gpu_collector = NvmlCollector.create() if gpu_metrics else None
        if self.gpu_collector is not None:
            r.register(self.gpu_collector)

    def count_request(self, code: str, served: bool = True, requests: int = 1) -> None:
        """voxserve_requests{model, code} += ``requests`` (1); ``served=False``: the request named a model (or version)
        not served here, counted as model="unknown" (one label value, however many names clients make up)."""
        key = code if served else "unknown " + code
        series = self._requests_by_code.get(key)
        if series is None:
            series = self._requests_by_code[key] = self.requests.labels(self.model if served else UNKNOWN_MODEL, code)
        series.inc(requests)

    def set_build(self, device: str, kernel: str) -> None:
        self.build_info.labels(__version__, device, kernel).set(1)

    def serve_http(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP (serve_metrics_http) on daemon threads; return the bound port."""
        self.http_server = serve_metrics_http(self.registry, host, port)
        return self.http_server.port

    def stop_http(self) -> None:
        """Stop serving /metrics and free its port (no-op when serve_http was not called)."""
        server, self.http_server = self.http_server, None
        if server is not None:
            server.close()


# /metrics is for a few scrapers, not for the public: each connection gets a thread, so at most this many are
# served at once and each has this long in all, from accept to the last byte of its answer (a scrape of our
# few kilobytes takes milliseconds; Prometheus's default scrape timeout is 10 s). When all are taken, a new
# connection takes the place of the oldest one that has not yet sent its whole request (a scraper sends its
# request at once; one that trickles bytes is ended), so half-sent connections cannot keep scrapes out.
HTTP_MAX_CONNECTIONS = 8
HTTP_CONNECTION_TIMEOUT_S = 5.0
# What a connection beyond HTTP_MAX_CONNECTIONS gets, written without blocking before it is closed.
_BUSY_BODY = b"metrics server busy: too many open connections\n"
_BUSY_RESPONSE = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class _DeadlineSocketIO(io.RawIOBase):
    """A connection's reads and writes, each given what is left of one deadline as its socket timeout, so a
    client that sends or reads a byte at a time still loses the connection at the deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("metrics connection deadline passed")
        self._sock.settimeout(left)

    def readinto(self, buffer) -> int:
        self._arm()
        return self._sock.recv_into(buffer)

    def write(self, data) -> int:
        self._arm()
        self._sock.sendall(data)
        return len(data)


class _ErrorLog(io.TextIOBase):
    """A request's WSGI error stream (a collector that raised, a reply cut off), into this module's log."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._parts.append(text)
        return len(text)

    def flush(self) -> None:
        text = "".join(self._parts).rstrip()
        self._parts.clear()
        if text:
            log.error("metrics request failed: %s", text)


class _MetricsRequestHandler(WSGIRequestHandler):
    """wsgiref's handler (one request per connection) under the server's deadline, logging nothing per request."""

    server: MetricsHTTPServer

    def parse_request(self) -> bool:
        # The request is all in: from here on the connection is being answered, and no newcomer may take its place.
        return super().parse_request() and self.server.request_read(self.connection)

    def setup(self) -> None:
        super().setup()
        raw = _DeadlineSocketIO(self.connection, time.monotonic() + self.server.timeout_s)
        self.rfile = io.BufferedReader(raw)
        self.wfile = raw  # type: ignore[assignment]  # a raw, unbuffered writer: what wsgiref needs of it

    def log_message(self, format, *args) -> None:
        pass

    def get_stderr(self) -> _ErrorLog:
        return _ErrorLog()


class MetricsHTTPServer(WSGIServer):
    """prometheus_client's WSGI app (content negotiation, gzip, ``name[]`` filters) behind a server that
    bounds what clients can hold: ``max_connections`` places, each a daemon thread, each connection served
    within ``timeout_s``. A connection beyond them takes the place of the oldest one still sending its request,
    which is answered 503 and closed, and is served next by that place's thread; with no such connection, it
    is answered 503 at once and closed."""

    request_queue_size = 256  # a burst of connections waits in the kernel's queue, not in SYN retries

    def __init__(self, registry: Collector, host: str, port: int, timeout_s: float, max_connections: int) -> None:
        self.address_family, bare = bind_address(host)
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._reading: dict[socket.socket, None] = {}  # connections with a place, still sending, oldest first
        self._next: dict[socket.socket, tuple[socket.socket, object]] = {}  # who takes an ended one's place
        super().__init__((bare, port), _MetricsRequestHandler)
        self.set_app(make_wsgi_app(registry))
        self.port = int(self.server_address[1])
        self._thread = threading.Thread(target=self.serve_forever, name="voxserve-metrics-http", daemon=True)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._take_a_place(request, client_address)
            return
        with self._lock:
            self._reading[request] = None
        try:
            threading.Thread(target=self._serve_place, args=(request, client_address), name="voxserve-metrics-conn",
                             daemon=True).start()
        except BaseException:
            with self._lock:
                self._reading.pop(request, None)
            self._slots.release()
            self.shutdown_request(request)
            raise

    def _take_a_place(self, request: socket.socket, client_address) -> None:
        with self._lock:
            oldest = next(iter(self._reading), None)
            if oldest is not None:
                del self._reading[oldest]
                self._next[oldest] = (request, client_address)
                self._reading[request] = None
        if oldest is None:
            self._refuse(request)
            return
        with contextlib.suppress(OSError):
            oldest.send(_BUSY_RESPONSE, socket.MSG_DONTWAIT)
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once; it goes on to the newcomer

    def request_read(self, request: socket.socket) -> bool:
        """Mark ``request`` as being answered; False if its place went to a newcomer meanwhile."""
        with self._lock:
            return self._reading.pop(request, False) is None

    def _serve_place(self, request, client_address) -> None:
        """Serve the connection, then each one that took the place of the one before it."""
        while True:
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            with self._lock:
                self._reading.pop(request, None)
                successor = self._next.pop(request, None)
            if successor is None:
                # Released before the close, so a client that has seen the close can connect again and be served.
                self._slots.release()
                self.shutdown_request(request)
                return
            self.shutdown_request(request)
            request, client_address = successor

    def _refuse(self, request: socket.socket) -> None:
        request.setblocking(False)  # the accepting thread must never wait on a client
        try:
            request.send(_BUSY_RESPONSE)
            request.recv(65536)  # what the client has sent already: left unread, the close would reset the 503
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics connection from %s failed", client_address, exc_info=True)

    def start(self) -> None:
        """Serve on a daemon thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and free the port; connections being served finish within their timeout."""
        if self._thread.is_alive():
            self.shutdown()
        self.server_close()


def serve_metrics_http(registry: Collector, host: str, port: int, timeout_s: float = HTTP_CONNECTION_TIMEOUT_S,
                       max_connections: int = HTTP_MAX_CONNECTIONS) -> MetricsHTTPServer:
    """Serve ``registry`` at /metrics on host:port (0: a free port, then ``.port``) until ``.close()``."""
    server = MetricsHTTPServer(registry, host, port, timeout_s, max_connections)
    server.start()
    return server
