"""Transport security and authentication: TLS / mutual TLS server credentials and a bearer-token interceptor,
for the gRPC port; the REST port (``rest.py``) takes the same files (``server_ssl_context``) and tokens
(``BearerTokens``, from an ``Authorization: Bearer`` header).

- TLS (``--tls-cert``/``--tls-key``) encrypts the gRPC port; with ``--tls-client-ca`` every client must
  present a certificate signed by that CA. gRPC checks client certificates during the TLS handshake, so a
  client without one never gets an RPC through (it sees the connection fail, typically UNAVAILABLE).
- ``--auth-token-file`` holds one or more accepted bearer tokens (one per line, so a token can be rotated
  by listing old and new for a while). Every RPC must carry ``authorization: Bearer <token>``; the check
  is constant-time and runs in an interceptor before any handler or request parsing. Anything else is
  answered UNAUTHENTICATED and nothing more. ``--open-health`` exempts the liveness/readiness RPCs
  (grpc.health.v1 and the protocol's ServerLive/ServerReady/ModelReady): they reveal nothing but
  up/down, and orchestrator probes cannot send tokens.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from ..core.errors import StartupError

log = logging.getLogger(__name__)

HEALTH_METHODS = frozenset({
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/inference.GRPCInferenceService/ModelReady",
})
_MAX_TOKEN_FILE_BYTES = 64 * 1024
_MIN_TOKEN_CHARS = 16


class SecurityConfigError(StartupError, ValueError):
    """A TLS or token file is missing, unreadable or unusable; the server must not start."""


def _read(path: str, what: str, limit: int | None = None) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None
    if not data.strip():
        raise SecurityConfigError(f"{what} {path!r} is empty")
    if limit is not None and len(data) > limit:
        raise SecurityConfigError(f"{what} {path!r} is {len(data)} bytes; at most {limit} expected")
    return data


def server_credentials(cert_file: str | None, key_file: str | None,
                       client_ca_file: str | None) -> grpc.ServerCredentials | None:
    """Credentials for the gRPC port, or None for plaintext. Errors name the flag and the file."""
    if not cert_file and not key_file:
        if client_ca_file:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if not (cert_file and key_file):
        raise SecurityConfigError("--tls-cert and --tls-key go together: give both or neither")
    cert = _read(cert_file, "--tls-cert")
    key = _read(key_file, "--tls-key")
    if b"-----BEGIN" not in cert or b"-----BEGIN" not in key:
        raise SecurityConfigError("--tls-cert and --tls-key must be PEM files (-----BEGIN ... -----)")
    ca = _read(client_ca_file, "--tls-client-ca") if client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def load_tokens(path: str) -> list[bytes]:
    """The accepted tokens of a token file: one per non-empty line, surrounding whitespace ignored."""
    data = _read(path, "--auth-token-file", _MAX_TOKEN_FILE_BYTES)
    tokens = [line.strip() for line in data.splitlines() if line.strip() and not line.startswith(b"#")]
    if not tokens:
        raise SecurityConfigError(f"--auth-token-file {path!r} holds no token")
    for i, token in enumerate(tokens, 1):
        if len(token) < _MIN_TOKEN_CHARS:
            raise SecurityConfigError(f"--auth-token-file {path!r}: token {i} has {len(token)} characters; "
                                      f"use at least {_MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")
        if any(c <= 0x20 or c >= 0x7F for c in token):
            raise SecurityConfigError(f"--auth-token-file {path!r}: token {i} has characters that cannot travel "
                                      f"in gRPC metadata (printable ASCII only)")
    return tokens


def server_ssl_context(cert_file: str | None, key_file: str | None,
                       client_ca_file: str | None) -> ssl.SSLContext | None:
    """The REST port's TLS, from the same files as the gRPC port's (``server_credentials`` has checked them
    first): TLS 1.2 or later, and with ``client_ca_file`` a client certificate it signed is required."""
    if not cert_file or not key_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # OpenSSL's security policy applies here (gRPC's TLS library has its own): a key it deems too weak for the REST
    # port is refused at start-up, naming the way out, rather than served on one port and not the other.
    hint = "use a stronger key and certificate, or --http-port -1 to serve gRPC only"
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityConfigError(f"--tls-cert {cert_file} with --tls-key {key_file}: the REST port cannot serve "
                                  f"them ({getattr(exc, 'reason', None) or exc}); {hint}") from None
    if client_ca_file:
        try:
            context.load_verify_locations(client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityConfigError(f"--tls-client-ca {client_ca_file}: the REST port cannot use it "
                                      f"({getattr(exc, 'reason', None) or exc}); {hint}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def token_digest(token: bytes) -> bytes:
    """What a bearer token is compared as (its SHA-256): here, and by the native front ends (topology/native.py)."""
    return hashlib.sha256(token).digest()


class BearerTokens:
    """The accepted bearer tokens, checked in constant time: tokens are compared as SHA-256 digests with
    ``hmac.compare_digest`` against every accepted token, so the time taken depends on neither the presented
    token's length nor how much of it matched."""

    def __init__(self, tokens: list[bytes]) -> None:
        self._digests = [token_digest(t) for t in tokens]

    def admits(self, authorization: str | bytes | None) -> bool:
        """Whether an ``authorization`` value (``Bearer <token>``, the scheme in any case) carries an accepted
        token."""
        presented = b""
        if authorization:
            raw = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
            scheme, _, token = raw.partition(b" ")
            if scheme.lower() == b"bearer":
                presented = token.strip()
        digest = token_digest(presented)
        ok = False
        for accepted in self._digests:
            ok |= hmac.compare_digest(digest, accepted)
        return ok and bool(presented)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Admit an RPC only with ``authorization: Bearer <one of the tokens>``; else UNAUTHENTICATED."""

    def __init__(self, tokens: list[bytes], open_methods: frozenset[str] = frozenset(),
                 on_reject: Callable[[str], None] | None = None) -> None:
        self._tokens = BearerTokens(tokens)
        self._open = open_methods
        self._on_reject = on_reject or (lambda method: None)

    def _admits(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return self._tokens.admits(value)
        return False

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method
        if method in self._open or self._admits(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        self._on_reject(method)
        return _reject(await continuation(handler_call_details))


_DENIED = "missing or invalid credentials: send 'authorization: Bearer <token>' metadata"


async def _deny(request_or_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


async def _deny_stream(request_or_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
    yield  # pragma: no cover - makes this an async generator, as streaming handlers are


def _reject(handler):
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED without reading the request."""
    if handler is None:  # unknown method: UNAUTHENTICATED too, so no method list leaks to strangers
        return grpc.unary_unary_rpc_method_handler(_deny)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_deny)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_deny_stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_deny)
    return grpc.stream_stream_rpc_method_handler(_deny_stream)
