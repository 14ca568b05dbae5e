"""The whole server with native front ends (--frontends N --frontend-impl native): the C++ front ends hold the
public port and answer plain ModelInfer requests against the engine; every other call (shared memory, streams,
bad requests, the control RPCs) is answered by their Python partners, which also account for what the native
ones served. Skipped, with the reason, where the native front end cannot be built (server/native/build.py)."""

from __future__ import annotations

import re
import signal
import uuid

import grpc
import numpy as np
import pytest
import torch

from voxserve.client import Client, InferenceError, SharedMemoryBuffer, build_request, parse_response
from voxserve.client.security import Credentials
from voxserve.kernels import reference_float64, reference_weights
from voxserve.proto import pb
from voxserve.server.core.model import relative_error
from voxserve.testing.fuzz import ALLOWED_CODES, Mutator, seed_requests
from voxserve.testing.load import proc_stat

from ..certs import CertificateAuthority
from ..conftest import serve_process
from ..e2e.test_lifecycle import _metric, _wait_for

pytestmark = pytest.mark.native
W, B = reference_weights()
MiB = 1 << 20
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


@pytest.fixture(scope="module", autouse=True)
def native_binary():
    from voxserve.server.native import build

    problem = build.problem()
    if problem is not None:
        pytest.skip(f"the native front end cannot be built here: {problem}")


def _ref(x: np.ndarray) -> torch.Tensor:
    return reference_float64(torch.from_numpy(x), W, B)


def _ready(srv) -> None:
    _wait_for(lambda: _metric(srv.metrics_port, "voxserve_model_ready") == 1.0, 240, "engine and front ends ready")
    with Client(srv.url, timeout_s=30) as probe:  # the native front ends listen once their engine has answered
        _wait_for(probe.is_ready, 60, "the public port answering")


def test_native_front_ends_serve_every_call_kind_behind_one_port(tmp_path):
    rng = np.random.default_rng()
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--frontends", "2", "--frontend-impl", "native",
                       "--frontend-arena-bytes", str(MiB), "--grace-period-s", "20") as srv:
        _ready(srv)
        clients = [Client(srv.url, timeout_s=60) for _ in range(12)]  # 12 connections: the kernel spreads them
        x = rng.standard_normal((2, 3, 5, 6, 7), dtype=np.float32)
        for c in clients:  # the native path
            assert relative_error(torch.from_numpy(c.infer(x)), _ref(x)) <= 1e-5
            for datatype in ("FP16", "BF16"):
                y = c.infer(x, datatype)
                assert relative_error(torch.from_numpy(y), _ref(x)) <= (2e-3 if datatype == "FP16" else 2e-2)
        # A bad request is the partner's to refuse, in its words.
        with pytest.raises(InferenceError) as err:
            clients[1].infer(rng.standard_normal((1, 4, 5, 5, 5), dtype=np.float32))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "the model expects Cin=3" in err.value.message
        # Shared memory: handed to the partner, which reads the segment and answers.
        with SharedMemoryBuffer(f"vox_nat_{uuid.uuid4().hex[:8]}", x.nbytes) as seg:
            seg.write(x.view(np.uint8).reshape(-1))
            clients[0].register_system_shared_memory("nat_in", seg.key, x.nbytes)
            for c in clients:
                y = c.infer_shared_memory(x.shape, "nat_in")
                assert relative_error(torch.from_numpy(y), _ref(x)) <= 1e-5
            clients[3].unregister_system_shared_memory("nat_in")
        # A stream: through the native front end to a partner, both ways.
        with grpc.insecure_channel(srv.url) as channel:
            stream = channel.stream_stream(STREAM)
            bodies = [build_request(x, "voxnet", "FP32", request_id=f"s{i}").SerializeToString() for i in range(5)]
            answers = [pb.ModelStreamInferResponse.FromString(raw) for raw in stream(iter(bodies), timeout=60)]
        assert [a.infer_response.id for a in answers] == [f"s{i}" for i in range(5)]
        assert all(not a.error_message for a in answers)
        assert clients[5].server_metadata().name == "voxserve"
        # What the native front ends served is in the statistics and metrics, with the partners' own.
        expected = 2 * 3 * len(clients) + 2 * len(clients) + 2 * 5

        def published() -> bool:
            return clients[2].model_statistics().inference_count == expected

        _wait_for(published, 20, "every process's statistics")
        _wait_for(lambda: _metric(srv.metrics_port, "voxserve_samples_total") == expected, 20, "the samples metric")
        for c in clients:
            c.close()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0
    text = srv.log
    assert text.count("(front end of 1 engine(s))") == 2 and text.count(": native (pid") == 2
    assert "did not reach the partner" not in text  # the native ones stopped first: their last report arrived


