"""Native front ends (``--frontend-impl native``): what the supervisor starts for each front-end slot. The C++
binary (server/native/: built on first use) holds the public gRPC port, answers plain ModelInfer requests itself
against the engines, and hands every other call to its partner, a Python front end serving gRPC on a private Unix
socket (server/protocol/partner.py), which it also tells what it answered. Its settings are the server's, passed
as flags: the same limits and messages, the same gRPC options as a Python front end's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..protocol import security
from ..protocol.server import grpc_options
from ..settings import Settings

TOKEN_DIGESTS = "token-digests"  # in the run directory: the accepted tokens' SHA-256, for the native front ends


def write_token_digests(settings: Settings, run_dir: str) -> str | None:
    """The accepted bearer tokens' SHA-256 digests (hex, one per line) in ``run_dir``, read from --auth-token-file
    by the same rules as the Python front ends (SecurityConfigError naming the file): the native front ends compare
    digests, never see a token file. None without a token file."""
    if not settings.auth_token_file:
        return None
    path = os.path.join(run_dir, TOKEN_DIGESTS)
    tokens = security.load_tokens(settings.auth_token_file)
    digests = "".join(security.token_digest(token).hex() + "\n" for token in tokens)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(digests)
    return path


def command(binary: Path, settings: Settings, name: str, engines: Sequence[str], partner_socket: str, port: int,
            token_digests: str | None, regions_dir: str | None = None) -> list[str]:
    """The native front end ``name``'s command line: the public port (shared), its engines and its partner; and the
    regions' records (``regions_dir``), which it reads to take requests whose input lies in CUDA shared memory
    (where the engines offer it)."""
    args = [str(binary), "--name", name, "--listen", f"{settings.host}:{port}", "--partner", f"unix:{partner_socket}",
            "--arena-bytes", str(settings.frontend_arena_bytes), "--model-name", settings.model_name,
            "--model-version", settings.model_version, "--max-request-samples", str(settings.max_request_samples),
            "--max-request-voxels", str(settings.max_request_voxels), "--max-queue-size", str(settings.max_queue_size),
            "--max-concurrent-rpcs", str(settings.max_concurrent_rpcs),
            "--grace-period-s", str(settings.grace_period_s),
            # Traced or access-logged requests take the Python path, which does both.
            "--fast-path", "0" if settings.tracing or settings.access_log else "1"]
    for engine in engines:
        args += ["--engine", engine]
    for key, value in grpc_options(settings, shares_port=True):
        args += ["--grpc-arg", f"{key}={value}"]
    if token_digests is not None:
        args += ["--token-digests", token_digests]
    if regions_dir is not None:
        args += ["--regions-dir", regions_dir]
    if settings.tls_cert:
        args += ["--tls-cert", settings.tls_cert, "--tls-key", settings.tls_key]
        if settings.tls_client_ca:
            args += ["--tls-client-ca", settings.tls_client_ca]
    return args
