"""Client-side credentials: TLS (optionally with a client certificate for mutual TLS) and a bearer token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class Credentials:
    """How a client proves itself and checks the server.

    tls: use TLS (implied by any of the files). ca: PEM roots to verify the server (default: the
    system's). cert/key: the client's certificate for mutual TLS. token: sent as
    ``authorization: Bearer <token>`` on every call. server_name: override the name checked in the
    server's certificate (when connecting by IP to a certificate issued for a host name).
    """

    tls: bool = False
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    token: str | None = None
    server_name: str | None = None

    @classmethod
    def from_files(cls, *, tls: bool = False, ca_file: str | None = None, cert_file: str | None = None,
                   key_file: str | None = None, token_file: str | None = None,
                   server_name: str | None = None) -> Credentials:
        """Read the named files; the token file's first non-empty, non-comment line is the token."""
        if bool(cert_file) != bool(key_file):
            raise ValueError("a client certificate and its key go together: give both or neither")

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        token = None
        if token_file:
            lines = [ln.strip() for ln in Path(token_file).read_text().splitlines()]
            token = next((ln for ln in lines if ln and not ln.startswith("#")), None)
            if token is None:
                raise ValueError(f"token file {token_file!r} holds no token")
        return cls(tls=tls or bool(ca_file or cert_file), ca=read(ca_file), cert=read(cert_file),
                   key=read(key_file), token=token, server_name=server_name)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, url: str, options: list[tuple[str, Any]], *, aio: bool = False):
        """A sync or grpc.aio channel to ``url`` with these credentials."""
        options = options + self.channel_options()
        mod = grpc.aio if aio else grpc
        if not self.tls:
            return mod.insecure_channel(url, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                             certificate_chain=self.cert)
        return mod.secure_channel(url, creds, options=options)


PLAINTEXT = Credentials()
