"""Deployment files: Dockerfile lint, Kubernetes manifests against the API schema, compose wiring."""

from __future__ import annotations

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
    assert {"8001:8001", "8002:8002"} <= set(services["voxserve"]["ports"])
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            source = volume.split(":")[0]
            assert (DEPLOY / source).exists(), volume
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["voxserve:8002"]
