"""Every Prometheus metric the server exports, defined in one place; other modules only observe them.

Names are part of the product (base units, ``_total``, ``_seconds``, ``_bytes``).
Each server owns its registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from voxserve import __version__

# Sub-millisecond GPU executions up to multi-second CPU batches.
LATENCY_BUCKETS_S: Sequence[float] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS: Sequence[float] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self, model: str, latency_buckets_s: Sequence[float] = LATENCY_BUCKETS_S) -> None:
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
        self.samples = Counter("voxserve_samples", "Samples inferred successfully.", ["model"], registry=r)
        self.input_bytes = Counter("voxserve_input_bytes", "Input tensor bytes received.", ["model"], registry=r)
        self.inflight = Gauge("voxserve_inflight_requests", "Inference requests being served now.", ["model"],
                              registry=r)
        self.queue_depth = Gauge("voxserve_queue_depth", "Requests waiting for the runner.", ["model"], registry=r)
        self.model_ready = Gauge("voxserve_model_ready", "1 when the model serves requests.", ["model"], registry=r)
        self.build_info = Gauge("voxserve_build_info", "Constant 1, labelled with version, device and kernel.",
                                ["version", "device", "kernel"], registry=r)
        for gauge in (self.inflight, self.queue_depth, self.model_ready):
            gauge.labels(model).set(0)

    def set_build(self, device: str, kernel: str) -> None:
        self.build_info.labels(__version__, device, kernel).set(1)

    def serve_http(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP on a daemon thread; return the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
