"""Metrics as Prometheus sees them: names and types, the shipped config and rules, and every dashboard
and alert expression evaluated by a real Prometheus server scraping a voxserve under traffic."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from voxserve.client import Client, InferenceError

from ..conftest import REPO

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "voxserve.json"
RULES = DEPLOY / "prometheus" / "alerts.yml"
# The product's metric names (the observability issue fixes them) and their types.
EXPECTED = {
    "voxserve_requests": "counter",
    "voxserve_request_duration_seconds": "histogram",
    "voxserve_queue_duration_seconds": "histogram",
    "voxserve_compute_duration_seconds": "histogram",
    "voxserve_batch_size": "histogram",
    "voxserve_samples": "counter",
    "voxserve_input_bytes": "counter",
    "voxserve_inflight_requests": "gauge",
    "voxserve_queue_depth": "gauge",
    "voxserve_model_ready": "gauge",
    "voxserve_build_info": "gauge",
}
GPU_METRICS = ("voxserve_gpu_utilization_ratio", "voxserve_gpu_memory_used_bytes", "voxserve_gpu_memory_total_bytes")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                      reason="Prometheus (Debian package 'prometheus') is not installed")


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _traffic(url: str) -> None:
    rng = np.random.default_rng()
    with Client(url) as c:
        for n in (1, 2, 3):
            c.infer(rng.standard_normal((n, 3, 5, 6, 7), dtype=np.float32))
        with pytest.raises(InferenceError):
            c.infer(np.zeros((1, 3, 2, 6, 7), np.float32))


def test_metric_names_and_types(server):
    _traffic(server.url)
    families = {f.name: f for f in text_string_to_metric_families(_scrape(server.server.metrics_port))}
    for name, kind in EXPECTED.items():
        assert name in families, f"{name} missing"
        assert families[name].type == kind, (name, families[name].type)
    codes = {s.labels["code"] for s in families["voxserve_requests"].samples if s.name.endswith("_total")}
    assert {"OK", "INVALID_ARGUMENT"} <= codes
    build = [s for s in families["voxserve_build_info"].samples]
    assert build and build[0].labels["device"] == "cpu" and build[0].labels["kernel"] == "reference-cpu"
    assert not any(name in families for name in GPU_METRICS)  # no GPU here: no GPU series
    ready = [s.value for s in families["voxserve_model_ready"].samples]
    assert ready == [1.0]
    # Beyond the fixed names: start-up phases and device faults (zero until one happens).
    phases = {s.labels["phase"]: s.value for s in families["voxserve_startup_duration_seconds"].samples}
    assert set(phases) == {"weights", "kernel", "warmup"} and all(v >= 0 for v in phases.values())
    assert phases["warmup"] > 0
    failures = {s.labels["reason"] for s in families["voxserve_execution_failures"].samples
                if s.name.endswith("_total")}
    assert failures == {"out_of_memory", "device_error"}


def test_latency_buckets_flag_is_validated():
    from voxserve.server.settings import Settings, validate

    validate(Settings(latency_buckets_s="0.001,0.01,1"))
    with pytest.raises(ValueError, match="strictly increasing"):
        validate(Settings(latency_buckets_s="0.1,0.01"))


@needs_prometheus
def test_promtool_accepts_config_and_rules():
    for args in (["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")], ["check", "rules", str(RULES)]):
        proc = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"].replace("$model", ".*")) for p in dash["panels"] for t in p["targets"]]


def _alert_exprs() -> list[tuple[str, str]]:
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    out = []
    for rule in (r for g in groups for r in g["rules"]):
        # The quantity each alert watches, without its threshold (a threshold filters a healthy
        # server's series away; the test checks that the quantity itself is computed from real data).
        expr = re.sub(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.]+\s*$", "", rule["expr"].strip())
        out.append((rule["alert"], expr))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


@needs_prometheus
def test_every_dashboard_and_alert_query_returns_data(server, tmp_path):
    metrics_port, prom_port = server.server.metrics_port, _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{json.dumps(str(RULES))}]\n"
        f"scrape_configs: [{{job_name: voxserve, static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]}}]\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))  # noqa: SIM115
    try:
        deadline = time.monotonic() + 60
        scrapes = 0.0
        while time.monotonic() < deadline:  # traffic while Prometheus takes at least 4 scrapes
            _traffic(server.url)
            try:
                result = _query(prom_port, 'count_over_time(up{job="voxserve"}[1m])')["data"]["result"]
                scrapes = float(result[0]["value"][1]) if result else 0.0
            except OSError:
                scrapes = 0.0
            if scrapes >= 4:
                break
            time.sleep(0.5)
        assert scrapes >= 4, (tmp_path / "prometheus.log").read_text()[-2000:]
        assert _query(prom_port, 'up{job="voxserve"}')["data"]["result"][0]["value"][1] == "1"
        for title, expr in _dashboard_exprs() + _alert_exprs():
            if any(name in expr for name in GPU_METRICS):
                continue  # no GPU on this machine: those series are absent by design
            body = _query(prom_port, expr)
            assert body["status"] == "success", (title, expr, body)
            assert body["data"]["result"], f"{title}: no data for {expr}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
