"""Shared fixtures: an in-process voxserve on an ephemeral port, driven over real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from voxserve.server import eventloop
from voxserve.server.app import VoxServer
from voxserve.server.settings import Settings

REPO = Path(__file__).resolve().parents[1]
SHARED_REFERENCE = REPO.parent / "shared" / "reference" / "model.py"


class ServerThread:
    """A VoxServer running its own event loop on a background thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = eventloop.loop_factory(settings.event_loop)()  # the loop `voxserve serve` would run
        self._thread = threading.Thread(target=self.loop.run_forever, name="voxserve-test-loop", daemon=True)
        self._thread.start()
        self.server: VoxServer = self.call(self._make())
        self.port: int = self.call(self.server.start())
        self.url = f"127.0.0.1:{self.port}"

    async def _make(self) -> VoxServer:
        return VoxServer(self.settings)

    def call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self) -> bool:
        return self.call(self.server.wait_ready())

    def stop(self, grace_s: float = 5.0) -> None:
        self.call(self.server.stop(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def running_server(**overrides) -> Iterator[ServerThread]:
    settings = dataclasses.replace(Settings(host="127.0.0.1", grpc_port=0, http_port=0, metrics_port=0, device="cpu"),
                                   **overrides)
    srv = ServerThread(settings)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    """One ready CPU server with default weights, shared by the protocol tests."""
    with running_server() as srv:
        assert srv.wait_ready(), srv.server.load_error
        yield srv


@pytest.fixture
def rng() -> torch.Generator:
    """A freshly seeded generator: every run draws new inputs (the seed is printed on failure)."""
    seed = torch.seed()
    print(f"random seed {seed}")
    return torch.Generator().manual_seed(seed)


@dataclasses.dataclass
class ServeProcess:
    proc: subprocess.Popen
    grpc_port: int
    metrics_port: int
    http_port: int
    log: str = ""  # the whole log, once the process has exited

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@contextlib.contextmanager
def serve_process(log_path: Path, *flags: str) -> Iterator[ServeProcess]:
    """``voxserve serve`` (and whatever it supervises) in a child process on free loopback ports; killed if still
    running at the end, its log printed and kept in ``.log``."""
    from .e2e.test_lifecycle import _free_port

    grpc_port, metrics_port, http_port = _free_port(), _free_port(), _free_port()
    log = open(log_path, "w+")  # noqa: SIM115 - the server process writes it until the end
    proc = subprocess.Popen([sys.executable, "-m", "voxserve", "serve", "--host", "127.0.0.1", "--grpc-port",
                             str(grpc_port), "--metrics-port", str(metrics_port), "--http-port", str(http_port),
                             *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    served = ServeProcess(proc, grpc_port, metrics_port, http_port)
    try:
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        served.log = log.read()
        print(served.log)
        log.close()
