"""--tracing: the spans of inference requests over real gRPC (the SDK's in-memory exporter, through the server's
seam), the caller's traceparent continued, errors marked; off, no OpenTelemetry at all; and the real OTLP
exporter, configured by OTEL_* alone, from a front end of `voxserve serve --frontends 1` to a collector here."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from voxserve.client import Client, build_request
from voxserve.proto import pb_grpc
from voxserve.server import tracing
from voxserve.server.app import VoxServer
from voxserve.server.settings import Settings

from ..conftest import REPO, ServerThread, serve_process
from .test_lifecycle import _wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
GUARD_S = 120


class TracedServer(ServerThread):
    def __init__(self, settings: Settings, exporter: InMemorySpanExporter) -> None:
        self.exporter = exporter
        super().__init__(settings)

    async def _make(self) -> VoxServer:
        return VoxServer(self.settings, span_exporter=self.exporter)

    def spans(self) -> list[ReadableSpan]:
        """What was exported so far, then forgotten."""
        assert self.server.tracer is not None and self.server.tracer.force_flush(10)
        spans = list(self.exporter.get_finished_spans())
        self.exporter.clear()
        return spans


@pytest.fixture(scope="module")
def traced() -> Iterator[TracedServer]:
    settings = Settings(host="127.0.0.1", grpc_port=0, http_port=0, metrics_port=-1, device="cpu", tracing=True)
    srv = TracedServer(settings, InMemorySpanExporter())
    try:
        assert srv.wait_ready(), srv.server.load_error
        srv.spans()  # none from the warm-up, but be sure
        yield srv
    finally:
        srv.stop()


def _x(n: int = 2) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, 3, 4, 5, 6), dtype=np.float32)


def _requests(spans: list[ReadableSpan]) -> list[ReadableSpan]:
    return [s for s in spans if s.kind == SpanKind.SERVER]


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
                  key=lambda s: s.start_time or 0)


def test_a_request_continues_the_callers_trace_with_its_four_stages(traced):
    with grpc.insecure_channel(traced.url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        stub.ModelInfer(build_request(_x(3), "voxnet", "FP32", request_id="req-7"), timeout=30,
                        metadata=[("traceparent", TRACEPARENT), ("tracestate", "vendor=1")])
    spans = traced.spans()
    [request] = _requests(spans)
    assert request.name == "ModelInfer"
    assert request.context.trace_id == int(TRACE_ID, 16)
    assert request.parent is not None and request.parent.span_id == int(PARENT_ID, 16) and request.parent.is_remote
    assert request.context.trace_state.get("vendor") == "1"
    assert request.status.status_code == StatusCode.UNSET
    attributes = dict(request.attributes or {})
    assert attributes == {**attributes, tracing.TRANSPORT: "grpc", tracing.RPC_SYSTEM: "grpc",
                          tracing.RPC_METHOD: "ModelInfer", tracing.RPC_GRPC_STATUS_CODE: 0,
                          tracing.MODEL_NAME: "voxnet", tracing.MODEL_VERSION: "1", tracing.REQUEST_ID: "req-7",
                          tracing.BATCH_SIZE: 3, tracing.DATATYPE: "FP32", tracing.INPUT_BYTES: _x(3).nbytes,
                          tracing.STATUS_CODE: "OK"}
    assert attributes[tracing.EXECUTION_SAMPLES] >= 3
    assert request.resource.attributes["service.name"] == "voxserve"
    children = _children(spans, request)
    assert [c.name for c in children] == list(tracing.STAGES)
    assert len(spans) == 1 + len(tracing.STAGES)  # nothing else
    # Each stage within the request, each after the one before, none of negative length.
    assert request.start_time is not None and request.end_time is not None
    bound = request.start_time
    for child in children:
        assert child.start_time is not None and child.end_time is not None
        assert child.context.trace_id == request.context.trace_id
        assert bound <= child.start_time <= child.end_time <= request.end_time, child.name
        bound = child.end_time
    # The execution did take time (the CPU model on 3 samples): the children are not all squeezed to a point.
    assert children[2].end_time > children[2].start_time


def _rest_infer(srv, body: bytes, headers: dict[str, str]) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{srv.server.http_port}/v2/models/voxnet/infer", data=body,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_rest_request_continues_the_callers_trace_from_its_headers(traced):
    x = _x(2)
    body = json.dumps({"id": "rest-1", "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                                   "data": x.ravel().tolist()}]}).encode()
    assert _rest_infer(traced, body, {"traceparent": TRACEPARENT}) == 200
    assert _rest_infer(traced, b"{not json", {"traceparent": TRACEPARENT}) == 400
    spans = traced.spans()
    ok, bad = sorted(_requests(spans), key=lambda s: s.start_time or 0)
    for span in (ok, bad):
        assert span.name == "POST /v2/models/{model}/infer"
        assert span.context.trace_id == int(TRACE_ID, 16) and span.parent is not None
        assert span.parent.span_id == int(PARENT_ID, 16)
        assert dict(span.attributes or {})[tracing.TRANSPORT] == "http"
        assert tracing.RPC_SYSTEM not in (span.attributes or {})
    attributes = dict(ok.attributes or {})
    assert attributes == {**attributes, tracing.HTTP_REQUEST_METHOD: "POST",
                          tracing.HTTP_ROUTE: "/v2/models/{model}/infer", tracing.HTTP_STATUS_CODE: 200,
                          tracing.REQUEST_ID: "rest-1", tracing.BATCH_SIZE: 2, tracing.STATUS_CODE: "OK"}
    assert [c.name for c in _children(spans, ok)] == list(tracing.STAGES)
    assert bad.status.status_code == StatusCode.ERROR and "JSON" in (bad.status.description or "")
    assert dict(bad.attributes or {})[tracing.HTTP_STATUS_CODE] == 400


def test_without_a_traceparent_the_request_starts_a_trace(traced):
    with Client(traced.url) as c:
        c.infer(_x(1))
    [request] = _requests(traced.spans())
    assert request.parent is None and request.context.trace_id != int(TRACE_ID, 16)


def test_a_failed_request_is_an_error_span_with_its_message(traced):
    with grpc.insecure_channel(traced.url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        bad = build_request(_x(1), "voxnet", "FP32")
        bad.inputs[0].shape[1] = 4  # 4 channels claimed, 3 sent
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(bad, timeout=30, metadata=[("traceparent", TRACEPARENT)])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as missing:
            stub.ModelInfer(build_request(_x(1), "other", "FP32"), timeout=30)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    spans = traced.spans()
    invalid, not_found = sorted(_requests(spans), key=lambda s: s.start_time or 0)
    for span, code, grpc_code in ((invalid, "INVALID_ARGUMENT", 3), (not_found, "NOT_FOUND", 5)):
        assert span.status.status_code == StatusCode.ERROR
        assert span.status.description and span.status.description in err.value.details() + missing.value.details()
        assert span.attributes is not None and span.attributes[tracing.STATUS_CODE] == code
        assert span.attributes[tracing.RPC_GRPC_STATUS_CODE] == grpc_code
        # It failed while being received: that stage alone.
        assert [c.name for c in _children(spans, span)] == ["receive"]
    assert invalid.context.trace_id == int(TRACE_ID, 16)
    assert not_found.attributes is not None and not_found.attributes[tracing.MODEL_NAME] == "other"


def test_each_request_of_a_stream_is_a_span_of_the_streams_trace(traced):
    with grpc.insecure_channel(traced.url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        requests = [build_request(_x(1), "voxnet", "FP32", request_id=f"s{i}") for i in range(3)]
        answers = list(stub.ModelStreamInfer(iter(requests), timeout=30, metadata=[("traceparent", TRACEPARENT)]))
    assert [a.error_message for a in answers] == [""] * 3
    spans = traced.spans()
    requests_seen = _requests(spans)
    assert sorted(dict(s.attributes or {})[tracing.REQUEST_ID] for s in requests_seen) == ["s0", "s1", "s2"]
    for span in requests_seen:
        assert span.name == "ModelStreamInfer" and span.context.trace_id == int(TRACE_ID, 16)
        assert [c.name for c in _children(spans, span)] == list(tracing.STAGES)


def test_the_carrier_is_any_headers_or_a_traceparent():
    tracer = tracing.Tracer([], "voxnet")
    for headers in ({"Traceparent": TRACEPARENT}, [("TRACEPARENT", TRACEPARENT)], TRACEPARENT,
                    (("other", "x"), ("traceparent", TRACEPARENT), ("key-bin", b"\x00"))):
        trace = tracer.request("http", "infer", headers)
        parent = trace._parent
        from opentelemetry import trace as otel_trace

        span_context = otel_trace.get_current_span(parent).get_span_context()
        assert span_context.trace_id == int(TRACE_ID, 16) and span_context.is_remote, headers
    # Several tracestate headers are one list.
    carrier = tracing._carrier([("tracestate", "a=1"), ("tracestate", "b=2"), ("traceparent", TRACEPARENT)])
    assert carrier == {"tracestate": "a=1,b=2", "traceparent": TRACEPARENT}
    assert tracing._carrier(None) == {} and tracing._carrier({"traceparent": "garbage"}) == {"traceparent": "garbage"}


def test_the_context_manager_ends_the_span_and_marks_an_exception():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = InMemorySpanExporter()
    tracer = tracing.Tracer([SimpleSpanProcessor(exporter)], "voxnet")
    with tracer.request("http", "infer", {"traceparent": TRACEPARENT}) as trace:
        trace.set(tracing.HTTP_STATUS_CODE, 200)
        trace.stage("execute", 1, 2)
    with pytest.raises(ValueError), tracer.request("http", "infer"):
        raise ValueError("bad body")
    ok, failed = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert ok.status.status_code == StatusCode.UNSET and dict(ok.attributes or {})[tracing.HTTP_STATUS_CODE] == 200
    assert failed.status.status_code == StatusCode.ERROR and failed.status.description == "bad body"
    assert dict(failed.attributes or {})[tracing.STATUS_CODE] == "INTERNAL"
    assert [s.name for s in exporter.get_finished_spans() if s.kind != SpanKind.SERVER] == ["execute"]


def test_off_there_is_no_tracer_and_no_opentelemetry_in_the_process(tmp_path):
    """Tracing off, OpenTelemetry made unimportable: the server starts, answers, and never tried to import it."""
    script = textwrap.dedent("""
        import sys
        sys.modules["opentelemetry"] = None  # any import of it now fails
        import numpy as np
        from tests.conftest import running_server
        from voxserve.client import Client

        with running_server(access_log=True) as srv:
            assert srv.wait_ready(), srv.server.load_error
            assert srv.server.tracer is None and srv.server.service.tracer is None
            with Client(srv.url) as c:
                c.infer(np.zeros((1, 3, 4, 4, 4), np.float32))
                c.infer(np.zeros((1, 3, 4, 4, 4), np.float32))
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry.")))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_tracing_without_opentelemetry_is_a_one_line_start_up_error():
    script = textwrap.dedent("""
        import sys
        sys.modules["opentelemetry"] = None  # as if it were not installed
        from voxserve.cli import main
        sys.exit(main(["serve", "--tracing", "--device", "cpu", "--grpc-port", "0", "--http-port", "-1",
                       "--metrics-port", "-1"]))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=GUARD_S)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "--tracing needs the Python package opentelemetry-api" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


@dataclasses.dataclass
class Collector:
    """An OTLP/gRPC trace collector on a free loopback port, keeping what it is sent."""

    port: int
    received: list[trace_service_pb2.ExportTraceServiceRequest]
    lock: threading.Lock

    def spans(self) -> list[tuple[dict, object]]:
        """(the resource's attributes, the span) of every span received."""
        with self.lock:
            found = []
            for request in self.received:
                for resource_spans in request.resource_spans:
                    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    found += [(resource, span) for scope in resource_spans.scope_spans for span in scope.spans]
            return found


@pytest.fixture
def collector() -> Iterator[Collector]:
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []
    lock = threading.Lock()

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            with lock:
                received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield Collector(port, received, lock)
    finally:
        server.stop(0)


def test_otlp_export_from_a_front_end_configured_by_otel_variables(tmp_path, collector, monkeypatch):
    """`voxserve serve --tracing --frontends 1 --access-log --log-format json` with only OTEL_* saying where: the
    front end's spans reach the collector by the drain at the latest, and its access log is JSON (written under
    --log-level WARNING too)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "voxserve-under-test")
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    with serve_process(tmp_path / "log", "--device", "cpu", "--tracing", "--frontends", "1", "--access-log",
                       "--log-format", "json", "--log-level", "WARNING") as srv:
        with Client(srv.url, timeout_s=5) as c:
            _wait_for(c.is_ready, GUARD_S, "the server to be ready")
        with grpc.insecure_channel(srv.url) as ch:
            pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(
                build_request(_x(2), "voxnet", "FP32", request_id="otlp-1"), timeout=30,
                metadata=[("traceparent", TRACEPARENT)])
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(GUARD_S) == 0
    spans = collector.spans()
    requests = [(resource, s) for resource, s in spans if s.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    assert len(requests) == 1, [s.name for _, s in spans]
    resource, request = requests[0]
    assert resource["service.name"] == "voxserve-under-test"
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    children = sorted((s for _, s in spans if s.parent_span_id == request.span_id),
                      key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in children] == list(tracing.STAGES)
    # The access record, as one JSON object among the server's lines.
    records = [json.loads(line) for line in srv.log.splitlines() if line.startswith("{")]
    [access] = [r for r in records if r["logger"] == "voxserve.access"]
    assert access["method"] == "ModelInfer" and access["code"] == "OK" and access["request_id"] == "otlp-1"
    assert access["transport"] == "grpc" and access["samples"] == 2 and access["peer"].startswith("ipv4:127.0.0.1:")


def test_the_stages_of_a_request_from_its_stamps():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = InMemorySpanExporter()
    tracer = tracing.Tracer([SimpleSpanProcessor(exporter)], "voxnet")

    def stages(*stamps) -> list[tuple[str, int, int]]:
        exporter.clear()
        trace = tracer.request("http", "infer", start_ns=10)
        trace.stages(*stamps)
        trace.finish(end_ns=100)
        spans = [s for s in exporter.get_finished_spans() if s.kind != SpanKind.SERVER]
        [request] = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
        assert request.start_time is not None
        return [(s.name, (s.start_time or 0) - request.start_time + 10, (s.end_time or 0) - request.start_time + 10)
                for s in spans]

    assert stages(10, 20, 80, 100, 15) == [("receive", 10, 20), ("queue", 20, 35), ("execute", 35, 80),
                                           ("respond", 80, 100)]
    # A queue time longer than the whole wait (timed in an engine, on another clock's account) stays inside it.
    assert stages(10, 20, 80, 100, 500)[1:3] == [("queue", 20, 80), ("execute", 80, 80)]
    assert stages(10, 0, 0, 100, None) == [("receive", 10, 100)]  # refused while being received
    assert stages(10, 20, 0, 100, None) == [("receive", 10, 20)]  # the runner failed it


def test_the_exporter_is_chosen_by_the_otel_variables(monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from voxserve.server.core.errors import StartupError

    for variable in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(variable, raising=False)
    assert tracing.check_available() == [OTLPSpanExporter]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,otlp")
    assert tracing.check_available() == [ConsoleSpanExporter, OTLPSpanExporter]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(StartupError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        tracing.check_available()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(StartupError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        tracing.check_available()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.check_available() == []
    assert tracing.open_tracer(Settings(tracing=True)) is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.open_tracer(Settings(tracing=True)) is None
