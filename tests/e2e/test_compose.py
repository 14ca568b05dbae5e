"""deploy/docker-compose.yml brought up for real, with the README's compose command (podman-compose under podman,
the CPU override): voxserve answers, Prometheus scrapes it (its target is up) and has loaded every alert rule.
Grafana's image is not reachable here; its dashboard queries are run against a real Prometheus in
test_observability.py. Skipped, with the reason, where no container engine (or no compose) can run."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from voxserve.testing.load import free_port

from . import containers
from .containers import REPO, run

pytestmark = pytest.mark.image

LOCAL_PROMETHEUS = "localhost/voxserve-base/prometheus:bookworm"  # deploy/local-bases/make.sh
TIMEOUT_S = 180


def _compose(engine: str) -> list[str]:
    if engine.endswith("podman"):
        beside = Path(sys.executable).parent / "podman-compose"
        found = str(beside) if beside.exists() else shutil.which("podman-compose")
        if found is None:
            pytest.skip("podman-compose is not installed (a test dependency: pip install -e '.[test]')")
        return [found]
    if run(["docker", "compose", "version"], check=False).returncode != 0:
        pytest.skip("docker compose is not installed")
    return ["docker", "compose"]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _wait(what: str, timeout_s: float, probe):
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            last = probe()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(2)
    pytest.fail(f"{what} within {timeout_s} s; last: {last}")


def test_compose_runs_voxserve_and_prometheus_with_the_target_up_and_the_rules_loaded(tmp_path):
    engine = containers.engine()
    compose = _compose(engine)
    containers.built_image()  # the compose file's voxserve:latest
    (command,) = containers.readme_docker_commands(block=1)
    assert command == ("docker compose -f deploy/docker-compose.yml -f deploy/docker-compose.cpu.yml "
                       "up -d voxserve prometheus"), command
    grpc_port, metrics_port, prometheus_port = free_port(), free_port(), free_port()
    # This run's host ports and project name, so that it cannot collide with anything on the host.
    ports = tmp_path / "ports.yml"
    ports.write_text(f"""services:
  voxserve:
    ports: !override ["{grpc_port}:8001", "{metrics_port}:8002"]
  prometheus:
    ports: !override ["{prometheus_port}:9090"]
""")
    project = f"voxserve-compose-{os.getpid()}"
    words = shlex.split(command)[2:]
    files = [w for i, w in enumerate(words) if i > 0 and words[i - 1] == "-f"]
    base = [*compose, "-p", project, *(a for f in [*files, str(ports)] for a in ("-f", f))]
    up = base + words[words.index("up"):]
    env = dict(os.environ)
    if containers.local_bases():
        env.setdefault("PROMETHEUS_IMAGE", LOCAL_PROMETHEUS)
    passed = False
    try:
        proc = subprocess.run(up, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        health = [containers.voxserve_cli(), "health", "--url", f"localhost:{grpc_port}", "--timeout-s", "3"]
        _wait("voxserve ready", TIMEOUT_S, lambda: subprocess.run(health, capture_output=True).returncode == 0)
        api = f"http://localhost:{prometheus_port}/api/v1"

        def target_up():
            targets = _get(f"{api}/targets")["data"]["activeTargets"]
            up = [t for t in targets if t["labels"]["job"] == "voxserve" and t["health"] == "up"]
            return up or None

        (target,) = _wait("Prometheus' voxserve target up", TIMEOUT_S, target_up)
        assert target["scrapeUrl"] == "http://voxserve:8002/metrics", target
        shipped = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
        names = {r["alert"] for g in shipped["groups"] for r in g["rules"]}

        def rules_loaded():
            groups = _get(f"{api}/rules")["data"]["groups"]
            rules = {r["name"]: r for g in groups for r in g["rules"]}
            # Every shipped rule loaded and evaluated without error ("unknown" until its first evaluation).
            return rules if set(rules) == names and all(r["health"] == "ok" for r in rules.values()) else None

        _wait("every alert rule loaded and evaluated", TIMEOUT_S, rules_loaded)

        def model_ready():
            # The target can be up from a scrape taken while the model still warmed up (ready 0); the next
            # scrape after readiness must show 1.
            ready = _get(f"{api}/query?query=voxserve_model_ready")["data"]["result"]
            return ready if [r["value"][1] for r in ready] == ["1"] else None

        _wait("Prometheus' voxserve_model_ready 1", TIMEOUT_S, model_ready)
        passed = True
    finally:
        if not passed:  # the services' own words, for the report
            logs = subprocess.run([*base, "logs"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
            print(logs.stdout[-4000:], logs.stderr[-2000:])
        subprocess.run([*base, "down", "-t", "40"], cwd=REPO, env=env, capture_output=True, timeout=TIMEOUT_S)
