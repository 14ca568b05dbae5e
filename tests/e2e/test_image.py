"""The image built and run for real, with the README's docker commands: `make image`, then the container on free
ports answers `voxserve health`, an inference matching float64, /metrics and its HEALTHCHECK, and drains on
`stop` under load (exit 0; every request answered OK or refused UNAVAILABLE, none lost). The torch layer's cache
key carries TORCH_SPEC. Skipped, with the reason, where neither podman nor docker can run containers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch
from packaging.requirements import Requirement

from voxserve.client import Client, InferenceError, build_request
from voxserve.kernels import reference_float64, reference_weights
from voxserve.proto import pb
from voxserve.testing.load import closed_loop, free_port, open_loop

from . import containers
from .containers import run
from .test_lifecycle import _metric

pytestmark = pytest.mark.image

DRAIN_REFUSAL = "is shutting down; retry on another replica"
READY_TIMEOUT_S = 300


@dataclass
class Container:
    engine: str
    image: str
    name: str
    grpc_port: int
    metrics_port: int
    health: list[str]
    metrics: str
    stop: list[str]
    http_port: int

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def logs(self) -> str:
        proc = run([self.engine, "logs", self.name], check=False)
        return proc.stdout + proc.stderr

    def inspect(self, template: str) -> str:
        return run([self.engine, "inspect", "--format", template, self.name]).stdout.strip()


def _localise(command: str, engine: str, name: str, grpc_port: int, metrics_port: int, http_port: int) -> str:
    """A README command with this test's engine, ports and container name; every README command must match one of
    the forms below, so that the block cannot drift from what runs here."""
    for old, new in (("-p 8001:8001", f"-p {grpc_port}:8001"), ("-p 8002:8002", f"-p {metrics_port}:8002"),
                     ("-p 8000:8000", f"-p {http_port}:8000"),
                     ("localhost:8001", f"localhost:{grpc_port}"), ("localhost:8002", f"localhost:{metrics_port}"),
                     ("--name voxserve ", f"--name {name} ")):
        command = command.replace(old, new)
    if command.startswith("docker "):
        command = f"{engine} {command[len('docker '):]}"
    if re.fullmatch(rf"{engine} stop( -t \d+)? voxserve", command):
        command = command[: -len("voxserve")] + name
    return command


@pytest.fixture(scope="module")
def container():
    engine = containers.engine()
    image = containers.built_image()
    commands = containers.readme_docker_commands()
    assert commands[0] == "make image", commands
    name = f"voxserve-test-{os.getpid()}"
    grpc_port, metrics_port, http_port = free_port(), free_port(), free_port()
    local = [_localise(c, engine, name, grpc_port, metrics_port, http_port) for c in commands[1:]]
    assert len(local) == 4, local
    start, health, metrics, stop = local
    assert start == (f"{engine} run -d --name {name} -p {http_port}:8000 -p {grpc_port}:8001 -p {metrics_port}:8002 "
                     f"voxserve"), start
    assert health == f"voxserve health --url localhost:{grpc_port}", health
    assert metrics.startswith(f"curl -fsS localhost:{metrics_port}/metrics"), metrics
    assert re.fullmatch(rf"{engine} stop( -t \d+)? {name}", stop), stop
    health_argv = [containers.voxserve_cli(), *shlex.split(health)[1:], "--timeout-s", "3"]
    box = Container(engine, image, name, grpc_port, metrics_port, health_argv, metrics, shlex.split(stop), http_port)
    run(shlex.split(start))
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while subprocess.run(box.health, capture_output=True, timeout=60).returncode != 0:
            if box.inspect("{{.State.Running}}") != "true":
                pytest.fail(f"the container exited before it was ready:\n{box.logs()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"not ready within {READY_TIMEOUT_S} s:\n{box.logs()[-4000:]}")
            time.sleep(1)
        yield box
    finally:
        run([engine, "rm", "-f", name], check=False)


def test_the_container_serves_health_inference_and_metrics(container):
    assert subprocess.run(container.health, capture_output=True, timeout=60).returncode == 0
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 32, 32), dtype=np.float32)
    with Client(container.url, timeout_s=60) as c:
        y = c.infer(x)
    w, b = reference_weights()
    ref = reference_float64(torch.from_numpy(x), w, b).numpy()
    assert y.shape == (2, 16)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 1e-5
    scrape = subprocess.run(container.metrics, shell=True, capture_output=True, text=True, timeout=60)
    assert scrape.returncode == 0, scrape.stderr
    assert re.search(r'^voxserve_model_ready\{model="voxnet"\} 1\.0$', scrape.stdout, re.M), scrape.stdout
    body = run(["curl", "-fsS", f"localhost:{container.metrics_port}/metrics"]).stdout
    assert re.search(r'^voxserve_requests_total\{code="OK",model="voxnet"\} [1-9]', body, re.M), body[-3000:]
    # The REST port is published as the README says, and answers the same.
    request = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                      "data": x.ravel().tolist()}]})
    answer = run(["curl", "-fsS", f"localhost:{container.http_port}/v2/models/voxnet/infer", "--data-binary", "@-"],
                 input=request).stdout
    np.testing.assert_array_equal(np.asarray(json.loads(answer)["outputs"][0]["data"], np.float32).reshape(2, 16), y)


def test_the_healthcheck_is_in_the_image_and_reports_healthy(container):
    config = run([container.engine, "image", "inspect", "--format", "{{json .Config.Healthcheck}}",
                  container.image]).stdout
    assert "voxserve health" in config, f"no HEALTHCHECK in the image (OCI format drops it): {config}"
    if container.engine.endswith("podman"):
        check = run([container.engine, "healthcheck", "run", container.name], check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        assert container.inspect("{{.State.Health.Status}}") == "healthy"
    else:  # docker runs it itself every 10 s
        deadline = time.monotonic() + 60
        while container.inspect("{{.State.Health.Status}}") != "healthy":
            assert time.monotonic() < deadline, container.inspect("{{json .State.Health}}")
            time.sleep(1)


def test_the_torch_layer_is_keyed_on_the_torch_spec(container):
    """The torch RUN reads TORCH_SPEC (its value is in the layer's history, which the engine's cache compares),
    and this engine does not reuse a RUN layer built with another value of an argument it uses."""
    history = run([container.engine, "history", "--no-trunc", "--format", "{{.CreatedBy}}", container.image]).stdout
    torch_steps = [line for line in history.splitlines() if "pip install" in line and "TORCH_SPEC" in line]
    assert torch_steps, history
    spec = re.search(r"TORCH_SPEC=(\S+)", torch_steps[0])
    assert spec, torch_steps
    version = run([container.engine, "run", "--rm", "--entrypoint", "python", container.image, "-c",
                   "import torch; print(torch.__version__, torch.version.cuda)"], timeout_s=300).stdout.split()
    # The torch installed is the one the spec asked for (PyPI's CUDA build reports 2.13.0+cu130 for torch==2.13.0).
    requirement = Requirement(spec.group(1).strip("'\""))
    assert requirement.name == "torch" and requirement.specifier.contains(version[0]), (version, spec.group(1))
    fmt = ["--format", "docker"] if container.engine.endswith("podman") else []
    tags = []
    for value in ("cpu-index", "cuda-index", "cpu-index"):
        tag = f"voxserve-cachekey:{os.getpid()}-{len(tags)}"
        proc = subprocess.run([container.engine, "build", "--pull=never", *fmt, "--build-arg", f"TORCH_SPEC={value}",
                               "-t", tag, "-f", "-", "."], input=f"FROM {container.image}\nARG TORCH_SPEC\n"
                              "RUN echo \"$TORCH_SPEC $(date +%s%N)\" > /tmp/spec\n", capture_output=True,
                              text=True, timeout=300, cwd=containers.REPO / "deploy" / "local-bases")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        tags.append(tag)
    try:
        ids = [run([container.engine, "image", "inspect", "--format", "{{.Id}}", t]).stdout.strip() for t in tags]
        assert ids[0] != ids[1], "a RUN layer built with another TORCH_SPEC was reused"
        assert ids[0] == ids[2], "the same TORCH_SPEC did not hit the cache (the test would prove nothing)"
    finally:
        run([container.engine, "rmi", "-f", *tags], check=False)


def _answered_ok(container) -> int:
    body = run(["curl", "-fsS", f"localhost:{container.metrics_port}/metrics"]).stdout
    return sum(int(float(v)) for v in re.findall(r'^voxserve_requests_total\{code="OK",model="voxnet"\} (\S+)$',
                                                   body, re.M))


def test_stop_drains_under_load_and_exits_0(container):
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 32, 32), dtype=np.float32)
    body = build_request(x, "voxnet", "FP32").SerializeToString()
    capacity = asyncio.run(closed_loop(container.url, body, 4, 1.0))
    assert capacity.ok > 0, capacity.codes
    ok_before = _answered_ok(container)
    stops: list[tuple[int, float]] = []

    # A long request in flight when the stop comes, so that the drain lasts while the load keeps arriving (at 0.7
    # of capacity the server is often idle for a moment: a stop then closed the port at once, and no request met
    # the drain's refusal, as seen in CI).
    long_request = np.random.default_rng(2).standard_normal((64, 3, 16, 32, 32), dtype=np.float32)
    long_answers: list[np.ndarray | InferenceError] = []

    def long_call(client: Client) -> None:
        try:
            long_answers.append(client.infer(long_request))
        except InferenceError as exc:  # it came after the stop after all (a busy host): refused by the drain
            long_answers.append(exc)

    def stop() -> None:
        with Client(container.url, timeout_s=60) as client:
            running = threading.Thread(target=long_call, args=(client,))
            running.start()
            deadline = time.monotonic() + 30
            while (_metric(container.metrics_port, "voxserve_inflight_requests") or 0) < 1 \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.monotonic()
            proc = subprocess.run(container.stop, capture_output=True, text=True, timeout=120)
            stops.append((proc.returncode, time.monotonic() - t0))
            running.join(60)

    load = asyncio.run(open_loop(container.url, body, 0.7 * capacity.rate(), 6.0, timeout_s=60, keep_outputs=True,
                                 during=stop))
    (stop_rc, stop_s), = stops
    exit_code = container.inspect("{{.State.ExitCode}}")
    logs = container.logs()
    print(f"offered {load.offered}: {dict(load.codes)}; stop took {stop_s:.1f} s, exit {exit_code}")
    assert stop_rc == 0 and exit_code == "0", logs[-3000:]
    # Every request has its final status, none lost to a timeout: answered OK, or refused UNAVAILABLE (by the
    # drain, or by the closed port once the server was gone), or CANCELLED by gRPC's core closing a stream the
    # server had not taken yet (the accounts below show it never admitted those).
    assert load.answered == load.offered and load.ok > 0
    assert set(load.codes) <= {"OK", "UNAVAILABLE", "CANCELLED"}, load.details
    refused_in_drain = any(DRAIN_REFUSAL in details for _, details in load.details) or (
        isinstance(long_answers[0], InferenceError) and DRAIN_REFUSAL in str(long_answers[0]))
    assert refused_in_drain, ("the drain was not exercised", load.details)
    # The server's own accounts: all it admitted it answered, none abandoned at the end of the grace period, and
    # those answers are exactly the ones this client received (with the ones before the load).
    accounts = re.search(r"stopped: (\d+) requests admitted, (\d+) answered OK, (\d+) abandoned", logs)
    assert accounts, logs[-3000:]
    admitted, answered, abandoned = map(int, accounts.groups())
    (long_answer,) = long_answers  # answered in the drain, or (sent as the stop came) refused by it
    if isinstance(long_answer, InferenceError):
        assert long_answer.code == grpc.StatusCode.UNAVAILABLE and DRAIN_REFUSAL in str(long_answer), long_answer
    long_ok = int(not isinstance(long_answer, InferenceError))
    assert abandoned == 0 and admitted == answered == ok_before + load.ok + long_ok, (admitted, answered, abandoned,
                                                                                      ok_before, load.ok, long_ok)
    w, b = reference_weights()
    if long_ok:
        ref_long = reference_float64(torch.from_numpy(long_request), w, b).numpy()
        assert np.linalg.norm(long_answer - ref_long) / np.linalg.norm(ref_long) <= 1e-5
    ref = reference_float64(torch.from_numpy(x), w, b).numpy()
    for raw in load.outputs:
        y = np.frombuffer(pb.ModelInferResponse.FromString(raw).raw_output_contents[0], np.float32).reshape(1, 16)
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 1e-5
