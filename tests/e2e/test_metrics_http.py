"""The /metrics HTTP server holds up against clients that open connections and never finish a request."""

from __future__ import annotations

import gzip
import socket
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from voxserve.server import metrics as metrics_module
from voxserve.server.metrics import Metrics
from voxserve.server.topology.supervisor import _serve_metrics

HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: voxserve\r\n"  # the headers never end
# Far under one thread per connection: the server's 8 places, the accepting thread, and a few exiting.
THREAD_BOUND = 12
# Only so that a server that never closes fails the test instead of hanging it; the server's own limit is 5 s.
GUARD_S = 60.0


def _open_half_sent(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(HALF_SENT)
        socks.append(sock)
    return socks


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as a close)."""
    sock.settimeout(GUARD_S)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _raw_scrape(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        return _read_to_close(sock)


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    m = Metrics("voxnet", gpu_metrics=False)
    yield m
    m.stop_http()


def test_half_sent_connections_hold_few_threads_and_cannot_keep_scrapes_out(metrics):
    """200 connections that never finish their request: the threads stay few, each newcomer takes the place of the
    oldest (answered 503), every one is closed by the server, and scrapes meanwhile are served."""
    port = metrics.serve_http("127.0.0.1", 0)
    before = threading.active_count()
    slow = _open_half_sent(port, 200)
    try:
        # Connections are accepted in order: once this one is answered, all 200 have been taken in.
        assert _raw_scrape(port).startswith(b"HTTP/1.0 200 ")
        assert threading.active_count() - before <= THREAD_BOUND
        for _ in range(5):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=GUARD_S) as reply:
                assert reply.status == 200 and b"voxserve_inflight_requests" in reply.read()
        replies = [_read_to_close(sock) for sock in slow]  # returns once the server has closed each
    finally:
        for sock in slow:
            sock.close()
    assert sum(r.startswith(b"HTTP/1.0 503 ") for r in replies) >= 190
    assert not any(r.startswith(b"HTTP/1.0 200") for r in replies)  # a request never finished is never answered
    assert threading.active_count() - before <= THREAD_BOUND


class _Stuck:
    """A collector that holds every scrape until released: connections being answered, none to end."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)  # one release per scrape being answered

    def collect(self):
        self.entered.release()
        self.release.wait(GUARD_S)
        return []


def test_connections_being_answered_are_never_ended_and_the_rest_get_503(metrics):
    stuck = _Stuck()
    metrics.registry.register(stuck)
    port = metrics.serve_http("127.0.0.1", 0)
    scrapes = [socket.create_connection(("127.0.0.1", port)) for _ in range(metrics_module.HTTP_MAX_CONNECTIONS)]
    try:
        for sock in scrapes:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        for _ in scrapes:  # every place is answering one of them (not merely: no request half-read yet)
            assert stuck.entered.acquire(timeout=GUARD_S)
        assert _raw_scrape(port).startswith(b"HTTP/1.0 503 ")
        stuck.release.set()
        assert all(_read_to_close(sock).startswith(b"HTTP/1.0 200 ") for sock in scrapes)
    finally:
        stuck.release.set()
        for sock in scrapes:
            sock.close()


def test_the_supervisors_metrics_are_the_same_bounded_server(tmp_path):
    """The supervisor's /metrics (--replicas) is the same bounded server: with more half-sent connections open
    than it serves at once, a scrape is served, and so are the connections that finish their requests."""
    (tmp_path / "metrics").mkdir()
    server, port = _serve_metrics("127.0.0.1", 0, str(tmp_path))
    slow = _open_half_sent(port, 32)
    try:
        assert _raw_scrape(port).startswith(b"HTTP/1.0 200 ")
        for sock in slow:  # the request ends here, so the server answers or has ended it: no waiting on a timeout
            sock.shutdown(socket.SHUT_WR)
        replies = [_read_to_close(sock) for sock in slow]
        assert all(r.startswith((b"HTTP/1.0 200 ", b"HTTP/1.0 503 ")) for r in replies)
        assert _raw_scrape(port).startswith(b"HTTP/1.0 200 ")
    finally:
        for sock in slow:
            sock.close()
        server.shutdown()
        server.server_close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("[::1]", marks=pytest.mark.skipif(
    not _has_ipv6_loopback(), reason="no IPv6 loopback here"))])
def test_metrics_keep_prometheus_negotiation_and_stop_freeing_the_port(host):
    """prometheus_client's exposition is served as it is (OpenMetrics on request, gzip, plain text otherwise),
    on IPv4 and IPv6 hosts as gRPC spells them, and close() frees the port."""
    registry = Metrics("voxnet", gpu_metrics=False).registry
    server = metrics_module.serve_metrics_http(registry, host, 0, timeout_s=1.0, max_connections=2)
    url = f"http://{host}:{server.port}/metrics"
    request = urllib.request.Request(url, headers={
        "Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=GUARD_S) as reply:
        assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
        assert reply.headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(reply.read()).endswith(b"# EOF\n")
    with urllib.request.urlopen(url, timeout=GUARD_S) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain") and b"voxserve_build_info" in reply.read()
    server.close()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe, pytest.raises(ConnectionRefusedError):
        probe.connect((host.strip("[]"), server.port))
