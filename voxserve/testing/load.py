"""A server in a child process (so its memory and exit can be watched) and open/closed-loop load against it.

Open loop sends at a fixed rate whatever the server does, the way real overload arrives; closed loop keeps
a fixed number of requests outstanding and measures capacity (it is `voxserve bench`'s driver,
voxserve.client.bench.run_level, reported here by status code). Every request's final status is kept (and
its latency: every one in the open loop, the successes' in the closed loop), so a report can say exactly how
many were answered, refused, or lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from voxserve.client.bench import INFER_METHOD, run_level
from voxserve.client.client import DEFAULT_MAX_MESSAGE_BYTES, _channel_options


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int, key: str) -> float:
    """A /proc/<pid>/status memory figure (VmRSS, VmHWM) in MB; 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def proc_stat(path: str | Path) -> tuple[str, list[str]]:
    """A process's or thread's stat file (/proc/<pid>/stat, /proc/<pid>/task/<tid>/stat): its command name
    and the fields after the name (state first), split the way the name's own spaces and parentheses allow."""
    text = Path(path).read_text()
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 1 :].split()


def stat_cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds from proc_stat's fields."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used, all its threads (/proc/<pid>/stat)."""
    return stat_cpu_seconds(proc_stat(f"/proc/{pid}/stat")[1])


class ServerProcess:
    """``voxserve serve`` on free loopback ports in a child process; waits until it reports ready."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, ready_timeout_s: float = 180.0) -> None:
        self.grpc_port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.url = f"127.0.0.1:{self.grpc_port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="voxserve-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "voxserve", "serve", "--host", "127.0.0.1", "--grpc-port", str(self.grpc_port),
             "--metrics-port", str(self.metrics_port), "--http-port", str(self.http_port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        from voxserve.client import Client

        deadline = time.monotonic() + timeout_s
        with Client(self.url, timeout_s=2) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
                # Ready over gRPC, and every process ready (--replicas, --frontends: the metric is their minimum).
                if c.is_ready() and self._all_ready():
                    return
                time.sleep(0.1)
        self.close()
        raise TimeoutError(f"the server was not ready within {timeout_s} s:\n{self.log_text()[-3000:]}")

    def _all_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return False
        return any(line.startswith("voxserve_model_ready{") and line.endswith(" 1.0") for line in text.splitlines())

    def pids(self) -> list[int]:
        """The server's process and its descendants (a supervisor's replicas, engines and front ends)."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                with contextlib.suppress(OSError):  # exited meanwhile
                    todo.extend(int(c) for c in task.read_text().split())
        return found

    def rss_mb(self) -> float:
        """Resident memory of the server's processes together."""
        return sum(_proc_status(pid, "VmRSS") for pid in self.pids())

    def peak_rss_mb(self) -> float:
        """The kernel's high-water marks of the server's processes' resident memory, added up."""
        return sum(_proc_status(pid, "VmHWM") for pid in self.pids())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def log_text(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def close(self, grace_s: float = 30.0) -> None:
        """SIGTERM (a supervisor of several processes passes it on), SIGKILL if it has not exited in grace_s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class LoadReport:
    offered: int = 0
    seconds: float = 0.0
    codes: Counter = field(default_factory=Counter)
    latencies_s: dict[str, list[float]] = field(default_factory=dict)
    outputs: list[bytes] = field(default_factory=list)  # raw responses of successful requests (when kept)
    details: Counter = field(default_factory=Counter)  # (code, message) of every failure

    def record(self, code: grpc.StatusCode, seconds: float, details: str = "") -> None:
        self.codes[code.name] += 1
        self.latencies_s.setdefault(code.name, []).append(seconds)
        if code != grpc.StatusCode.OK:
            self.details[(code.name, details)] += 1

    @property
    def answered(self) -> int:
        return sum(self.codes.values())

    @property
    def ok(self) -> int:
        return self.codes.get("OK", 0)

    def rate(self, code: str = "OK") -> float:
        return self.codes.get(code, 0) / self.seconds if self.seconds else 0.0

    def percentile_ms(self, code: str, q: float) -> float:
        values = self.latencies_s.get(code)
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")


async def _one(call, payload: bytes, timeout_s: float, report: LoadReport, keep_outputs: bool) -> None:
    t0 = time.perf_counter()
    try:
        response = await call(payload, timeout=timeout_s)
        code, details = grpc.StatusCode.OK, ""
        if keep_outputs:
            report.outputs.append(response)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    report.record(code, time.perf_counter() - t0, details)


async def open_loop(url: str, payload: bytes, rate_per_s: float, duration_s: float, *, timeout_s: float = 30.0,
                    keep_outputs: bool = False, during=None, connections: int = 1) -> LoadReport:
    """Send ``payload`` at ``rate_per_s`` for ``duration_s`` whatever the answers; wait for every answer.

    ``connections``: the calls go round-robin over this many connections. One connection has at most the
    server's --max-streams-per-connection calls open; the rest wait on the client's side (HTTP/2 flow control),
    so an overload the server should see and refuse needs more connections than the overload has calls per limit.
    ``during``: an optional callable run (in a thread) at half time, e.g. to signal the server."""
    report = LoadReport()
    loop = asyncio.get_running_loop()
    channels = [grpc.aio.insecure_channel(url, options=_channel_options(DEFAULT_MAX_MESSAGE_BYTES))
                for _ in range(connections)]
    try:
        calls = [channel.unary_unary(INFER_METHOD) for channel in channels]
        tasks = []
        side = None
        t0 = loop.time()
        while (now := loop.time()) - t0 < duration_s:
            due = t0 + report.offered / rate_per_s
            if due > now:
                await asyncio.sleep(due - now)
            call = calls[report.offered % connections]
            tasks.append(asyncio.create_task(_one(call, payload, timeout_s, report, keep_outputs)))
            report.offered += 1
            if during is not None and side is None and loop.time() - t0 >= duration_s / 2:
                side = loop.run_in_executor(None, during)
        await asyncio.gather(*tasks)
        if side is not None:
            await side
        report.seconds = loop.time() - t0
    finally:
        for channel in channels:
            await channel.close()
    return report


async def closed_loop(url: str, payload: bytes, concurrency: int, duration_s: float, *,
                      timeout_s: float = 30.0) -> LoadReport:
    """``concurrency`` requests always outstanding for ``duration_s``: the server's capacity for this payload.

    The load is `voxserve bench`'s (voxserve.client.bench.run_level: one plaintext connection, no
    ModelStatistics calls), reported as a LoadReport: codes of every request, latencies of the successes."""
    level = await run_level(url, payload, 0, 0, concurrency, duration_s=duration_s, requests=None,
                            model="", target="closed loop", timeout_s=timeout_s, statistics=False)
    report = LoadReport(offered=level.requests + level.errors, seconds=level.seconds)
    if level.requests:
        report.codes["OK"] = level.requests
        report.latencies_s["OK"] = [ms / 1e3 for ms in level.latencies_ms]
    for (code, details), n in level.failures.items():
        report.codes[code] += n
        report.details[(code, details)] += n
    return report


def sample_rss(server: ServerProcess, stop: threading.Event | None = None, interval_s: float = 0.05) -> list[float]:
    """For a thread: the server's RSS every ``interval_s`` until ``stop`` is set (a threading.Event)."""
    samples = []
    while stop is None or not stop.is_set():
        samples.append(server.rss_mb())
        time.sleep(interval_s)
    return samples
