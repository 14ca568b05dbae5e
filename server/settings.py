"""One settings object for the server, built once from flags and VOXSERVE_* environment variables."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MiB = 1024 * 1024
AUTO = "auto"


def frontends_count(text: str) -> int | str:
    """--frontends: a number of front-end processes, or 'auto' (server/topology/supervisor.py: resolve_frontends)."""
    text = str(text).strip()
    return AUTO if text.lower() == AUTO else int(text)


def option(default: Any, help_text: str, *, parse: Callable[[str], Any] | None = None,
           check: tuple[Callable[[Any], bool], str] | None = None) -> Any:
    """A setting: its default, its --help text, how its flag's text is parsed (default: by the field's type)
    and the rule its value must keep (a predicate and the rule in words, for the error). The flag is the
    field's name with dashes (``--max-batch``), the environment twin VOXSERVE_ and the name upper-cased."""
    return dataclasses.field(default=default, metadata={"help": help_text, "parse": parse, "check": check})


@dataclass(frozen=True)
class Settings:
    """Everything the server is configured by. Each field has a flag and an environment twin."""

    weights: str | None = option(
        None,
        "safetensors file with conv.weight (Cout, Cin, k, k, k) and conv.bias (Cout); default: the reference "
        "instance's deterministic weights (Cin=3, Cout=16, k=3)")
    host: str = option(
        "0.0.0.0",
        "address to listen on")
    grpc_port: int = option(
        8001,
        "gRPC port (Open Inference Protocol, health, reflection); 0 picks a free port",
        check=(lambda v: 0 <= v <= 65535, "must be 0..65535"))
    http_port: int = option(
        8000,
        "REST port (the Open Inference Protocol's HTTP/REST form with Triton's binary-tensor extension: "
        "tritonclient.http, curl); 0 picks a free port, -1 disables",
        check=(lambda v: -1 <= v <= 65535, "must be -1..65535"))
    metrics_port: int = option(
        8002,
        "Prometheus metrics port (HTTP /metrics); 0 picks a free one, -1 disables",
        check=(lambda v: -1 <= v <= 65535, "must be -1..65535"))
    device: str = option(
        "auto",
        "auto (the first GPU if one is usable, else the CPU), cpu, cuda or cuda:N",
        check=(lambda v: v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()),
               "must be auto, cpu, cuda or cuda:N"))
    devices: str = option(
        "",
        "serve on several GPUs: 'all' or indices like '0,1' (one runner each, batches go to the least busy); "
        "overrides --device",
        check=(lambda v: v in ("", "all") or all(p.isdigit() for p in v.split(",")),
               "must be 'all' or comma-separated GPU indices like 0,1"))
    precision: str = option(
        "fp32",
        "fp32 (results within 1e-5 of float64) or tf32 (on a GPU the tensor-core kernel multiplies in TF32: faster, "
        "relative error within 5e-3; the CPU path stays float32)",
        check=(lambda v: v in ("fp32", "tf32"), "must be fp32 or tf32"))
    model_name: str = option(
        "voxnet",
        "the model's name in the protocol and in metric labels",
        check=(lambda v: bool(v) and v.replace("_", "").replace("-", "").replace(".", "").isalnum(),
               "must be letters, digits, '_', '-' or '.'"))
    model_version: str = option(
        "1",
        "the model's version string")
    max_message_bytes: int = option(
        128 * MiB,
        "largest gRPC message accepted or sent; larger ones get RESOURCE_EXHAUSTED (default: 5 reference batches)",
        check=(lambda v: 1024 <= v <= 2**31 - 1, "must be between 1 KiB and 2 GiB - 1 (gRPC's limit)"))
    max_batch: int = option(
        128,
        "most samples in one execution: the dynamic batcher merges up to this many, larger requests run in pieces",
        check=(lambda v: v >= 1, "must be >= 1"))
    batching: bool = option(
        True,
        "merge concurrent requests of equal sample shape and datatype into one execution (--no-batching: never)")
    max_queue_delay_ms: float = option(
        0.0,
        "how long the batcher may hold a request waiting for more to fill a batch (0: batch only what queued up "
        "while the device was busy)",
        check=(lambda v: v >= 0, "must be >= 0"))
    max_queue_size: int = option(
        512,
        "most requests waiting for execution; further ones get UNAVAILABLE at once",
        check=(lambda v: v >= 1, "must be >= 1"))
    max_shm_regions: int = option(
        64,
        "most system shared-memory regions registered at once",
        check=(lambda v: v >= 0, "must be >= 0"))
    max_shm_bytes: int = option(
        8 * 1024 * MiB,
        "most bytes of shared memory registered across all regions; on a GPU server also the most bytes of clients' "
        "segments page-locked for the GPU to read inputs in place (with those of unregistered regions still read)",
        check=(lambda v: v >= 0, "must be >= 0"))
    max_cuda_shm_regions: int = option(
        64,
        "most CUDA shared-memory regions registered at once (each maps a client's device memory into the server "
        "until it is unregistered; a region unregistered while requests use it is closed when they finish)",
        check=(lambda v: v >= 0, "must be >= 0"))
    max_request_samples: int = option(
        1024,
        "most samples one request may carry (RESOURCE_EXHAUSTED above it)",
        check=(lambda v: v >= 1, "must be >= 1"))
    max_request_voxels: int = option(
        1 << 25,
        "most input voxels (N x D x H x W) one request may carry, over the wire or in shared memory "
        "(RESOURCE_EXHAUSTED above it; default: 16 reference batches)",
        check=(lambda v: v >= 1, "must be >= 1"))
    max_concurrent_rpcs: int = option(
        256,
        "most RPCs served at once, over all connections (authenticated ones: a refused token holds no slot); further "
        "ones are refused with RESOURCE_EXHAUSTED, or take the slot of an idle stream or of a request still arriving "
        "slowly, which then ends UNAVAILABLE (the README's 'Connections and streams'). With --frontends N each front "
        "end applies it to the connections it terminates (the kernel spreads them), so the server serves up to N "
        "times this many",
        check=(lambda v: v >= 1, "must be >= 1"))
    max_streams_per_connection: int = option(
        64,
        "most RPCs one connection may have open at once (HTTP/2 MAX_CONCURRENT_STREAMS: a client's further calls "
        "wait on its side), so that one connection holds at most this share of --max-concurrent-rpcs")
    stream_idle_timeout_s: float = option(
        60.0,
        "a ModelStreamInfer stream with nothing in progress that receives no message for this long, and a "
        "grpc.health.v1 Watch open this long, is closed with UNAVAILABLE (the client opens a new one); 0: never",
        check=(lambda v: v >= 0, "must be >= 0"))
    grpc_compression: bool = option(
        False,
        "accept gzip/deflate-compressed request messages (inflated up to --max-message-bytes); by default they are "
        "refused with UNIMPLEMENTED before any byte is inflated")
    max_shm_inflight_bytes: int = option(
        2 * 1024 * MiB,
        "most bytes of shared-memory inputs copied into the server at once (over all requests in progress); a "
        "request waits for room, one larger than this alone gets RESOURCE_EXHAUSTED",
        check=(lambda v: v >= 1, "must be >= 1"))
    http_timeout_s: float = option(
        30.0,
        "REST connections: a request body that sends nothing for this long is answered 408 (as is one arriving "
        "slower than 1 MB/s beyond it), and a connection with no request in progress for this long (headers never "
        "completed, an idle keep-alive) is closed",
        check=(lambda v: v > 0, "must be > 0"))
    http_max_connections: int = option(
        1024,
        "most REST connections open at once; a further one is answered 503 and closed",
        check=(lambda v: v >= 1, "must be >= 1"))
    max_json_bytes: int = option(
        4 * MiB,
        "largest JSON part of a REST request (413 above it): JSON numbers cost several times their text in memory "
        "and hold the interpreter while parsed; large tensors travel as binary data",
        check=(lambda v: v >= 1024, "must be >= 1024"))
    grace_period_s: float = option(
        30.0,
        "on SIGTERM/SIGINT: how long in-flight requests may take to finish before the server exits",
        check=(lambda v: v >= 0, "must be >= 0"))
    event_loop: str = option(
        "asyncio",
        "event loop of the server's processes: asyncio (the standard one), uvloop (pip install uvloop), or auto "
        "(uvloop when installed)",
        check=(lambda v: v in ("auto", "uvloop", "asyncio"), "must be auto, uvloop or asyncio"))
    log_level: str = option(
        "INFO",
        "DEBUG, INFO, WARNING or ERROR",
        check=(lambda v: v.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "must be DEBUG, INFO, WARNING or ERROR"))
    log_format: str = option(
        "text",
        "text (one line per record) or json (one JSON object per line: time, level, logger, message, pid, and the "
        "request id, model and peer where a record has them)",
        check=(lambda v: v in ("text", "json"), "must be text or json"))
    access_log: bool = option(
        False,
        "log one record per inference request (logger voxserve.access, written whatever --log-level says): "
        "transport, RPC, status code, duration in ms, model, samples, input bytes, peer and request id; fields of "
        "the JSON object with --log-format json")
    access_log_sample_rate: float = option(
        1.0,
        "with --access-log: the share of successful requests logged, each drawn at random (0.1: one in ten); "
        "failed requests are always logged",
        check=(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    tracing: bool = option(
        False,
        "export OpenTelemetry traces: a server span per inference request with receive, queue, execute and "
        "respond children, continuing the caller's W3C traceparent; the exporter (OTLP over gRPC by default), "
        "endpoint, service name and sampler come from the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT, "
        "OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, ...). Needs pip install "
        "'voxserve[tracing]'")
    # empty: the defaults in server/metrics.py
    latency_buckets_s: str = option(
        "",
        "comma-separated histogram bucket bounds in seconds for the latency metrics (empty: 100 us .. 30 s)")
    tls_cert: str = option(
        "",
        "PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    tls_key: str = option(
        "",
        "PEM private key of --tls-cert")
    tls_client_ca: str = option(
        "",
        "PEM CA bundle: mutual TLS, every client must present a certificate it signed")
    auth_token_file: str = option(
        "",
        "file of accepted bearer tokens, one per line: every RPC must send 'authorization: Bearer <token>' "
        "(UNAUTHENTICATED otherwise)")
    open_health: bool = option(
        False,
        "with --auth-token-file: let liveness/readiness RPCs (grpc.health.v1, ServerLive/Ready, ModelReady) through "
        "without a token, for orchestrator probes")
    # 0: one per GPU of --devices (1 without --devices)
    replicas: int = option(
        0,
        "server processes sharing the gRPC port, replica i on GPU i of --devices (or of the visible GPUs): one "
        "process per GPU scales where one process driving several does not; shared-memory regions, metrics and "
        "statistics are shared. 0: one per GPU of --devices (1 without --devices); 1 with --devices: one process, "
        "one runner per GPU",
        check=(lambda v: 0 <= v <= 64, "must be 0..64 (0: one per GPU of --devices)"))
    # 0: gRPC is served in the model's own process; "auto": sized to the host
    frontends: int | str = option(
        0,
        "gRPC front-end processes sharing the port, in front of engine processes that only batch and execute (one "
        "per replica): small requests then reach the batcher at the rate of N processes instead of one. 0: each "
        "replica terminates its own gRPC; auto: three quarters of the usable CPU cores (affinity and cgroup quota), "
        "at most 16 per GPU replica, when the model runs on a GPU; 0 on the CPU",
        parse=frontends_count,
        check=(lambda v: v == AUTO or (isinstance(v, int) and 0 <= v <= 64), "must be 0..64 or auto"))
    frontend_impl: str = option(
        "python",
        "with --frontends: python (each front end a Python process) or native (each a C++ process that answers plain "
        "ModelInfer requests itself, several times cheaper per request, and hands every other call to a Python "
        "partner process; built on first use with g++ and gRPC's C++ library: server/native/)",
        check=(lambda v: v in ("python", "native"), "must be python or native"))
    frontend_arena_bytes: int = option(
        256 * MiB,
        "with --frontends: each front end's shared staging memory for tensors on their way to an engine (requests "
        "wait for room; larger ones travel in pieces)",
        check=(lambda v: MiB <= v <= 2**40, "must be between 1 MiB and 1 TiB"))


def env_name(field_name: str) -> str:
    return "VOXSERVE_" + field_name.upper()


_PARSERS: dict[str, Callable[[str], Any]] = {"str": str, "str | None": str, "int": int, "float": float}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add every settings flag to ``parser``; an environment twin, when set, becomes the default."""
    environ = os.environ if environ is None else environ
    for field in dataclasses.fields(Settings):
        name, help_text, default = field.name, field.metadata["help"], field.default
        is_bool = field.type == "bool"
        parse = field.metadata["parse"] or (_parse_bool if is_bool else _PARSERS[str(field.type)])
        env = env_name(name)
        if env in environ:
            try:
                default = parse(environ[env])
            except ValueError as exc:
                parser.error(f"{env}={environ[env]!r} is not valid: {exc}")
        if is_bool:
            parser.add_argument(flag_name(name), dest=name, action=argparse.BooleanOptionalAction, default=default,
                                help=f"{help_text} [env {env}=1|0; default: %(default)s]")
        else:
            parser.add_argument(flag_name(name), dest=name, type=parse, default=default,
                                help=f"{help_text} [env {env}; default: %(default)s]")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def from_namespace(ns: argparse.Namespace) -> Settings:
    """Build and validate Settings from parsed flags."""
    names = {f.name for f in dataclasses.fields(Settings)}
    settings = Settings(**{k: v for k, v in vars(ns).items() if k in names})
    validate(settings)
    return settings


def validate(s: Settings) -> None:
    """Raise ValueError with the flag name when a setting is out of range."""
    def need(ok: bool, flag: str, value: Any, rule: str) -> None:
        if not ok:
            raise ValueError(f"{flag}={value!r}: {rule}")

    for field in dataclasses.fields(Settings):
        if field.metadata["check"] is not None:
            ok, rule = field.metadata["check"]
            value = getattr(s, field.name)
            need(ok(value), flag_name(field.name), value, rule)
    need(not (s.devices and s.device == "cpu"), "--devices", s.devices, "cannot be combined with --device cpu")
    need(s.frontend_impl == "python" or s.frontends != 0, "--frontend-impl", s.frontend_impl,
         "needs --frontends N (or auto): it is what kind of front end each of them is")
    need(1 <= s.max_streams_per_connection <= s.max_concurrent_rpcs, "--max-streams-per-connection",
         s.max_streams_per_connection, f"must be 1..--max-concurrent-rpcs ({s.max_concurrent_rpcs})")
    if s.latency_buckets_s:
        from .metrics import parse_buckets

        try:
            parse_buckets(s.latency_buckets_s)
        except ValueError as exc:
            raise ValueError(f"--latency-buckets-s={s.latency_buckets_s!r}: {exc}") from None
