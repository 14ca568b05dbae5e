"""Every Prometheus metric the server exports, defined in one place; other modules only observe them.

Names are part of the product (base units, ``_total``, ``_seconds``, ``_bytes``).
Each server owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from voxserve import __version__

log = logging.getLogger(__name__)

# Sub-millisecond GPU executions up to multi-second CPU batches.
LATENCY_BUCKETS_S: Sequence[float] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS: Sequence[float] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


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


class ModelSeries(NamedTuple):
    """The one-model series of the metrics each request or execution updates."""

    request_duration: Histogram
    queue_duration: Histogram
    compute_duration: Histogram
    batch_size: Histogram
    samples: Counter
    input_bytes: Counter
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
        self.input_bytes = Counter("voxserve_input_bytes", "Input tensor bytes received.", ["model"], registry=r)
        # multiprocess_mode: how the supervisor of --replicas combines its replicas' values (server/replicas.py;
        # ignored in a single process).
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
        self.series = ModelSeries(*(metric.labels(model) for metric in (
            self.request_duration, self.queue_duration, self.compute_duration, self.batch_size, self.samples,
            self.input_bytes, self.inflight)))
        self._requests_by_code: dict[str, object] = {}
        for reason in ("out_of_memory", "device_error"):  # present from the start, so rates and alerts see 0
            self.execution_failures.labels(model, reason)
        self.gpu_collector = NvmlCollector.create() if gpu_metrics else None
        if self.gpu_collector is not None:
            r.register(self.gpu_collector)

    def count_request(self, code: str) -> None:
        """voxserve_requests{model, code} += 1."""
        series = self._requests_by_code.get(code)
        if series is None:
            series = self._requests_by_code[code] = self.requests.labels(self.model, code)
        series.inc()

    def set_build(self, device: str, kernel: str) -> None:
        self.build_info.labels(__version__, device, kernel).set(1)

    def serve_http(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP on a daemon thread; return the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
