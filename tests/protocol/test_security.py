"""TLS, mutual TLS and bearer tokens: who gets in, what everyone else is told, and start-up checks."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from voxserve.client import Client, InferenceError
from voxserve.client.security import Credentials
from voxserve.proto import pb, pb_grpc
from voxserve.server.app import VoxServer
from voxserve.server.protocol.security import SecurityConfigError, TokenAuthInterceptor, load_tokens
from voxserve.server.settings import Settings

from ..certs import CertificateAuthority
from ..conftest import REPO, running_server

TOKEN = "s3cr3t-token-0123456789abcdef"
OLD_TOKEN = "previous-token-fedcba9876543210"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = CertificateAuthority(d, "good"), CertificateAuthority(d, "rogue")
    return {"ca": ca.path, "server": ca.issue("server", server=True), "client": ca.issue("client", server=False),
            "rogue_ca": rogue.path, "rogue_client": rogue.issue("client", server=False),
            "rogue_server": rogue.issue("server", server=True)}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# accepted tokens\n{TOKEN}\n\n{OLD_TOKEN}\n")
    return path


def _x():
    return np.random.default_rng().standard_normal((2, 3, 5, 6, 7), dtype=np.float32)


def _requests_counted(srv, code: str) -> float:
    return srv.server.metrics.registry.get_sample_value("voxserve_requests_total",
                                                        {"model": "voxnet", "code": code}) or 0.0


def test_tls_serves_verified_clients_only(pki):
    server = pki["server"]
    with running_server(tls_cert=str(server.cert), tls_key=str(server.key)) as srv:
        assert srv.wait_ready()
        good = Credentials.from_files(ca_file=str(pki["ca"]))
        with Client(f"localhost:{srv.port}", credentials=good, timeout_s=30) as c:
            assert c.infer(_x()).shape == (2, 16)
        # Plaintext against a TLS port, and a client that trusts another CA: no connection.
        for creds in (Credentials(), Credentials.from_files(ca_file=str(pki["rogue_ca"]))):
            with Client(f"localhost:{srv.port}", credentials=creds, timeout_s=5) as c, \
                    pytest.raises(InferenceError) as err:
                c.infer(_x())
            assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki):
    server = pki["server"]
    with running_server(tls_cert=str(server.cert), tls_key=str(server.key), tls_client_ca=str(pki["ca"])) as srv:
        assert srv.wait_ready()
        url = f"localhost:{srv.port}"
        client = pki["client"]
        with Client(url, credentials=Credentials.from_files(ca_file=str(pki["ca"]), cert_file=str(client.cert),
                                                            key_file=str(client.key)), timeout_s=30) as c:
            assert c.infer(_x()).shape == (2, 16)
        served = srv.server.state.stats.snapshot().inference_count
        rogue = pki["rogue_client"]
        refused = [Credentials.from_files(ca_file=str(pki["ca"])),  # no client certificate
                   Credentials.from_files(ca_file=str(pki["ca"]), cert_file=str(rogue.cert), key_file=str(rogue.key))]
        for creds in refused:
            with Client(url, credentials=creds, timeout_s=5) as c, pytest.raises(InferenceError) as err:
                c.infer(_x())
            # The TLS handshake fails: no RPC reaches the server at all.
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            with Client(url, credentials=creds, timeout_s=5) as c:
                assert not c.is_ready()
        assert srv.server.state.stats.snapshot().inference_count == served


@pytest.fixture(scope="module")
def token_server(token_file):
    with running_server(auth_token_file=str(token_file)) as srv:
        assert srv.wait_ready()
        yield srv


@pytest.mark.parametrize("metadata", [
    None,
    (("authorization", "Bearer wrong-token-0123456789abcdef"),),
    (("authorization", TOKEN),),  # no scheme
    (("authorization", f"Basic {TOKEN}"),),
    (("authorization", f"Bearer {TOKEN}x"),),
    (("authorization", f"Bearer {TOKEN[:-1]}"),),
    (("authorization", "Bearer "),),
])
def test_missing_or_wrong_token_is_unauthenticated_everywhere(token_server, metadata):
    with grpc.insecure_channel(token_server.url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        calls = [
            lambda: stub.ModelInfer(pb.ModelInferRequest(model_name="voxnet"), metadata=metadata, timeout=10),
            lambda: stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=metadata, timeout=10),
            lambda: stub.ServerReady(pb.ServerReadyRequest(), metadata=metadata, timeout=10),
            lambda: stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), metadata=metadata, timeout=10),
            lambda: list(stub.ModelStreamInfer(iter([pb.ModelInferRequest(model_name="voxnet")]), metadata=metadata,
                                               timeout=10)),
            lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), metadata=metadata,
                                                         timeout=10),
            lambda: ch.unary_unary("/no.Such/Method")(b"", metadata=metadata, timeout=10),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
            assert "authorization: Bearer" in err.value.details()


def test_accepted_tokens_get_answers(token_server):
    before = _requests_counted(token_server, "UNAUTHENTICATED")
    for token in (TOKEN, OLD_TOKEN):  # both lines of the file: rotation without downtime
        with Client(token_server.url, credentials=Credentials(token=token), timeout_s=30) as c:
            assert c.is_ready()
            assert c.infer(_x()).shape == (2, 16)
            assert c.server_metadata().name == "voxserve"
    with Client(token_server.url, credentials=Credentials(token="not-the-token-0123456789"), timeout_s=10) as c, \
            pytest.raises(InferenceError) as err:
        c.infer(_x())
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert _requests_counted(token_server, "UNAUTHENTICATED") == before + 1


def test_open_health_lets_probes_through_and_nothing_else(token_file):
    with running_server(auth_token_file=str(token_file), open_health=True) as srv:
        assert srv.wait_ready()
        with grpc.insecure_channel(srv.url) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            assert stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelMetadata(pb.ModelMetadataRequest(name="voxnet"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def tls_token_server(pki, token_file, tmp_path_factory):
    """A server with TLS and tokens; yields it, the CLI's address flags, and a client token file."""
    client_token = tmp_path_factory.mktemp("client") / "token"
    client_token.write_text(TOKEN + "\n")
    server = pki["server"]
    with running_server(tls_cert=str(server.cert), tls_key=str(server.key), auth_token_file=str(token_file)) as srv:
        assert srv.wait_ready()
        yield srv, ["--url", f"localhost:{srv.port}", "--tls-ca", str(pki["ca"])], client_token


