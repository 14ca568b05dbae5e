"""OpenTelemetry traces of inference requests: off by default, on with ``--tracing``; no transport types here.

Each inference request becomes a server span (``ModelInfer``, ``ModelStreamInfer``, or whatever name the REST
front end gives its route) with four children when they happened: ``receive`` (decode and validate), ``queue``
(waiting in the dynamic batcher), ``execute`` (from leaving the queue until the result is back in the receiving
process) and ``respond`` (check and encode the answer). The spans are made in the process that received the
request, once it has ended, from the ``time.perf_counter_ns()`` stamps taken on its way: the hot path holds no
span while it runs, and with ``--frontends`` the queue and execute times come back from the engine in the
result (``BatchResult.queue_ns``), so the engines need no tracing of their own. The caller's W3C
``traceparent``/``tracestate`` (gRPC metadata or HTTP headers) make the request span a child of the caller's.

Export is configured by the standard variables. Which exporter, this module chooses by the SDK's rules (as
opentelemetry-instrument does): OTEL_TRACES_EXPORTER (otlp by default; otlp_proto_grpc, otlp_proto_http,
console, none) and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL (grpc by default;
http/protobuf with opentelemetry-exporter-otlp-proto-http installed). The rest the SDK and the exporter read
themselves: OTEL_EXPORTER_OTLP_ENDPOINT and the rest of OTEL_EXPORTER_OTLP_*, OTEL_SERVICE_NAME (default here:
voxserve), OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER and its argument, OTEL_BSP_* (the batch span
processor); OTEL_SDK_DISABLED=true turns tracing off again.

Free when off: with ``--tracing`` off :func:`open_tracer` returns None, this module imports no OpenTelemetry at
all, and a transport checks ``tracer is not None`` once per request. The API, the same for both transports::

    tracer = open_tracer(settings)  # once per process, at start-up: None unless --tracing
    ...                             # per request, once it has ended:
    if tracer is not None:
        trace = tracer.request("http", "POST /v2/models/{model}/infer", request.headers, arrived_ns,
                               {MODEL_NAME: "voxnet", BATCH_SIZE: 2})
        trace.stages(arrived_ns, decoded_ns, returned_ns, ended_ns, result.queue_ns)  # the four STAGES
        trace.finish("OK", end_ns=ended_ns)  # or trace.finish("INVALID_ARGUMENT", "input 'INPUT0' ...", ended_ns)

or as a context manager around the request (an exception leaving it ends the span ERROR)::

    with tracer.request("http", "infer", request.headers) as trace:
        ...
        trace.stage("execute", t0, t1)

``tracer.shutdown()`` (the drain) exports what is still buffered.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .core.errors import StartupError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from .settings import Settings

log = logging.getLogger(__name__)

STAGES = ("receive", "queue", "execute", "respond")
INSTRUMENTATION = "voxserve.server"
DEFAULT_SERVICE_NAME = "voxserve"
# Span attributes: OpenTelemetry's semantic conventions where they have a name for it, voxserve.* for the rest.
RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
HTTP_STATUS_CODE = "http.response.status_code"
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
CLIENT_ADDRESS = "client.address"
TRANSPORT = "voxserve.transport"  # grpc or http
MODEL_NAME = "voxserve.model.name"
MODEL_VERSION = "voxserve.model.version"
REQUEST_ID = "voxserve.request.id"
BATCH_SIZE = "voxserve.request.samples"  # N of the request's (N, Cin, D, H, W) input
DATATYPE = "voxserve.request.datatype"
INPUT_BYTES = "voxserve.request.input_bytes"
EXECUTION_SAMPLES = "voxserve.execution.samples"  # of the (largest) batch the request ran in
STATUS_CODE = "voxserve.status_code"  # the protocol's status name: OK, INVALID_ARGUMENT, ...

# OTEL_EXPORTER_OTLP_PROTOCOL's values and the SDK's name of the exporter for each (as opentelemetry-instrument
# maps them).
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
EXPORTERS = ("otlp", "otlp_proto_grpc", "otlp_proto_http", "console", "none")
_INSTALL = "pip install 'voxserve[tracing]'"
AttributeValue = str | bool | int | float


def _missing(package: str, exc: BaseException) -> StartupError:
    return StartupError(f"--tracing needs the Python package {package} ({_INSTALL}): {exc}")


def exporter_names() -> list[str]:
    """The span exporters OTEL_TRACES_EXPORTER (comma-separated, default otlp) and, for otlp,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL ask for, by the SDK's names for them
    (otlp_proto_grpc, otlp_proto_http, console); empty for none. StartupError naming the variable for a value
    not among EXPORTERS or the OTLP protocols."""
    from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
    from opentelemetry.sdk import environment_variables as env

    names = [n.strip() for n in os.environ.get(OTEL_TRACES_EXPORTER, "otlp").split(",") if n.strip()]
    protocol = (os.environ.get(env.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or
                os.environ.get(env.OTEL_EXPORTER_OTLP_PROTOCOL) or "grpc").strip()
    resolved = []
    for name in names:
        if name not in EXPORTERS:
            raise StartupError(f"--tracing: OTEL_TRACES_EXPORTER={name!r} is not one of {', '.join(EXPORTERS)}")
        if name == "none":
            return []
        if name == "otlp":
            if protocol not in _OTLP_BY_PROTOCOL:
                raise StartupError(f"--tracing: OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not one of "
                                   f"{', '.join(_OTLP_BY_PROTOCOL)}")
            name = _OTLP_BY_PROTOCOL[protocol]
        resolved.append(name)
    return resolved


def _exporter_class(name: str) -> type[SpanExporter]:
    """The class of the span exporter the SDK calls ``name`` (imported here by name, not looked up: nothing is
    loaded that this module does not name)."""
    if name == "otlp_proto_grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise _missing("opentelemetry-exporter-otlp-proto-grpc", exc) from None
        return OTLPSpanExporter
    if name == "otlp_proto_http":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as OTLPHttpSpanExporter
        except ImportError as exc:
            raise _missing("opentelemetry-exporter-otlp-proto-http (for OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf)",
                           exc) from None
        return OTLPHttpSpanExporter
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter


def check_available() -> list[type[SpanExporter]]:
    """The span exporter classes the environment asks for; StartupError naming the missing package (or the
    variable with a value it cannot have) when --tracing cannot work. Imports OpenTelemetry."""
    try:
        import opentelemetry.trace  # only whether it is there
    except ImportError as exc:
        raise _missing("opentelemetry-api", exc) from None
    try:
        import opentelemetry.sdk.trace  # noqa: F401 - only whether it is there
    except ImportError as exc:
        raise _missing("opentelemetry-sdk", exc) from None
    return [_exporter_class(name) for name in exporter_names()]


def open_tracer(settings: Settings, exporter: SpanExporter | None = None) -> Tracer | None:
    """The process's tracer: None unless ``settings.tracing`` (nothing of OpenTelemetry is imported then) or when
    OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none. ``exporter``: export to it instead of what the
    environment asks for (the tests' InMemorySpanExporter)."""
    if not settings.tracing:
        return None
    exporter_classes = check_available() if exporter is None else []
    from opentelemetry.sdk import environment_variables as env
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if os.environ.get(env.OTEL_SDK_DISABLED, "").strip().lower() == "true":
        log.info("--tracing: off, OTEL_SDK_DISABLED=true")
        return None
    exporters = [cls() for cls in exporter_classes] if exporter is None else [exporter]
    if not exporters:
        log.info("--tracing: off, OTEL_TRACES_EXPORTER=none")
        return None
    tracer = Tracer([BatchSpanProcessor(e) for e in exporters], settings.model_name)
    log.info("tracing: OpenTelemetry spans to %s (service %s)", ", ".join(type(e).__name__ for e in exporters),
             tracer.service_name)
    return tracer


def _carrier(headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | str | None) -> dict[str, str]:
    """The W3C trace-context headers among ``headers`` (a mapping, (key, value) pairs such as gRPC metadata, or a
    traceparent string), keys lower-cased: HTTP's header names are case-insensitive."""
    if headers is None:
        return {}
    if isinstance(headers, str):
        return {"traceparent": headers}
    found: dict[str, str] = {}
    for key, value in (headers.items() if isinstance(headers, Mapping) else headers):
        name = key.lower()
        if name in ("traceparent", "tracestate") and isinstance(value, str):
            # Several tracestate headers make one list (W3C trace context, section 3.3.1).
            found[name] = f"{found[name]},{value}" if name == "tracestate" and name in found else value
    return found


class Tracer:
    """Makes the spans of requests (see the module's docstring), exporting them through ``processors``."""

    def __init__(self, processors: list, model_name: str = "") -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from .. import __version__

        resource = Resource.create({"service.version": __version__})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            # Neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES named the service.
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        self.service_name = str(resource.attributes[SERVICE_NAME])
        # The sampler (OTEL_TRACES_SAMPLER) is the SDK's default, read by the provider itself.
        self.provider = TracerProvider(resource=resource)
        for processor in processors:
            self.provider.add_span_processor(processor)
        self._otel = self.provider.get_tracer(INSTRUMENTATION, __version__)
        self._propagator = TraceContextTextMapPropagator()
        self._set_span_in_context = trace.set_span_in_context
        self._server = trace.SpanKind.SERVER
        self._error = trace.StatusCode.ERROR
        self._status = trace.Status
        self.model_name = model_name

    def request(self, transport: str, name: str,
                headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | str | None = None,
                start_ns: int | None = None, attributes: Mapping[str, AttributeValue] | None = None) -> RequestTrace:
        """A request received over ``transport`` (grpc, http) as ``name`` (its span's name), continuing the trace
        of ``headers``' traceparent/tracestate if they have one; ``start_ns``: when it arrived (perf_counter_ns;
        default now). Nothing is exported until its ``finish()``."""
        parent = self._propagator.extract(_carrier(headers))
        return RequestTrace(self, parent, name, time.perf_counter_ns() if start_ns is None else start_ns,
                            {TRANSPORT: transport, **(attributes or {})})

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export every span ended so far; False if that did not finish within ``timeout_s``."""
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Export what is buffered and stop (the drain); blocks while the exporter sends."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans in the making: its stages and attributes are collected, and ``finish()`` makes them
    all at once with the times recorded."""

    __slots__ = ("_attributes", "_name", "_parent", "_stages", "_start_ns", "_tracer", "finished")

    def __init__(self, tracer: Tracer, parent: Any, name: str, start_ns: int,
                 attributes: dict[str, AttributeValue]) -> None:
        self._tracer = tracer
        self._parent = parent
        self._name = name
        self._start_ns = start_ns
        self._attributes = attributes
        self._stages: list[tuple[str, int, int]] = []
        self.finished = False

    def set(self, key: str, value: AttributeValue) -> None:
        """An attribute of the request's span (see the names at the top of this module)."""
        self._attributes[key] = value

    def stage(self, name: str, start_ns: int, end_ns: int) -> None:
        """A child span ``name`` (one of STAGES, or any other) from ``start_ns`` to ``end_ns``
        (perf_counter_ns)."""
        self._stages.append((name, start_ns, end_ns))

    def stages(self, arrived_ns: int, decoded_ns: int, returned_ns: int, ended_ns: int,
               queue_ns: int | None) -> None:
        """The four STAGES of an inference request from its stamps (perf_counter_ns; 0: it did not get that far):
        arrived, decoded (and handed to the runner), its result back, ended; ``queue_ns``: the runner's
        ``BatchResult.queue_ns`` (None without a result). Its wait in the batcher is timed where it happens (with
        --frontends: in the engine), so it is placed from when the request was handed on, and the rest until the
        result came back is ``execute``."""
        self.stage("receive", arrived_ns, decoded_ns or ended_ns)
        if queue_ns is not None and decoded_ns and returned_ns:
            queued = min(decoded_ns + queue_ns, returned_ns)
            self.stage("queue", decoded_ns, queued)
            self.stage("execute", queued, returned_ns)
        if returned_ns:
            self.stage("respond", returned_ns, ended_ns)

    def finish(self, code: str = "OK", error: str | None = None, end_ns: int | None = None) -> None:
        """Make and export the request's spans: it ended with the protocol's ``code`` (OK, INVALID_ARGUMENT, ...)
        at ``end_ns`` (default now); any code but OK sets the span's status to ERROR with ``error`` (default: the
        code). Once only."""
        if self.finished:
            return
        self.finished = True
        tracer = self._tracer
        # perf_counter_ns is the clock the stamps were taken with; spans want the time since the epoch.
        offset = time.time_ns() - time.perf_counter_ns()
        end_ns = time.perf_counter_ns() if end_ns is None else end_ns
        self._attributes[STATUS_CODE] = code
        span = tracer._otel.start_span(self._name, context=self._parent, kind=tracer._server,
                                       attributes=self._attributes, start_time=self._start_ns + offset)
        if span.is_recording():  # not when the sampler dropped the trace
            context = tracer._set_span_in_context(span)
            for stage, start, end in self._stages:
                child = tracer._otel.start_span(stage, context=context, start_time=start + offset)
                child.end(end_time=end + offset)
            if code != "OK":
                span.set_status(tracer._status(tracer._error, error or code))
        span.end(end_time=end_ns + offset)

    def __enter__(self) -> RequestTrace:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.finish()
        else:
            self.finish(getattr(getattr(exc, "code", None), "name", "INTERNAL"), str(exc) or exc_type.__name__)
