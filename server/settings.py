"""One settings object for the server, built once from flags and VOXSERVE_* environment variables."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MiB = 1024 * 1024
AUTO = "auto"


def frontends_count(text: str) -> int | str:
    """--frontends: a number of front-end processes, or 'auto' (server/replicas.py: resolve_frontends)."""
    text = str(text).strip()
    return AUTO if text.lower() == AUTO else int(text)


@dataclass(frozen=True)
class Settings:
    """Everything the server is configured by. Each field has a flag and an environment twin."""

    weights: str | None = None
    host: str = "0.0.0.0"
    grpc_port: int = 8001
    metrics_port: int = 8002
    device: str = "auto"
    devices: str = ""
    precision: str = "fp32"
    model_name: str = "voxnet"
    model_version: str = "1"
    max_message_bytes: int = 128 * MiB
    max_batch: int = 128
    batching: bool = True
    max_queue_delay_ms: float = 0.0
    max_queue_size: int = 512
    max_shm_regions: int = 64
    max_shm_bytes: int = 8 * 1024 * MiB
    max_request_samples: int = 1024
    max_request_voxels: int = 1 << 25
    max_concurrent_rpcs: int = 256
    max_streams_per_connection: int = 64
    stream_idle_timeout_s: float = 60.0
    grpc_compression: bool = False
    max_shm_inflight_bytes: int = 2 * 1024 * MiB
    grace_period_s: float = 30.0
    log_level: str = "INFO"
    latency_buckets_s: str = ""  # empty: the defaults in server/metrics.py
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_token_file: str = ""
    open_health: bool = False
    replicas: int = 0  # 0: one per GPU of --devices (1 without --devices)
    frontends: int | str = 0  # 0: gRPC is served in the model's own process; "auto": sized to the host
    frontend_arena_bytes: int = 256 * MiB


# flag name, field, type, help. The environment twin is VOXSERVE_<FIELD upper-cased>.
_FLAGS: Sequence[tuple[str, str, Any, str]] = (
    ("--weights", "weights", str,
     "safetensors file with conv.weight (Cout, Cin, k, k, k) and conv.bias (Cout); "
     "default: the reference instance's deterministic weights (Cin=3, Cout=16, k=3)"),
    ("--host", "host", str, "address to listen on"),
    ("--grpc-port", "grpc_port", int,
     "gRPC port (Open Inference Protocol, health, reflection); 0 picks a free port"),
    ("--metrics-port", "metrics_port", int, "Prometheus metrics port (HTTP /metrics); 0 picks a free one, -1 disables"),
    ("--device", "device", str,
     "auto (the first GPU if one is usable, else the CPU), cpu, cuda or cuda:N"),
    ("--devices", "devices", str,
     "serve on several GPUs: 'all' or indices like '0,1' (one runner each, batches go to the least busy); "
     "overrides --device"),
    ("--precision", "precision", str,
     "fp32 (results within 1e-5 of float64) or tf32 (on a GPU the tensor-core kernel multiplies in TF32: "
     "faster, relative error within 5e-3; the CPU path stays float32)"),
    ("--model-name", "model_name", str, "the model's name in the protocol and in metric labels"),
    ("--model-version", "model_version", str, "the model's version string"),
    ("--max-message-bytes", "max_message_bytes", int,
     "largest gRPC message accepted or sent; larger ones get RESOURCE_EXHAUSTED (default: 5 reference batches)"),
    ("--max-batch", "max_batch", int,
     "most samples in one execution: the dynamic batcher merges up to this many, larger requests run in pieces"),
    ("--batching", "batching", "bool",
     "merge concurrent requests of equal sample shape and datatype into one execution (--no-batching: never)"),
    ("--max-queue-delay-ms", "max_queue_delay_ms", float,
     "how long the batcher may hold a request waiting for more to fill a batch (0: batch only what queued up "
     "while the device was busy)"),
    ("--max-queue-size", "max_queue_size", int,
     "most requests waiting for execution; further ones get UNAVAILABLE at once"),
    ("--max-shm-regions", "max_shm_regions", int, "most system shared-memory regions registered at once"),
    ("--max-shm-bytes", "max_shm_bytes", int, "most bytes of shared memory mapped across all regions"),
    ("--max-request-samples", "max_request_samples", int,
     "most samples one request may carry (RESOURCE_EXHAUSTED above it)"),
    ("--max-request-voxels", "max_request_voxels", int,
     "most input voxels (N x D x H x W) one request may carry, over the wire or in shared memory "
     "(RESOURCE_EXHAUSTED above it; default: 16 reference batches)"),
    ("--max-concurrent-rpcs", "max_concurrent_rpcs", int,
     "most RPCs served at once, over all connections (authenticated ones: a refused token holds no slot); "
     "further ones are refused with RESOURCE_EXHAUSTED"),
    ("--max-streams-per-connection", "max_streams_per_connection", int,
     "most RPCs one connection may have open at once (HTTP/2 MAX_CONCURRENT_STREAMS: a client's further calls "
     "wait on its side), so that one connection holds at most this share of --max-concurrent-rpcs"),
    ("--stream-idle-timeout-s", "stream_idle_timeout_s", float,
     "a ModelStreamInfer stream with nothing in progress that receives no message for this long, and a "
     "grpc.health.v1 Watch open this long, is closed with UNAVAILABLE (the client opens a new one); 0: never"),
    ("--grpc-compression", "grpc_compression", "bool",
     "accept gzip/deflate-compressed request messages (inflated up to --max-message-bytes); by default they "
     "are refused with UNIMPLEMENTED before any byte is inflated"),
    ("--max-shm-inflight-bytes", "max_shm_inflight_bytes", int,
     "most bytes of shared-memory inputs copied into the server at once (over all requests in progress); a "
     "request waits for room, one larger than this alone gets RESOURCE_EXHAUSTED"),
    ("--grace-period-s", "grace_period_s", float,
     "on SIGTERM/SIGINT: how long in-flight requests may take to finish before the server exits"),
    ("--log-level", "log_level", str, "DEBUG, INFO, WARNING or ERROR"),
    ("--latency-buckets-s", "latency_buckets_s", str,
     "comma-separated histogram bucket bounds in seconds for the latency metrics (empty: 100 us .. 30 s)"),
    ("--tls-cert", "tls_cert", str, "PEM certificate chain: serve gRPC over TLS (with --tls-key)"),
    ("--tls-key", "tls_key", str, "PEM private key of --tls-cert"),
    ("--tls-client-ca", "tls_client_ca", str,
     "PEM CA bundle: mutual TLS, every client must present a certificate it signed"),
    ("--auth-token-file", "auth_token_file", str,
     "file of accepted bearer tokens, one per line: every RPC must send 'authorization: Bearer <token>' "
     "(UNAUTHENTICATED otherwise)"),
    ("--open-health", "open_health", "bool",
     "with --auth-token-file: let liveness/readiness RPCs (grpc.health.v1, ServerLive/Ready, ModelReady) "
     "through without a token, for orchestrator probes"),
    ("--replicas", "replicas", int,
     "server processes sharing the gRPC port, replica i on GPU i of --devices (or of the visible GPUs): one "
     "process per GPU scales where one process driving several does not; shared-memory regions, metrics "
     "and statistics are shared. 0: one per GPU of --devices (1 without --devices); 1 with "
     "--devices: one process, one runner per GPU"),
    ("--frontends", "frontends", frontends_count,
     "gRPC front-end processes sharing the port, in front of engine processes that only batch and execute "
     "(one per replica): small requests then reach the batcher at the rate of N processes instead of one. "
     "0: each replica terminates its own gRPC; auto: three quarters of the usable CPU cores (affinity and "
     "cgroup quota), at most 16 per GPU replica, when the model runs on a GPU; 0 on the CPU"),
    ("--frontend-arena-bytes", "frontend_arena_bytes", int,
     "with --frontends: each front end's shared staging memory for tensors on their way to an engine "
     "(requests wait for room; larger ones travel in pieces)"),
)  # fmt: skip


def env_name(field_name: str) -> str:
    return "VOXSERVE_" + field_name.upper()


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add every settings flag to ``parser``; an environment twin, when set, becomes the default."""
    environ = os.environ if environ is None else environ
    defaults = Settings()
    for flag, name, kind, help_text in _FLAGS:
        default = getattr(defaults, name)
        env = env_name(name)
        if env in environ:
            try:
                default = _parse_bool(environ[env]) if kind == "bool" else kind(environ[env])
            except ValueError as exc:
                parser.error(f"{env}={environ[env]!r} is not valid: {exc}")
        if kind == "bool":
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default,
                                help=f"{help_text} [env {env}=1|0; default: %(default)s]")
        else:
            parser.add_argument(flag, dest=name, type=kind, default=default,
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

    need(0 <= s.grpc_port <= 65535, "--grpc-port", s.grpc_port, "must be 0..65535")
    need(-1 <= s.metrics_port <= 65535, "--metrics-port", s.metrics_port, "must be -1..65535")
    need(s.device == "auto" or s.device == "cpu" or s.device == "cuda" or
         (s.device.startswith("cuda:") and s.device[5:].isdigit()),
         "--device", s.device, "must be auto, cpu, cuda or cuda:N")
    need(s.devices in ("", "all") or all(p.isdigit() for p in s.devices.split(",")), "--devices", s.devices,
         "must be 'all' or comma-separated GPU indices like 0,1")
    need(not (s.devices and s.device == "cpu"), "--devices", s.devices, "cannot be combined with --device cpu")
    need(s.precision in ("fp32", "tf32"), "--precision", s.precision, "must be fp32 or tf32")
    need(bool(s.model_name) and s.model_name.replace("_", "").replace("-", "").replace(".", "").isalnum(),
         "--model-name", s.model_name, "must be letters, digits, '_', '-' or '.'")
    need(1024 <= s.max_message_bytes <= 2**31 - 1, "--max-message-bytes", s.max_message_bytes,
         "must be between 1 KiB and 2 GiB - 1 (gRPC's limit)")
    need(s.max_batch >= 1, "--max-batch", s.max_batch, "must be >= 1")
    need(s.max_queue_delay_ms >= 0, "--max-queue-delay-ms", s.max_queue_delay_ms, "must be >= 0")
    need(s.max_queue_size >= 1, "--max-queue-size", s.max_queue_size, "must be >= 1")
    need(s.max_shm_regions >= 0, "--max-shm-regions", s.max_shm_regions, "must be >= 0")
    need(s.max_shm_bytes >= 0, "--max-shm-bytes", s.max_shm_bytes, "must be >= 0")
    need(s.max_request_samples >= 1, "--max-request-samples", s.max_request_samples, "must be >= 1")
    need(s.max_request_voxels >= 1, "--max-request-voxels", s.max_request_voxels, "must be >= 1")
    need(s.max_concurrent_rpcs >= 1, "--max-concurrent-rpcs", s.max_concurrent_rpcs, "must be >= 1")
    need(1 <= s.max_streams_per_connection <= s.max_concurrent_rpcs, "--max-streams-per-connection",
         s.max_streams_per_connection, f"must be 1..--max-concurrent-rpcs ({s.max_concurrent_rpcs})")
    need(s.stream_idle_timeout_s >= 0, "--stream-idle-timeout-s", s.stream_idle_timeout_s, "must be >= 0")
    need(s.max_shm_inflight_bytes >= 1, "--max-shm-inflight-bytes", s.max_shm_inflight_bytes, "must be >= 1")
    need(s.grace_period_s >= 0, "--grace-period-s", s.grace_period_s, "must be >= 0")
    need(0 <= s.replicas <= 64, "--replicas", s.replicas, "must be 0..64 (0: one per GPU of --devices)")
    need(s.frontends == AUTO or (isinstance(s.frontends, int) and 0 <= s.frontends <= 64), "--frontends",
         s.frontends, "must be 0..64 or auto")
    need(MiB <= s.frontend_arena_bytes <= 2**40, "--frontend-arena-bytes", s.frontend_arena_bytes,
         "must be between 1 MiB and 1 TiB")
    if s.latency_buckets_s:
        from .metrics import parse_buckets

        try:
            parse_buckets(s.latency_buckets_s)
        except ValueError as exc:
            raise ValueError(f"--latency-buckets-s={s.latency_buckets_s!r}: {exc}") from None
    need(s.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "--log-level", s.log_level,
         "must be DEBUG, INFO, WARNING or ERROR")