def test_native_front_ends_check_the_token_on_every_path(tmp_path):
    token = "token-" + uuid.uuid4().hex
    (tmp_path / "tokens").write_text(token + "\n")
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--frontends", "1", "--frontend-impl", "native",
                       "--auth-token-file", str(tmp_path / "tokens"), "--open-health") as srv:
        _ready(srv)
        x = np.random.default_rng().standard_normal((1, 3, 4, 4, 4), dtype=np.float32)
        with Client(srv.url, credentials=Credentials(token=token)) as good:
            assert relative_error(torch.from_numpy(good.infer(x)), _ref(x)) <= 1e-5  # the native path
            assert good.server_metadata().name == "voxserve"  # the partner's
        for credentials in (None, Credentials(token="wrong-" + uuid.uuid4().hex)):
            with Client(srv.url, credentials=credentials) as bad:
                for call in (lambda c: c.infer(x), lambda c: c.server_metadata()):
                    with pytest.raises(InferenceError) as err:
                        call(bad)
                    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0
    assert not re.search(r"Traceback", srv.log)


def test_native_front_ends_terminate_mutual_tls(tmp_path):
    ca = CertificateAuthority(tmp_path, "native")
    server, client = ca.issue("server", server=True), ca.issue("client", server=False)
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--frontends", "1", "--frontend-impl", "native",
                       "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-client-ca",
                       str(ca.path)) as srv:
        _wait_for(lambda: _metric(srv.metrics_port, "voxserve_model_ready") == 1.0, 240, "engine and front end ready")
        url = f"localhost:{srv.grpc_port}"
        good = Credentials.from_files(ca_file=str(ca.path), cert_file=str(client.cert), key_file=str(client.key))
        with Client(url, credentials=good, timeout_s=30) as c:
            _wait_for(c.is_ready, 60, "the public port answering")
            x = np.random.default_rng().standard_normal((2, 3, 4, 5, 6), dtype=np.float32)
            assert relative_error(torch.from_numpy(c.infer(x)), _ref(x)) <= 1e-5  # the native path
            assert c.server_metadata().name == "voxserve"  # the partner's, through the native front end
        # Without a client certificate, or in plaintext: no connection, on either path.
        for credentials in (Credentials.from_files(ca_file=str(ca.path)), Credentials()):
            with Client(url, credentials=credentials, timeout_s=5) as c:
                with pytest.raises(InferenceError) as err:
                    c.infer(x)
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                assert not c.is_ready()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0


