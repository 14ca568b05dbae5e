"""Deployment files: Dockerfile lint, Kubernetes manifests against the API schema, compose wiring."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ..conftest import REPO

DEPLOY = REPO / "deploy"


def _tool(name: str) -> str:
    """A console script of a test dependency: beside this Python (a virtual environment), else on PATH."""
    beside = Path(sys.executable).parent / name
    path = str(beside) if beside.exists() else shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (a test dependency)")
    return path


def test_dockerfile_is_hadolint_clean():
    proc = subprocess.run([_tool("hadolint"), str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _healthcheck_command() -> list[str]:
    """The Dockerfile's HEALTHCHECK command (JSON form), its continuation lines joined."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("HEALTHCHECK"))
    return json.loads(line.split(" CMD ", 1)[1])


def test_the_images_healthcheck_follows_the_servers_port(tmp_path):
    """The HEALTHCHECK asks the port the server listens on (VOXSERVE_GRPC_PORT, as the server reads it), so a
    container run on another port is not reported unhealthy; a port with nothing behind it is."""
    from ..conftest import serve_process
    from ..e2e.test_lifecycle import _free_port

    command = _healthcheck_command()
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    with serve_process(tmp_path / "log", "--device", "cpu") as srv:
        from voxserve.client import Client

        from .test_lifecycle import _wait_for

        with Client(srv.url, timeout_s=5) as c:
            _wait_for(c.is_ready, 120, "the server to be ready")
        ok = subprocess.run(command, env={**env, "VOXSERVE_GRPC_PORT": str(srv.grpc_port)},
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        down = subprocess.run(command, env={**env, "VOXSERVE_GRPC_PORT": str(_free_port())},
                              capture_output=True, text=True, timeout=60)
        assert down.returncode != 0


def test_kubernetes_manifests_validate():
    manifests = sorted(str(p) for p in (DEPLOY / "k8s").glob("*.yaml"))
    assert len(manifests) >= 3
    proc = subprocess.run([_tool("kubernetes-validate"), "--strict", *manifests], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kubernetes_drain_fits_the_grace_period():
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    spec = deployment["spec"]["template"]["spec"]
    container = spec["containers"][0]
    args = container["args"]
    drain_s = float(args[args.index("--grace-period-s") + 1])
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > drain_s + pre_stop_s
    assert container["readinessProbe"]["grpc"]["port"] == 8001  # grpc.health.v1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8002"


def test_compose_wires_server_prometheus_and_grafana():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["voxserve"]["gpus"] == "all"
    assert {"8000:8000", "8001:8001", "8002:8002"} <= set(services["voxserve"]["ports"])
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            source = volume.split(":")[0]
            assert (DEPLOY / source).exists(), volume
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["voxserve:8002"]
