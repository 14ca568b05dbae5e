"""The server as a process: start-up, readiness, SIGTERM drain with requests in flight, exit codes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from voxserve.client import Client, InferenceError, build_request, parse_response
from voxserve.client.bench import INFER_METHOD
from voxserve.kernels import reference_float64, reference_weights
from voxserve.proto import pb
from voxserve.server import eventloop
from voxserve.server.core.model import relative_error

from ..conftest import REPO, running_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _metric(port: int, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _health(url: str) -> int | None:
    try:
        with grpc.insecure_channel(url) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


@pytest.fixture
def server_process(tmp_path):
    grpc_port, metrics_port = _free_port(), _free_port()
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 - the server process writes it until teardown
    env = dict(os.environ, VOXSERVE_GRACE_PERIOD_S="60")  # an environment twin, on purpose
    proc = subprocess.Popen(
        [sys.executable, "-m", "voxserve", "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
         "--metrics-port", str(metrics_port), "--http-port", "0", "--device", "cpu"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc, f"127.0.0.1:{grpc_port}", metrics_port, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        print(log.read())
        log.close()


def test_sigterm_drains_in_flight_requests(server_process):
    proc, url, metrics_port, log = server_process
    _wait_for(lambda: _health(url) == health_pb2.HealthCheckResponse.SERVING, 120, "the server to become ready")
    rng = np.random.default_rng()
    inputs = [rng.standard_normal((384, 3, 16, 32, 32), dtype=np.float32) for _ in range(4)]
    # Serialised up front, so that all four reach the server together (sending bytes needs no GIL) and
    # are in flight at once even on a busy 2-core machine.
    bodies = [build_request(x, "voxnet", "FP32").SerializeToString() for x in inputs]
    with grpc.insecure_channel(url, options=[("grpc.max_send_message_length", 1 << 30),
                                             ("grpc.max_receive_message_length", 1 << 30)]) as channel:
        call = channel.unary_unary(INFER_METHOD)
        futures = [call.future(body, timeout=300) for body in bodies]
        _wait_for(lambda: (_metric(metrics_port, "voxserve_inflight_requests") or 0) >= len(inputs), 60,
                  "all requests to be in flight")
        proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: _health(url) != health_pb2.HealthCheckResponse.SERVING, 30, "not-serving after SIGTERM")
        with Client(url, timeout_s=10) as late, pytest.raises(InferenceError) as err:
            late.infer(inputs[0][:1])
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # Every accepted request is answered.
        results = [parse_response(pb.ModelInferResponse.FromString(f.result(timeout=300))) for f in futures]
    assert all(r.shape == (384, 16) and np.isfinite(r).all() for r in results)
    assert proc.wait(timeout=60) == 0
    log.seek(0)
    text = log.read()
    assert "draining" in text and "stopped: 4 requests admitted, 4 answered OK, 0 abandoned" in text
    assert "(asyncio event loop)" in text  # the default


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_each_event_loop_serves(kind, rng):
    if kind == "uvloop" and eventloop.resolve("auto") != "uvloop":
        pytest.skip("uvloop is not installed (the test extra installs it)")
    with running_server(event_loop=kind) as srv, Client(srv.url) as client:
        assert srv.wait_ready()
        assert srv.call(_loop_kind()) == kind
        x = torch.randn((2, 3, 5, 6, 7), generator=rng)
        w, b = reference_weights()
        assert relative_error(torch.from_numpy(client.infer(x.numpy())), reference_float64(x, w, b)) <= 1e-5


async def _loop_kind() -> str:
    return eventloop.running()


def test_event_loop_choice():
    assert eventloop.resolve("asyncio") == "asyncio"
    assert eventloop.resolve("auto") in ("uvloop", "asyncio")
    assert eventloop.run(_loop_kind(), "asyncio") == "asyncio"


def test_bad_weights_fail_start_with_exit_2(tmp_path):
    bad = tmp_path / "w.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    proc = subprocess.run(
        [sys.executable, "-m", "voxserve", "serve", "--weights", str(bad), "--grpc-port", "0", "--metrics-port", "-1",
         "--http-port", "-1", "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "missing tensor(s) conv.weight, conv.bias" in proc.stderr


def test_invalid_flag_value_is_explained():
    proc = subprocess.run([sys.executable, "-m", "voxserve", "serve", "--device", "tpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--device='tpu': must be auto, cpu, cuda or cuda:N" in proc.stderr
