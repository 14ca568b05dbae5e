"""``--replicas N``: N server processes behind one gRPC port (and one REST port), one per GPU by default with
``--devices``.

One Python process reaches a ceiling of executions per second whatever the GPUs can take (measured on
2x H200, bench/results/multi-gpu-h200x2.md: one process driving both GPUs moved fewer samples than one
process driving one, two processes with a GPU each moved 2.0x). So the supervisor here starts N
``voxserve serve`` children that all listen on the same port (SO_REUSEPORT: the kernel spreads incoming
connections over them), replica i on GPU i (of --devices, or of all visible GPUs), and serves the
children's metrics, summed, on the metrics port.

What the replicas share, through a run directory the supervisor creates and removes:
- the system shared-memory registry (a region registered over one connection is usable, listed and
  unregistered over any other: ``SharedMemoryRegistry(shared_dir=...)``);
- Prometheus metrics (prometheus_client's multiprocess mode: counters and histograms summed, the
  in-flight and queue gauges summed over live replicas, readiness the minimum);
- ModelStatistics (each replica answers with its own live figures plus the others' as published every
  0.5 s).

What they do not share: the batcher (requests are batched within the replica whose connection they
arrived on). A connection stays with one replica, so a client spreads over replicas by opening several
channels (``voxserve bench --connections``).

If a replica exits on its own, the supervisor stops the others and exits non-zero, so the orchestrator
restarts the whole server; SIGTERM/SIGINT are passed on and each replica drains as a single server does.
A gRPC, REST or metrics port that another server holds ends the supervisor (exit 1) before it binds or starts
anything: its replicas share only the port group it created (server/topology/ports.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .. import logs
from ..core.errors import StartupError
from ..settings import AUTO, Settings, env_name
from . import native as native_frontends
from .ports import PortInUse, bind_address, ensure_free
from .roles import ENGINE, FRONTEND, REPLICA, Role

log = logging.getLogger("voxserve.replicas")

# After SIGTERM, how long past the grace period the children may take before they are killed (an engine
# waits for its front ends to drain, then exits itself).
STOP_MARGIN_S = 15.0


def die_with_supervisor() -> None:
    """In a child: be sent SIGTERM when the supervisor dies (killed outright, it forwards nothing), so no
    engine or replica outlives it holding a GPU or the port. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the supervisor died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (not listen) a SO_REUSEPORT socket on host:port: fixes the port when it is 0 and keeps it ours
    while the replicas bind it too (they set SO_REUSEPORT as well; only listening sockets get connections)."""
    family, bare = bind_address(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((bare, port))
    except BaseException:
        sock.close()
        raise
    return sock


def replica_devices(settings: Settings, replicas: int, gpu_count: int) -> list[tuple[str, str]]:
    """(--device, --devices) for each replica: GPU i % count of --devices (or of all visible GPUs when the
    device is auto/cuda and several are visible); otherwise every replica gets the server's own choice. A single
    replica (the engine of --frontends with --replicas 1) gets them all, a runner per GPU."""
    if replicas == 1:
        return [(settings.device, settings.devices)]
    if settings.devices:
        indices = list(range(gpu_count)) if settings.devices == "all" else \
            [int(i) for i in settings.devices.split(",")]
        if indices:
            return [(settings.device, str(indices[i % len(indices)])) for i in range(replicas)]
    if settings.device in ("auto", "cuda") and gpu_count > 1:
        return [(f"cuda:{i % gpu_count}", "") for i in range(replicas)]
    return [(settings.device, settings.devices)] * replicas


def child_environment(settings: Settings, role: Role, device: str, devices: str, port: int,
                      base: dict[str, str] | None = None, http_port: int = -1) -> dict[str, str]:
    """The environment of a child in ``role``: every setting as its VOXSERVE_* twin (so no flag needs
    re-spelling), with its own device, the shared gRPC and REST ports (-1: none), no metrics port of its own and
    one replica."""
    env = dict(os.environ if base is None else base)
    for field in dataclasses.fields(Settings):
        value = getattr(settings, field.name)
        if value is None:
            env.pop(env_name(field.name), None)
            continue
        env[env_name(field.name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    env.update({
        env_name("device"): device,
        env_name("devices"): devices,
        env_name("grpc_port"): str(port),
        env_name("http_port"): str(http_port),
        env_name("metrics_port"): "-1",
        env_name("replicas"): "1",
        env_name("frontends"): "0",
        env_name("frontend_impl"): "python",  # (each child is one process: the choice was the supervisor's)
        **role.environment(),
        "PROMETHEUS_MULTIPROC_DIR": os.path.join(role.run_dir, "metrics"),
    })
    return env


def resolve_replicas(settings: Settings, gpu_count: int | None = None) -> int:
    """--replicas, with 0 resolved: one per GPU that --devices names (1 without --devices)."""
    if settings.replicas:
        return settings.replicas
    if not settings.devices:
        return 1
    if settings.devices == "all":
        return max(1, _gpu_count() if gpu_count is None else gpu_count)
    return len(settings.devices.split(","))


FRONTENDS_PER_ENGINE = 16  # auto's ceiling per engine: 16 gave a GPU's engine as much as it took (32 cores)


def resolve_frontends(settings: Settings, gpu_count: int | None = None, cpus: float | None = None,
                      engines: int = 1) -> int:
    """--frontends, with auto resolved: three quarters of the usable cores when the model runs on a GPU (at
    least 1; at most 16 per engine, each engine being one GPU replica, and 64 in all), else 0 (on the CPU
    the model needs the cores itself). Three quarters: with half the cores as front ends, the kernel's
    hashing of connections left some of them idle and others queueing while a quarter of the host sat
    idle; the engines and the clients on the host take the rest. Each front end costs a process
    (~250 MB) and its staging arena, hence the ceiling."""
    if settings.frontends != AUTO:
        return int(settings.frontends)
    if settings.device == "cpu" or (_gpu_count() if gpu_count is None else gpu_count) == 0:
        return 0
    cores = usable_cpus() if cpus is None else cpus
    return max(1, min(64, FRONTENDS_PER_ENGINE * max(1, engines), int(cores * 3 / 4)))


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> float:
    """The CPU cores this process may use: its affinity, lowered by a cgroup CPU quota (a container's limit)."""
    cpus = float(len(os.sched_getaffinity(0)))
    quota = cgroup_cpu_quota(cgroup_root, self_cgroup)
    return min(cpus, quota) if quota else cpus


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> float | None:
    """Cores allowed by the CPU quotas of this process's cgroup and its ancestors (v2 ``cpu.max``; v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` at the root), the tightest one; None when unlimited."""
    base = Path(root)
    try:  # v2: "0::/path/of/this/cgroup" (just "/" inside a container with its own cgroup namespace)
        relative = next(line[3:].strip() for line in Path(self_cgroup).read_text().splitlines()
                        if line.startswith("0::"))
    except (OSError, StopIteration):
        relative = "/"
    quotas = []
    node = base / relative.lstrip("/")
    for directory in (node, *node.parents):
        try:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            if quota != "max":
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        if directory == base:
            break
    if quotas:
        return min(quotas)
    try:
        v1_quota, v1_period = (int((base / "cpu" / f"cpu.cfs_{name}_us").read_text()) for name in ("quota", "period"))
        return v1_quota / v1_period if v1_quota > 0 and v1_period > 0 else None
    except (OSError, ValueError):
        return None


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no torch build with CUDA here: CPU replicas
        return 0


def supervise(settings: Settings, command: Sequence[str] | None = None) -> int:
    """Run ``settings.replicas`` replicas until SIGTERM/SIGINT (passed on) or until one exits on its own."""
    logs.configure(settings.log_level, settings.log_format)
    frontends = int(settings.frontends)  # resolved by the caller (never "auto" here)
    command = list(command) if command is not None else [sys.executable, "-m", "voxserve", "serve"]
    try:
        # Before anything binds: the reserved socket below sets SO_REUSEPORT and would join a port that
        # another server holds instead of failing on it.
        ensure_free(settings.host, settings.grpc_port, "--grpc-port")
        ensure_free(settings.host, settings.http_port, "--http-port")
        ensure_free(settings.host, settings.metrics_port, "--metrics-port")
    except PortInUse as exc:
        log.error("start-up failed: %s", exc)
        return 1
    native = None
    if frontends and settings.frontend_impl == "native":
        from ..native import build as native_build  # (g++ and gRPC's C++ library: only for native front ends)

        try:
            native = native_build.build()
        except native_build.NativeBuildError as exc:
            log.error("start-up failed: --frontend-impl native: %s", exc)
            return 1
    run_dir = tempfile.mkdtemp(prefix="voxserve-replicas-")
    os.makedirs(os.path.join(run_dir, "metrics"))
    os.makedirs(os.path.join(run_dir, "regions"))
    reserved = reserve_port(settings.host, settings.grpc_port)
    port = reserved.getsockname()[1]
    reserved_http = reserve_port(settings.host, settings.http_port) if settings.http_port >= 0 else None
    http_port = reserved_http.getsockname()[1] if reserved_http is not None else -1
    children: list[subprocess.Popen] = []
    natives: list[subprocess.Popen] = []  # native front ends: stopped first (their last report goes to a partner)
    stopping = threading.Event()
    metrics_server = None
    try:
        try:  # before any child starts
            token_digests = native_frontends.write_token_digests(settings, run_dir) if native is not None else None
        except StartupError as exc:
            log.error("start-up failed: %s", exc)
            return 1
        assignments = replica_devices(settings, settings.replicas, _gpu_count())
        if settings.metrics_port >= 0:  # bound before any child starts, so a failure here leaves none behind
            metrics_server, bound = _serve_metrics(settings.host, settings.metrics_port, run_dir)
            log.info("metrics of %d processes on %s:%d", len(assignments) + frontends, settings.host,
                     bound)
        sockets = [os.path.join(run_dir, f"engine-{i}.sock") for i in range(len(assignments))]
        for i, (device, devices) in enumerate(assignments):
            role = Role(ENGINE, run_dir, str(i), engine_socket=sockets[i]) if settings.frontends else \
                Role(REPLICA, run_dir, str(i))
            # Engines serve no client: only replicas and front ends take the ports.
            env = child_environment(settings, role, device, devices, port,
                                    http_port=-1 if settings.frontends else http_port)
            children.append(subprocess.Popen(command, env=env))
            log.info("%s %d (pid %d) on %s%s", "engine" if settings.frontends else "replica", i, children[-1].pid,
                     devices or device, "" if settings.frontends else f", gRPC port {port}, REST port {http_port}")
        for j in range(frontends):
            name = f"frontend-{j}"
            # A native front end's partner serves gRPC on a private socket; the native one holds the public port.
            partner = os.path.join(run_dir, f"{name}.sock") if native is not None else ""
            env = child_environment(settings, Role(FRONTEND, run_dir, name, tuple(sockets), partner_socket=partner),
                                    "cpu", "", port, http_port=http_port)
            env["CUDA_VISIBLE_DEVICES"] = ""  # a front end never touches a GPU: it terminates RPCs, talks to engines
            children.append(subprocess.Popen(command, env=env))
            if native is None:
                log.info("front end %d (pid %d), gRPC port %d, REST port %d", j, children[-1].pid, port, http_port)
                continue
            natives.append(subprocess.Popen(
                native_frontends.command(native, settings, name, sockets, partner, port, token_digests,
                                         os.path.join(run_dir, "regions"))))
            children.append(natives[-1])
            log.info("front end %d: native (pid %d) on gRPC port %d, its Python partner (pid %d) on unix:%s and REST "
                     "port %d", j, children[-1].pid, port, children[-2].pid, partner, http_port)

        stop_by: list[float] = []  # when children still running after a stop began are killed
        # A stop with native front ends goes in two steps: they drain first (their partners still take the last
        # report), then every other child. Until then, the signal that the others are still to get.
        then: list[int] = []

        def forward(signum, _frame) -> None:
            first = not stopping.is_set()
            if first:
                stages = 2 if natives else 1
                stop_by.append(time.monotonic() + stages * (settings.grace_period_s + STOP_MARGIN_S))
            stopping.set()
            if first and any(n.poll() is None for n in natives):
                then.append(signum)
                targets = natives
            else:
                targets = children
            for child in targets:
                if child.poll() is None:
                    child.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        code = 0
        while True:
            exited = [c for c in children if c.poll() is not None]
            if len(exited) == len(children):
                break
            if exited and not stopping.is_set():
                bad = exited[0]
                log.error("replica pid %d exited with %s; stopping the others", bad.pid, bad.returncode)
                code = 1
                forward(signal.SIGTERM, None)
            if then and all(n.poll() is not None for n in natives):  # the native front ends are done
                forward(then.pop(), None)
            if stop_by and time.monotonic() > stop_by[0]:
                stuck = [c.pid for c in children if c.poll() is None]
                log.error("children %s did not stop within the grace period; killing them", stuck)
                code = code or 1
                break  # the finally clause kills them
            time.sleep(0.1)
        codes = [c.returncode for c in children if c.returncode is not None]
        return code or max((abs(c) for c in codes), default=0)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        if metrics_server is not None:
            metrics_server.close()
        reserved.close()
        if reserved_http is not None:
            reserved_http.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _serve_metrics(host: str, port: int, run_dir: str):
    """The replicas' metrics, summed by prometheus_client's multiprocess collector, plus NVML GPU metrics."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from ..metrics import NvmlCollector, serve_metrics_http

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.path.join(run_dir, "metrics"))
    gpus = NvmlCollector.create()
    if gpus is not None:
        registry.register(gpus)
    server = serve_metrics_http(registry, host, port)
    return server, server.port
