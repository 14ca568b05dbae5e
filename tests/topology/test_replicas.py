"""--replicas: several server processes behind one port, sharing shared-memory regions and metrics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid

import grpc
import numpy as np
import pytest
import torch

from voxserve.client import Client, InferenceError, SharedMemoryBuffer
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.core.model import relative_error
from voxserve.server.core.stats import ModelStats
from voxserve.server.protocol.shm import SharedMemoryRegistry
from voxserve.server.settings import Settings, validate
from voxserve.server.topology.roles import ENGINE, FRONTEND, REPLICA, Role
from voxserve.server.topology.supervisor import child_environment, replica_devices, resolve_replicas

from ..conftest import REPO, serve_process
from ..e2e.test_lifecycle import _metric, _wait_for
from ..protocol.test_shared_memory import _segment, replace_segment

W, B = reference_weights()


def test_replica_devices_spread_over_the_gpus():
    assert replica_devices(Settings(devices="all"), 4, 2) == [("auto", "0"), ("auto", "1"), ("auto", "0"),
                                                              ("auto", "1")]
    assert replica_devices(Settings(devices="1,3"), 2, 4) == [("auto", "1"), ("auto", "3")]
    assert replica_devices(Settings(), 2, 2) == [("cuda:0", ""), ("cuda:1", "")]
    assert replica_devices(Settings(), 2, 0) == [("auto", ""), ("auto", "")]
    assert replica_devices(Settings(device="cpu"), 3, 2) == [("cpu", "")] * 3
    # One engine in front of several GPUs (--frontends with --replicas 1): a runner per GPU in that engine.
    assert replica_devices(Settings(devices="all"), 1, 2) == [("auto", "all")]


def test_child_environment_carries_every_setting():
    s = Settings(replicas=3, batching=False, max_batch=64, weights=None, metrics_port=9100)
    role = Role(REPLICA, "/run/x", "2")
    env = child_environment(s, role, "cuda:1", "", 8123, base={"VOXSERVE_WEIGHTS": "stale.safetensors"})
    assert env["VOXSERVE_BATCHING"] == "0" and env["VOXSERVE_MAX_BATCH"] == "64"
    assert env["VOXSERVE_DEVICE"] == "cuda:1" and env["VOXSERVE_GRPC_PORT"] == "8123"
    assert env["VOXSERVE_METRICS_PORT"] == "-1" and env["VOXSERVE_REPLICAS"] == "1"
    assert "VOXSERVE_WEIGHTS" not in env  # unset in the parent's settings: not inherited from its environment
    assert env["PROMETHEUS_MULTIPROC_DIR"] == "/run/x/metrics" and env["VOXSERVE_REPLICA_INDEX"] == "2"
    assert Role.from_environment(env) == role


def test_roles_travel_to_the_child_and_back():
    assert Role.from_environment({}) == Role() and not Role().supervised
    for role in (Role(REPLICA, "/run/x", "0"), Role(ENGINE, "/run/x", "1", engine_socket="/run/x/engine-1.sock"),
                 Role(FRONTEND, "/run/x", "frontend-0", ("/run/x/engine-0.sock", "/run/x/engine-1.sock"))):
        assert role.supervised and Role.from_environment(role.environment()) == role
    with pytest.raises(ValueError, match="VOXSERVE_ROLE"):
        Role.from_environment({"VOXSERVE_REPLICA_DIR": "/run/x", "VOXSERVE_ROLE": "boss"})


def test_replicas_setting_is_checked_and_defaults_to_one_per_gpu():
    validate(Settings(replicas=4))
    with pytest.raises(ValueError, match="--replicas"):
        validate(Settings(replicas=-1))
    assert resolve_replicas(Settings()) == 1
    assert resolve_replicas(Settings(devices="all"), gpu_count=2) == 2
    assert resolve_replicas(Settings(devices="all"), gpu_count=0) == 1
    assert resolve_replicas(Settings(devices="0,2,3")) == 3
    assert resolve_replicas(Settings(devices="all", replicas=1), gpu_count=8) == 1  # one process, a runner each


def test_shared_registry_is_one_registry_across_processes(tmp_path):
    """Two registries on one directory stand for two replicas: what one registers the other serves, an
    unregister through either takes effect in both, and a name is registered once."""
    shared = str(tmp_path)
    a, b = SharedMemoryRegistry(shared_dir=shared), SharedMemoryRegistry(shared_dir=shared)
    data = np.arange(64, dtype=np.uint8)
    with SharedMemoryBuffer(f"vox_rep_{uuid.uuid4().hex[:8]}", 64) as seg, \
            SharedMemoryBuffer(f"vox_rep_{uuid.uuid4().hex[:8]}", 32) as other:
        seg.write(data)
        a.register("in", seg.key, 16, 48)
        assert bytes(b.read("in", 0, 48, "input")) == data[16:].tobytes()
        assert [(r.name, r.key, r.offset, r.byte_size) for r in b.status("")] == [("in", seg.key, 16, 48)]
        with pytest.raises(ServingError) as err:
            b.register("in", seg.key, 0, 8)
        assert err.value.code == Status.ALREADY_EXISTS
        b.unregister("in")
        for reg in (a, b):
            with pytest.raises(ServingError) as err:
                reg.read("in", 0, 8, "input")
            assert err.value.code == Status.NOT_FOUND
        # Registered again (another segment) through b: a serves the new one, not its old descriptor.
        other.write(np.full(32, 7, dtype=np.uint8))
        b.register("in", other.key, 0, 32)
        assert bytes(a.read("in", 0, 4, "input")) == b"\x07" * 4
        a.close()  # one replica stopping leaves the others' registrations in place
        assert [r.name for r in b.status("")] == ["in"]
        b.unregister("")
        assert a.status("") == [] and os.listdir(shared) == []


def test_replicas_refuse_a_recreated_segment_alike(tmp_path):
    """a registered the segment (and holds its file open), b opened it on first use, c never opened it: once the
    segment is recreated under the same name, none serves old or new data until the region is registered again."""
    shared = str(tmp_path)
    a, b, c = (SharedMemoryRegistry(shared_dir=shared) for _ in range(3))
    with _segment(b"\x01" * 64) as (key, path):
        a.register("in", key, 0, 64)
        assert bytes(a.read("in", 0, 4, "input")) == bytes(b.read("in", 0, 4, "input")) == b"\x01" * 4
        replace_segment(path, b"\x02" * 64)
        for reg in (a, b, c):
            with pytest.raises(ServingError) as err:
                reg.read("in", 0, 4, "input")
            assert err.value.code == Status.INVALID_ARGUMENT and "was recreated" in err.value.message
            with pytest.raises(ServingError) as err:
                reg.write("in", 0, b"\x03", "output")
            assert err.value.code == Status.INVALID_ARGUMENT and "was recreated" in err.value.message
        c.unregister("in")
        c.register("in", key, 0, 64)
        for reg in (a, b, c):
            assert bytes(reg.read("in", 0, 4, "input")) == b"\x02" * 4
        os.unlink(path)
        for reg in (a, b, c):
            with pytest.raises(ServingError) as err:
                reg.read("in", 0, 4, "input")
            assert err.value.code == Status.INVALID_ARGUMENT and "was removed" in err.value.message
        a.unregister("")
    for reg in (a, b, c):
        reg.close()


def test_two_replicas_refuse_a_recreated_segment_over_every_connection(tmp_path):
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--replicas", "2", "--grace-period-s", "20") as srv:
        _wait_for(lambda: _metric(srv.metrics_port, "voxserve_model_ready") == 1.0, 240, "both replicas ready")
        clients = [Client(srv.url, timeout_s=60) for _ in range(16)]  # 16 connections: the kernel spreads them
        x1 = np.ones((2, 3, 5, 6, 7), np.float32)
        x2 = np.full(x1.shape, -2.0, np.float32)
        ref1, ref2 = (reference_float64(torch.from_numpy(x), W, B) for x in (x1, x2))
        with _segment(x1.tobytes()) as (key, path):
            clients[0].register_system_shared_memory("rep_in", key, x1.nbytes)
            for c in clients:  # every replica opens the segment
                assert relative_error(torch.from_numpy(c.infer_shared_memory(x1.shape, "rep_in")), ref1) <= 1e-5
            replace_segment(path, x2.tobytes())
            for c in clients:
                with pytest.raises(InferenceError) as err:
                    c.infer_shared_memory(x1.shape, "rep_in")
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "was recreated" in err.value.message
            clients[7].unregister_system_shared_memory("rep_in")
            clients[7].register_system_shared_memory("rep_in", key, x2.nbytes)
            for c in clients:
                assert relative_error(torch.from_numpy(c.infer_shared_memory(x1.shape, "rep_in")), ref2) <= 1e-5
            clients[0].unregister_system_shared_memory("rep_in")
        for c in clients:
            c.close()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0
    # Both replicas answered (all 16 connections on one replica: probability 2^-15).
    admitted = [int(n) for n in re.findall(r"stopped: (\d+) requests admitted", srv.log)]
    assert len(admitted) == 2 and min(admitted) > 0 and sum(admitted) == 3 * 16, admitted


def test_two_replicas_share_a_port_regions_and_metrics(tmp_path):
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--replicas", "2", "--grace-period-s", "20") as srv:
        proc, url, metrics_port = srv.proc, srv.url, srv.metrics_port
        # voxserve_model_ready is the minimum over live replicas: 1 once both are ready.
        _wait_for(lambda: _metric(metrics_port, "voxserve_model_ready") == 1.0, 240, "both replicas ready")
        clients = [Client(url, timeout_s=60) for _ in range(16)]  # 16 connections: the kernel spreads them
        rng = np.random.default_rng()
        x = rng.standard_normal((2, 3, 5, 6, 7), dtype=np.float32)
        ref = reference_float64(torch.from_numpy(x), W, B)
        for c in clients:
            assert relative_error(torch.from_numpy(c.infer(x)), ref) <= 1e-5
        # ModelStatistics and the metrics count every replica's requests, whichever replica answers.
        _wait_for(lambda: all(c.model_statistics().inference_count == 2 * len(clients) for c in clients[:4]), 10,
                  "statistics of both replicas")
        assert _metric(metrics_port, "voxserve_samples_total") == 2 * len(clients)

        # A region registered over one connection serves requests over every connection (both replicas).
        with SharedMemoryBuffer(f"vox_rep_{uuid.uuid4().hex[:8]}", x.nbytes) as seg:
            seg.write(x.view(np.uint8).reshape(-1))
            clients[0].register_system_shared_memory("rep_in", seg.key, x.nbytes)
            for c in clients:
                y = c.infer_shared_memory(x.shape, "rep_in")
                assert relative_error(torch.from_numpy(y), ref) <= 1e-5
            clients[5].unregister_system_shared_memory("rep_in")
            for c in clients:
                with pytest.raises(InferenceError) as err:
                    c.infer_shared_memory(x.shape, "rep_in")
                assert err.value.code == grpc.StatusCode.NOT_FOUND
        for c in clients:
            c.close()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    text = srv.log
    assert text.count("ready: model 'voxnet'") == 2
    # Both replicas served: the kernel spread the 16 connections (all on one replica: probability 2^-15).
    admitted = [int(n) for n in re.findall(r"stopped: (\d+) requests admitted", text)]
    assert len(admitted) == 2 and min(admitted) > 0 and sum(admitted) == 3 * 16, admitted


def test_statistics_of_replicas_add_up(tmp_path):
    a, b = ModelStats(), ModelStats()
    a.share(str(tmp_path), "0")
    b.share(str(tmp_path), "1")
    a.record_success(3, 1000, 100)
    a.record_execution(3, 10, 20, 30)
    b.record_success(5, 2000, 200)
    b.record_execution(5, 1, 2, 3)
    b.record_execution(3, 1, 2, 3)
    b.record_failure(7)
    assert a.combined() == a.snapshot()  # b has not published yet
    b.publish()
    both = a.combined()
    assert (both.inference_count, both.execution_count, both.success.count, both.success.ns) == (8, 3, 2, 3000)
    assert (both.fail.count, both.queue.ns, both.compute_infer.ns) == (1, 300, 24)
    assert sorted(both.batches) == [3, 5] and both.batches[3].compute_output.count == 2
    assert a.snapshot().inference_count == 3  # its own figures stay its own


# The server without the CLI's checks of its flags (which would refuse the weights before any replica starts).
SERVE_UNCHECKED = ("import sys; from voxserve.cli import build_parser; from voxserve.server.app import serve; "
                   "from voxserve.server.settings import from_namespace; "
                   "sys.exit(serve(from_namespace(build_parser().parse_args(sys.argv[1:]))))")


def test_a_replica_that_cannot_start_stops_the_server(tmp_path):
    weights = tmp_path / "bad.safetensors"
    weights.write_bytes(b"not safetensors")
    proc = subprocess.run([sys.executable, "-c", SERVE_UNCHECKED, "serve", "--host", "127.0.0.1", "--grpc-port", "0",
                           "--http-port", "0", "--metrics-port", "-1", "--device", "cpu", "--replicas", "2",
                           "--weights", str(weights)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "stopping the others" in proc.stderr or proc.stderr.count("start-up failed") == 2, proc.stderr[-2000:]