def test_cli_speaks_tls_and_token(tls_token_server, tmp_path):
    _, url, client_token = tls_token_server
    base = [sys.executable, "-m", "voxserve"]
    ok = subprocess.run([*base, "health", *url, "--auth-token-file", str(client_token)], cwd=REPO,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "ready" in ok.stdout, ok.stderr
    out = tmp_path / "y.npy"
    inf = subprocess.run([*base, "infer", *url, "--auth-token-file", str(client_token), "--random", "1,3,4,4,4",
                          "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert inf.returncode == 0, inf.stderr
    assert np.load(out).shape == (1, 16)
    denied = subprocess.run([*base, "infer", *url, "--random", "1,3,4,4,4"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    missing = subprocess.run([*base, "health", *url, "--auth-token-file", str(tmp_path / "absent")], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "absent" in missing.stderr


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tls_cert": "/nonexistent/cert.pem", "tls_key": "/nonexistent/key.pem"}, "--tls-cert '/nonexistent/cert.pem'"),
    ({"tls_cert": "CERT"}, "--tls-cert and --tls-key go together"),
    ({"tls_client_ca": "CA"}, "--tls-client-ca needs --tls-cert and --tls-key"),
    ({"auth_token_file": "SHORT"}, "use at least 16"),
    ({"auth_token_file": "EMPTY"}, "is empty"),
    ({"tls_cert": "NOTPEM", "tls_key": "NOTPEM"}, "must be PEM files"),
])
def test_bad_security_settings_stop_start_up(pki, tmp_path, overrides, message):
    (tmp_path / "short").write_text("tooshort\n")
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "notpem").write_text("hello")
    files = {"CERT": str(pki["server"].cert), "CA": str(pki["ca"]), "SHORT": str(tmp_path / "short"),
             "EMPTY": str(tmp_path / "empty"), "NOTPEM": str(tmp_path / "notpem")}
    settings = Settings(grpc_port=0, http_port=-1, metrics_port=-1, device="cpu",
                        **{k: files.get(v, v) for k, v in overrides.items()})
    with pytest.raises(SecurityConfigError, match=message.replace("(", r"\(")):
        VoxServer(settings)


def test_serve_exits_2_with_the_reason(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "voxserve", "serve", "--grpc-port", "0", "--http-port", "-1",
                           "--metrics-port", "-1",
                           "--device", "cpu", "--auth-token-file", str(tmp_path / "missing")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--auth-token-file" in proc.stderr and "cannot be read" in proc.stderr


def test_token_comparison_checks_every_byte(tmp_path):
    path = tmp_path / "t"
    path.write_text(TOKEN)
    interceptor = TokenAuthInterceptor(load_tokens(str(path)))
    assert interceptor._admits((("authorization", f"Bearer {TOKEN}"),))
    assert interceptor._admits((("authorization", f"bearer  {TOKEN} "),))
    for i in range(len(TOKEN)):
        flipped = TOKEN[:i] + chr(ord(TOKEN[i]) ^ 1) + TOKEN[i + 1:]
        assert not interceptor._admits((("authorization", f"Bearer {flipped}"),))
    assert not interceptor._admits((("x-other", TOKEN),))
    assert not interceptor._admits(())


def test_bench_speaks_tls_and_token(tls_token_server):
    _, url, client_token = tls_token_server
    proc = subprocess.run(
        [sys.executable, "-m", "voxserve", "bench", *url, "--auth-token-file", str(client_token), "--shape", "3,4,4,4",
         "--concurrency", "2", "--requests", "6", "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    level = json.loads(proc.stdout)["levels"][0]
    assert level["requests"] == 6 and level["errors"] == 0