def test_mutated_requests_get_the_python_front_ends_answers_through_native_ones(tmp_path, server):
    """The native fast path takes only what the Python path would serve and hands it everything else: the same
    mutated bodies get the same status code and message from native front ends as from a Python server (``server``,
    the same model in one process), and the same outputs where both answer OK."""
    mutator = Mutator(seed_requests(), seed=int(np.random.SeedSequence().entropy % 2**32), byte_level=0.5)
    bodies = [mutator.next() for _ in range(300)]

    def answers(url: str) -> list[tuple[grpc.StatusCode, str, np.ndarray | None]]:
        out = []
        with grpc.insecure_channel(url) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            for body in bodies:
                try:
                    response = pb.ModelInferResponse.FromString(infer(body, timeout=60))
                    out.append((grpc.StatusCode.OK, "", parse_response(response)))
                except grpc.RpcError as exc:
                    out.append((exc.code(), exc.details() or "", None))
        return out

    expected = answers(server.url)
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--frontends", "1", "--frontend-impl",
                       "native") as srv:
        _ready(srv)
        got = answers(srv.url)
        with Client(srv.url, timeout_s=30) as c:  # and it still serves
            x = np.random.default_rng().standard_normal((1, 3, 4, 4, 4), dtype=np.float32)
            assert relative_error(torch.from_numpy(c.infer(x)), _ref(x)) <= 1e-5
    assert {code for code, _, _ in got} <= ALLOWED_CODES
    served = 0
    for (code, message, y), (want_code, want_message, want_y), body in zip(got, expected, bodies, strict=True):
        assert (code, message) == (want_code, want_message), body.hex()[:200]
        if y is not None:
            served += 1
            assert y.shape == want_y.shape and np.allclose(y, want_y, rtol=1e-5, atol=1e-7, equal_nan=True)
    assert served > 0  # the fast path took some


def test_every_child_stops_when_the_supervisor_is_killed(tmp_path):
    """SIGKILL leaves the supervisor no chance to pass anything on: the native front end, its partner and the engine
    must notice by themselves (the native one as the Python children do: a signal on its parent's death)."""
    with serve_process(tmp_path / "server.log", "--device", "cpu", "--frontends", "1", "--frontend-impl", "native",
                       "--grace-period-s", "2") as srv:
        _ready(srv)
        log = (tmp_path / "server.log").read_text()
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", log)]
        assert len(pids) == 3, log  # the engine, the native front end and its partner
        srv.proc.kill()
        srv.proc.wait()

        def gone(pid: int) -> bool:
            try:
                return proc_stat(f"/proc/{pid}/stat")[1][0] == "Z"  # a zombie has exited
            except FileNotFoundError:
                return True

        _wait_for(lambda: all(gone(p) for p in pids), 60, "every child to exit")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_shared_memory_on_the_native_fast_path_on_a_gpu(tmp_path):
    """A client process's device memory (a real CUDA IPC export) through two native front ends and two engines:
    the native front ends take the requests themselves (an INFER_REGION record to the least busy engine on the
    region's device), outputs written into the client's memory or answered in the response, FP32 and FP16 within
    fp32 of float64; the bytes counted as CUDA shared memory's; a request after the unregistration goes to the
    partner and is NOT_FOUND there."""
    from ..cuda_exporter import Exporter
    from .test_frontends import _cuda_round_through, _cuda_shm_bytes

    x = np.random.default_rng().standard_normal((4, 3, 16, 32, 32), dtype=np.float32)
    with serve_process(tmp_path / "server.log", "--frontends", "2", "--frontend-impl", "native", "--replicas", "2",
                       "--grace-period-s", "20") as srv, Exporter() as exporter:
        _ready(srv)
        for datatype in ("FP32", "FP16"):
            _cuda_round_through(srv.url, exporter, x, datatype)
        # 17 requests of each datatype, none on the wire; the native front ends report them every 20 ms
        expected = 17 * (x.nbytes + x.nbytes // 2)
        _wait_for(lambda: _cuda_shm_bytes(srv.metrics_port) >= expected, 10, "the requests' reports")
        assert _cuda_shm_bytes(srv.metrics_port) == expected
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=90) == 0
    # Every served request went by region from a native front end (the 4 refused after the unregistration were
    # the partners').
    by_region = [int(n) for n in re.findall(r"stopped: infer records \d+, of which by region (\d+)", srv.log)]
    assert len(by_region) == 2 and sum(by_region) == 2 * 17, srv.log
