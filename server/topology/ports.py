"""Whether a port is free to listen on, checked before a server binds it.

gRPC sets SO_REUSEPORT on its listening sockets, and so do the replicas of ``--replicas`` (that is how they
share one port). A second server started on a port that one already holds would join it silently, the kernel
spreading the clients over both. ``ensure_free`` tells the two cases apart: its probe socket binds without
SO_REUSEPORT, so it fails on a port that any other socket has bound or listens on, whatever that socket set.
"""

from __future__ import annotations

import errno
import socket

from ..core.errors import StartupError


class PortInUse(StartupError, OSError):
    """A port another socket holds; its message names the flag that chose the port."""

    def __init__(self, flag: str, host: str, port: int) -> None:
        super().__init__(f"{flag}: port {port} on {host} is in use (another server holds it)")
        self.errno = errno.EADDRINUSE
        self.flag, self.host, self.port = flag, host, port


def bind_address(host: str) -> tuple[socket.AddressFamily, str]:
    """The address family and the bare address of ``host`` as a flag spells it (gRPC writes IPv6 in brackets)."""
    bare = host.strip("[]")
    return (socket.AF_INET6 if ":" in bare else socket.AF_INET), bare


def ensure_free(host: str, port: int, flag: str) -> None:
    """Raise PortInUse (naming ``flag``) when a socket already holds ``port`` on ``host``. Port 0 (the kernel
    picks a free one) and negative ports (off) need no check."""
    if port <= 0:
        return
    family, bare = bind_address(host)
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR, as gRPC and http.server set it, so connections left in TIME_WAIT by a server that has
        # exited do not count as holding the port; on Linux it still fails against a listening socket.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((bare, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(flag, host, port) from None
        raise
    finally:
        probe.close()
