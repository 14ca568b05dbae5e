"""A server refuses a port another server holds, instead of sharing it through SO_REUSEPORT."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from voxserve.server.topology.ports import PortInUse, ensure_free

from ..conftest import REPO, running_server

# Only so that a server that starts instead of refusing fails the test instead of hanging it.
GUARD_S = 60.0


@contextlib.contextmanager
def reuseport_listener(host: str = "127.0.0.1") -> Iterator[int]:
    """A listening socket with SO_REUSEPORT and SO_REUSEADDR set, as gRPC makes its own; yields its port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, 0))
        sock.listen()
        yield sock.getsockname()[1]


def _serve(*flags: str) -> subprocess.CompletedProcess:
    """``voxserve serve`` on loopback with these flags, run until it exits (killed past GUARD_S: a failure)."""
    proc = subprocess.Popen([sys.executable, "-m", "voxserve", "serve", "--host", "127.0.0.1", "--device", "cpu",
                             "--http-port", "0", *flags], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the server started on a taken port instead of refusing it:\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def _assert_refused(result: subprocess.CompletedProcess, flag: str, port: int) -> None:
    message = f"{flag}: port {port} on 127.0.0.1 is in use"
    assert result.returncode == 2, result.stdout[-3000:]  # a user's error (the CLI checks before starting)
    assert sum(message in line for line in result.stdout.splitlines()) == 1, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]


def test_ensure_free_refuses_a_port_a_reuseport_listener_holds():
    with reuseport_listener() as port:
        for host in ("127.0.0.1", "0.0.0.0"):  # the wildcard overlaps the loopback listener too
            with pytest.raises(PortInUse, match=rf"^--grpc-port: port {port} on {host} is in use") as err:
                ensure_free(host, port, "--grpc-port")
            assert err.value.port == port and err.value.flag == "--grpc-port"


def test_ensure_free_refuses_a_port_a_grpc_server_listens_on():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(PortInUse, match="--metrics-port"):
            ensure_free("127.0.0.1", port, "--metrics-port")
    finally:
        server.stop(0)


def test_ensure_free_passes_on_a_free_port_and_on_port_zero():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ensure_free("127.0.0.1", port, "--grpc-port")
    ensure_free("127.0.0.1", 0, "--grpc-port")  # the kernel picks a free one
    ensure_free("127.0.0.1", -1, "--metrics-port")  # off


def test_ensure_free_reads_ipv6_hosts_in_brackets():
    with contextlib.ExitStack() as stack:
        try:
            port = stack.enter_context(reuseport_listener("::1"))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        with pytest.raises(PortInUse, match=rf"port {port} on \[::1\]"):
            ensure_free("[::1]", port, "--grpc-port")


def test_supervisor_refuses_a_grpc_port_another_server_holds():
    with reuseport_listener() as port:
        result = _serve("--replicas", "2", "--grpc-port", str(port), "--metrics-port", "-1")
    _assert_refused(result, "--grpc-port", port)


def test_supervisor_refuses_an_http_port_another_server_holds():
    """An HTTP port that another server holds with SO_REUSEPORT (as the replicas' own REST sockets do): joining
    it would split the clients between the two servers."""
    with reuseport_listener() as port:
        result = _serve("--replicas", "2", "--grpc-port", "0", "--http-port", str(port), "--metrics-port", "-1")
    _assert_refused(result, "--http-port", port)


def test_supervisor_refuses_a_metrics_port_another_server_holds():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--replicas", "2", "--grpc-port", "0", "--metrics-port", str(port))
    _assert_refused(result, "--metrics-port", port)


@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port", "--metrics-port"])
def test_second_server_refuses_the_ports_of_a_running_server(flag):
    """A single-process server on a port that a running voxserve holds exits 2 with one line naming the flag."""
    with running_server() as srv:
        port = {"--grpc-port": srv.port, "--http-port": srv.server.http_port,
                "--metrics-port": srv.server.metrics_port}[flag]
        ports = {"--grpc-port": "0", "--http-port": "0", "--metrics-port": "-1", flag: str(port)}
        result = _serve(*(word for pair in ports.items() for word in pair))
    _assert_refused(result, flag, port)
