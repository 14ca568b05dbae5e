"""The REST port (KServe v2 HTTP/REST with Triton's binary-tensor extension): standard clients unchanged
(tritonclient.http, KServe's REST client), the same answers as gRPC, and every hostile body answered 4xx."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import socket
import threading
import time
import unittest.mock
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from voxserve.client import Client
from voxserve.datatypes import bf16_bits_to_float32, float32_to_bf16_bits
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.errors import ServingError
from voxserve.server.core.model import relative_error
from voxserve.server.protocol import admission

from ..certs import CertificateAuthority
from ..conftest import running_server

httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] (a test dependency) is not installed")

MODEL = "voxnet"


def _url(server) -> str:
    return f"127.0.0.1:{server.server.http_port}"


def _request(server, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request with the standard library: (status, headers, body), errors included."""
    request = urllib.request.Request(f"http://{_url(server)}{path}", data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _error(body: bytes) -> str:
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    return doc["error"]


def _infer_body(x: np.ndarray, datatype: str = "FP32") -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": datatype,
                                   "data": x.ravel().tolist()}]}).encode()


# --- standard clients --------------------------------------------------------------


def test_tritonclient_http_health_metadata_config_statistics(server):
    client = httpclient.InferenceServerClient(_url(server))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert not client.is_model_ready("nope")
    metadata = client.get_model_metadata(MODEL)
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, -1, -1, -1]}]
    assert metadata["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 16]}]
    assert client.get_server_metadata()["name"] == "voxserve"
    config = client.get_model_config(MODEL)
    assert config["input"][0]["dims"] == [3, -1, -1, -1] and config["max_batch_size"] == server.settings.max_batch
    with pytest.raises(httpclient.InferenceServerException, match="not served here"):
        client.get_model_metadata("nope")
    before = client.get_inference_statistics(MODEL)["model_stats"][0]["inference_count"]
    x = np.zeros((2, 3, 4, 4, 4), np.float32)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    client.infer(MODEL, [inp])
    assert client.get_inference_statistics(MODEL)["model_stats"][0]["inference_count"] == before + 2


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_http_infer_matches_float64_and_grpc(server, rng, datatype, binary):
    w, b = reference_weights()
    x = torch.randn((3, 3, 5, 9, 17), generator=rng).numpy()
    if datatype == "FP16":
        x_sent, wire = x.astype(np.float16), x.astype(np.float16)
        exact = torch.from_numpy(x_sent.astype(np.float32))
    elif datatype == "BF16":  # tritonclient takes ml_dtypes' bfloat16 (a dependency of its own)
        ml_dtypes = pytest.importorskip("ml_dtypes")
        wire = float32_to_bf16_bits(x)
        x_sent = wire.view(ml_dtypes.bfloat16)
        exact = torch.from_numpy(bf16_bits_to_float32(wire).reshape(x.shape))
    else:
        x_sent, wire, exact = x, x, torch.from_numpy(x)
    client = httpclient.InferenceServerClient(_url(server))
    inp = httpclient.InferInput("input", list(x.shape), datatype)
    if datatype == "BF16" and not binary:  # tritonclient sends BF16 binary only: JSON numbers by hand
        body = _infer_body(bf16_bits_to_float32(wire).reshape(x.shape), "BF16")
        status, _, out = _request(server, "POST", f"/v2/models/{MODEL}/infer", body)
        assert status == 200, out
        y = np.asarray(json.loads(out)["outputs"][0]["data"], np.float32).reshape(3, 16)
    else:
        inp.set_data_from_numpy(x_sent, binary_data=binary)
        result = client.infer(MODEL, [inp], outputs=[httpclient.InferRequestedOutput("output", binary_data=binary)],
                              request_id="r-1")
        assert result.get_response()["id"] == "r-1"
        y = result.as_numpy("output").copy()
    assert y.shape == (3, 16) and y.dtype == np.float32
    assert relative_error(torch.from_numpy(y), reference_float64(exact, w, b)) <= 1e-5
    with Client(server.url) as grpc_client:  # the same bits as gRPC's answer
        np.testing.assert_array_equal(y, grpc_client.infer(exact.numpy(), datatype=datatype))


def test_binary_outputs_follow_the_json_header(server):
    """binary_data_output: the output's bytes come after the JSON part, whose length the header gives."""
    x = np.random.default_rng().standard_normal((2, 3, 4, 4, 4), dtype=np.float32)
    header = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    status, headers, body = _request(server, "POST", f"/v2/models/{MODEL}/infer", header + x.tobytes(),
                                     {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, body
    n = int(headers["Inference-Header-Content-Length"])
    doc = json.loads(body[:n])
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 2 * 16 * 4}
    y = np.frombuffer(body[n:], "<f4").reshape(2, 16)
    w, b = reference_weights()
    assert relative_error(torch.from_numpy(y.copy()), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5


def test_kserve_rest_client(server):
    kserve = pytest.importorskip("kserve", reason="kserve (a test dependency) is not installed")
    x = np.random.default_rng().standard_normal((2, 3, 4, 5, 6), dtype=np.float32)

    async def run():
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", retries=0))
        try:
            base = f"http://{_url(server)}"
            assert await client.is_server_live(base) and await client.is_server_ready(base)
            assert await client.is_model_ready(base, MODEL)
            inp = kserve.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=False)
            return await client.infer(base, kserve.InferRequest(MODEL, [inp]), model_name=MODEL)
        finally:
            await client.close()

    response = asyncio.run(run())
    y = response.outputs[0].as_numpy()
    w, b = reference_weights()
    assert relative_error(torch.from_numpy(np.asarray(y, np.float32)),
                          reference_float64(torch.from_numpy(x), w, b)) <= 1e-5


def test_system_shared_memory_over_rest(server):
    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    client = httpclient.InferenceServerClient(_url(server))
    x = np.random.default_rng().standard_normal((2, 3, 4, 4, 4), dtype=np.float32)
    out_bytes = 2 * 16 * 4
    name = f"rest-{time.monotonic_ns()}"
    handle = shm.create_shared_memory_region(name, f"/{name}", x.nbytes + out_bytes)
    try:
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory(name, f"/{name}", x.nbytes + out_bytes)
        assert [r["name"] for r in client.get_system_shared_memory_status()] == [name]
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_shared_memory(name, x.nbytes)
        out = httpclient.InferRequestedOutput("output")
        out.set_shared_memory(name, out_bytes, offset=x.nbytes)
        result = client.infer(MODEL, [inp], outputs=[out])
        assert result.get_output("output")["parameters"]["shared_memory_region"] == name
        y = shm.get_contents_as_numpy(handle, np.float32, [2, 16], offset=x.nbytes)
        w, b = reference_weights()
        assert relative_error(torch.from_numpy(y.copy()), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
        client.unregister_system_shared_memory(name)
        assert client.get_system_shared_memory_status() == []
    finally:
        shm.destroy_shared_memory_region(handle)


# --- errors: HTTP status + {"error": ...}, 4xx for every client mistake ------------------------------------


HOSTILE = {
    "not JSON": (b"{not json", {}, "not valid"),
    "JSON but not an object": (b"[1, 2]", {}, "must be an object"),
    "no inputs": (b"{}", {}, "has no 'inputs'"),
    "inputs not a list": (b'{"inputs": 5}', {}, "must be a JSON array"),
    "deeply nested": (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, "nested too deeply"),
    "shape of strings": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": ["a"], "data": [1]}]}', {},
                         "list of integers"),
    "data of strings": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 3, 3, 3], '
                        b'"data": ["x"]}]}', {}, "numbers only"),
    "too few values": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 3, 3, 3], '
                       b'"data": [1, 2]}]}', {}, "holds 2 values"),
    "header longer than the body": (b'{"inputs": []}', {"Inference-Header-Content-Length": "1000"}, "must be 1 to"),
    "header not a number": (b'{"inputs": []}', {"Inference-Header-Content-Length": "ten"}, "expected a byte count"),
    "binary size past the end": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 3, 3, 3], '
                                 b'"parameters": {"binary_data_size": 324}}]}0123',
                                 {"Inference-Header-Content-Length": "103"}, "runs past the body's end"),
    "bytes nobody claims": (b'{"inputs": []}0123', {"Inference-Header-Content-Length": "14"}, "every byte must"),
    "timeout not an integer": (b'{"inputs": [], "parameters": {"timeout": 1e30}}', {}, "count of microseconds"),
    "timeout of 400 digits": (b'{"inputs": [], "parameters": {"timeout": 1' + b"0" * 400 + b"}}", {}, "not valid"),
    "NaN literal": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1], "data": [NaN]}]}', {},
                    "not valid"),
    "data of booleans": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 1, 1, 1], '
                         b'"data": [true, false, true]}]}', {}, "no booleans"),
    "data of numeric strings": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 1, 1, 1], '
                                b'"data": ["0.5", "1", "2"]}]}', {}, "numbers only"),
    "data with a null": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 1, 1, 1], '
                         b'"data": [0.5, null, 2]}]}', {}, "numbers only"),
    "data of 400 digits": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1], "data": [1'
                           + b"0" * 400 + b"]}]}", {}, "not valid"),
    "nested against the shape": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 3, 3, 3], '
                                 b'"data": ' + json.dumps([[0.0] * 27] * 3).encode() + b"}]}", {}, "nested as [3, 27]"),
    "header length not plain digits": (b'{"inputs": []}' + b"0" * 10, {"Inference-Header-Content-Length": " +1_4"},
                                       "decimal digits"),
    "wrong input name": (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3, 3, 3, 3], '
                         b'"data": ' + json.dumps([0.0] * 81).encode() + b"}]}", {}, "unknown input 'x'"),
    "rank 2": (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1], "data": [1]}]}', {}, "rank 2"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_bodies_get_400_naming_the_problem(server, case):
    body, headers, expected = HOSTILE[case]
    if case == "binary size past the end":
        headers = {"Inference-Header-Content-Length": str(body.index(b"}]}") + 3)}
    status, _, out = _request(server, "POST", f"/v2/models/{MODEL}/infer", body, headers)
    assert status == 400, (status, out)
    assert expected in _error(out)
    assert _request(server, "GET", "/v2/health/ready")[0] == 200


def test_statuses_follow_the_canonical_codes(server):
    x = np.zeros((1, 3, 3, 3, 3), np.float32)
    assert _request(server, "POST", "/v2/models/nope/infer", _infer_body(x))[0] == 404
    assert _request(server, "POST", f"/v2/models/{MODEL}/versions/9/infer", _infer_body(x))[0] == 404
    status, _, body = _request(server, "GET", "/v2/no/such/route")
    assert status == 404 and "Not Found" in _error(body)
    status, _, body = _request(server, "DELETE", "/v2/health/live")
    assert status == 405 and _error(body)
    big = np.zeros((server.settings.max_request_samples + 1, 3, 3, 3, 3), np.float32)
    header = json.dumps({"inputs": [{"name": "input", "shape": list(big.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": big.nbytes}}]}).encode()
    status, _, body = _request(server, "POST", f"/v2/models/{MODEL}/infer", header + big.tobytes(),
                               {"Inference-Header-Content-Length": str(len(header))})
    assert status == 429 and "--max-request-samples" in _error(body)
    # tritonclient.http's timeout (microseconds): one microsecond has passed before the request runs
    body = json.loads(_infer_body(x))
    body["parameters"] = {"timeout": 1}
    status, _, out = _request(server, "POST", f"/v2/models/{MODEL}/infer", json.dumps(body).encode())
    assert status == 504, out


def test_classification_is_refused_not_ignored(server):
    client = httpclient.InferenceServerClient(_url(server))
    inp = httpclient.InferInput("input", [1, 3, 3, 3, 3], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 3, 3, 3, 3), np.float32))
    with pytest.raises(httpclient.InferenceServerException, match="classification") as err:
        client.infer(MODEL, [inp], outputs=[httpclient.InferRequestedOutput("output", class_count=3)])
    assert err.value.status() == "501"


def test_chunked_bodies_are_read_up_to_the_limit():
    x = np.random.default_rng().standard_normal((2, 3, 4, 4, 4), dtype=np.float32)
    with running_server(max_message_bytes=64 * 1024) as srv:
        assert srv.wait_ready()
        body = _infer_body(x)
        chunks = iter([body[i:i + 1000] for i in range(0, len(body), 1000)])
        request = urllib.request.Request(f"http://{_url(srv)}/v2/models/{MODEL}/infer", data=chunks,
                                         headers={"Transfer-Encoding": "chunked"})
        with urllib.request.urlopen(request, timeout=60) as response:
            y = np.asarray(json.loads(response.read())["outputs"][0]["data"], np.float32).reshape(2, 16)
        with Client(srv.url) as c:
            np.testing.assert_array_equal(y, c.infer(x))
        big = iter([b"[" * 1000] * 100)  # 100 kB, chunked: past the 64 KiB limit as it arrives
        request = urllib.request.Request(f"http://{_url(srv)}/v2/models/{MODEL}/infer", data=big,
                                         headers={"Transfer-Encoding": "chunked"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=60)
        assert err.value.code == 413 and "--max-message-bytes" in _error(err.value.read())


def test_a_json_part_over_max_json_bytes_gets_413():
    x = np.zeros((1, 3, 8, 8, 8), np.float32)
    with running_server(max_json_bytes=4096) as srv:
        assert srv.wait_ready()
        status, _, body = _request(srv, "POST", f"/v2/models/{MODEL}/infer", _infer_body(x))
        assert status == 413 and "--max-json-bytes" in _error(body) and "binary" in _error(body)
        header = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                         "parameters": {"binary_data_size": x.nbytes}}]}).encode()
        status, _, _ = _request(srv, "POST", f"/v2/models/{MODEL}/infer", header + x.tobytes(),
                                {"Inference-Header-Content-Length": str(len(header))})
        assert status == 200  # the same tensor as binary data


def test_connections_that_never_finish_their_headers_are_closed_and_bounded():
    """Slowloris: header bytes trickled forever held a connection forever (aiohttp has no header timeout), and
    enough of them took every file descriptor, gRPC's too. Now a connection without a request in progress is
    closed after --http-timeout-s, and past --http-max-connections a newcomer is answered 503."""
    with running_server(http_timeout_s=0.5, http_max_connections=3) as srv:
        assert srv.wait_ready()
        port = srv.server.http_port
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            for s in socks:
                s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHo")
            deadline = time.monotonic() + 10
            while len(srv.server.rest.connections.open) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            with socket.create_connection(("127.0.0.1", port)) as extra:
                extra.settimeout(10)
                reply = extra.recv(65536).decode()
            assert reply.startswith("HTTP/1.1 503") and "--http-max-connections" in reply, reply
            for s in socks:  # trickling: a byte now and then never completes the headers
                s.sendall(b"s")
            for s in socks:
                s.settimeout(10)
                assert s.recv(65536) == b""  # closed by the server
        finally:
            for s in socks:
                s.close()
        assert _request(srv, "GET", "/v2/health/live")[0] == 200


def test_tls_connections_count_from_their_accept_and_their_handshake_is_bounded(pki):
    """Over TLS a connection exists before its handshake: un-handshaken ones (a client that never speaks) count
    against --http-max-connections and are dropped after the handshake timeout, so they cannot take every
    descriptor (the watch saw them only after the handshake before, and asyncio allowed 60 s)."""
    import ssl

    with running_server(tls_cert=str(pki["server"].cert), tls_key=str(pki["server"].key), http_timeout_s=0.5,
                        http_max_connections=3) as srv:
        assert srv.wait_ready()
        port = srv.server.http_port
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            deadline = time.monotonic() + 10
            while srv.server.rest.connections.pending < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            with socket.create_connection(("127.0.0.1", port)) as extra:  # past the limit: closed at once
                extra.settimeout(5)
                assert extra.recv(1024) == b""
            for s in silent:  # the handshake never came: dropped after the timeout
                s.settimeout(10)
                assert s.recv(1024) == b""
        finally:
            for s in silent:
                s.close()
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        with urllib.request.urlopen(f"https://localhost:{port}/v2/health/live", context=context, timeout=30) as r:
            assert r.status == 200


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_a_bodys_memory_and_time_follow_the_bytes_received_not_those_announced():
    """Headers announcing 100 MB made the server allocate (and zero) 100 MB at once and gave the body 100 s
    beyond --http-timeout-s; now memory grows with what arrives, and the time allowed with it."""
    with running_server(http_timeout_s=0.5, max_message_bytes=128 * 1024 * 1024) as srv:
        assert srv.wait_ready()
        socks = []
        before = _rss_bytes()
        try:
            for _ in range(4):
                s = socket.create_connection(("127.0.0.1", srv.server.http_port))
                s.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {100 << 20}"
                          f"\r\n\r\n".encode() + b"{")
                socks.append(s)
            deadline = time.monotonic() + 10
            while srv.server.rest.in_progress < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _rss_bytes() - before < 100 << 20  # not 400 MB
            started = time.monotonic()
            for _ in range(20):  # trickling: a byte every 0.1 s
                for s in socks:
                    with contextlib.suppress(OSError):
                        s.sendall(b" ")
                time.sleep(0.1)
                if srv.server.rest.in_progress == 0:
                    break
            for s in socks:
                s.settimeout(30)
                assert s.recv(65536).decode().startswith("HTTP/1.1 408")
            assert time.monotonic() - started < 30
        finally:
            for s in socks:
                s.close()


def test_pipelined_responses_to_a_slow_reader_are_not_cut_by_the_idle_close():
    """The idle close counted a connection whose responses were still being written as idle, and cut them: a
    client reading slowly but steadily (each answer takes it longer than --http-timeout-s) lost the rest."""
    x = np.zeros((1024, 3, 3, 3, 3), np.float32)
    body = _infer_body(x)
    request = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
               .encode() + body)
    with running_server(http_timeout_s=0.3) as srv:
        assert srv.wait_ready()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.server.http_port))
        with sock:
            sock.sendall(request * 10)
            sock.settimeout(30)
            data = b""
            while data.count(b"HTTP/1.1 200") < 10:  # 32 KiB every 50 ms: each 330 kB answer takes ~0.5 s
                chunk = sock.recv(32 * 1024)
                if not chunk:
                    break
                data += chunk
                time.sleep(0.05)
        assert data.count(b"HTTP/1.1 200") == 10


def test_compressed_bodies_are_refused_unread(server):
    x = np.zeros((1, 3, 3, 3, 3), np.float32)
    status, _, body = _request(server, "POST", f"/v2/models/{MODEL}/infer", gzip.compress(_infer_body(x)),
                               {"Content-Encoding": "gzip"})
    assert status == 415 and "uncompressed" in _error(body)


def test_a_body_over_the_limit_gets_413_before_it_is_read():
    with running_server(max_message_bytes=4096) as srv:
        assert srv.wait_ready()
        with socket.create_connection(("127.0.0.1", srv.server.http_port)) as sock:
            sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {1 << 30}\r\n"
                         f"\r\n".encode())
            reply = sock.recv(65536).decode()
        assert reply.startswith("HTTP/1.1 413"), reply
        assert "--max-message-bytes" in reply


def test_expect_100_continue_is_refused_before_the_body_when_it_would_be(tmp_path):
    (tmp_path / "tokens").write_text("t" * 32 + "\n")
    with running_server(auth_token_file=str(tmp_path / "tokens"), max_message_bytes=4096) as srv:
        assert srv.wait_ready()
        for headers, expected in (("", "HTTP/1.1 401"), (f"Authorization: Bearer {'t' * 32}\r\n", "HTTP/1.1 413")):
            with socket.create_connection(("127.0.0.1", srv.server.http_port)) as sock:
                sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: "
                             f"{1 << 30}\r\nExpect: 100-continue\r\n\r\n".encode())
                sock.settimeout(30)
                reply = sock.recv(65536).decode()
            assert reply.startswith(expected) and "100 Continue" not in reply, reply
        body = _infer_body(np.zeros((1, 3, 3, 3, 3), np.float32))
        with socket.create_connection(("127.0.0.1", srv.server.http_port)) as sock:  # one that will be served
            sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {'t' * 32}"
                         f"\r\nContent-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
            sock.settimeout(30)
            assert sock.recv(65536).decode() == "HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(body)
            assert sock.recv(65536).decode().startswith("HTTP/1.1 200")
        for version, expect, reply in (("HTTP/1.0", "100-continue", "HTTP/1.0 200"),  # 1.0: no interim answer
                                       ("HTTP/1.1", "something-else", "HTTP/1.1 417")):
            with socket.create_connection(("127.0.0.1", srv.server.http_port)) as sock:
                sock.sendall(f"POST /v2/models/{MODEL}/infer {version}\r\nHost: x\r\nAuthorization: Bearer "
                             f"{'t' * 32}\r\nContent-Length: {len(body)}\r\nExpect: {expect}\r\n\r\n".encode()
                             + body)
                sock.settimeout(30)
                assert sock.recv(65536).decode().startswith(reply)
        refused = srv.server.metrics.registry.get_sample_value(
            "voxserve_requests_total", {"model": "voxnet", "code": "RESOURCE_EXHAUSTED"})
        assert refused == 1  # the 413 told before the body is counted as every refused request is


def test_huge_headers_get_4xx():
    with running_server() as srv:
        assert srv.wait_ready()
        status, _, _ = _request(srv, "GET", "/v2/health/live", headers={"X-Big": "a" * 100_000})
        assert 400 <= status < 500, status
        assert _request(srv, "GET", "/v2/health/live")[0] == 200


def test_a_stalled_body_gets_408_and_frees_its_slot():
    """A client that announces a body and stops sending holds its RPC slot only until --http-timeout-s (while
    nobody else needs it: see the next test)."""
    with running_server(http_timeout_s=0.5, max_concurrent_rpcs=1, max_streams_per_connection=1) as srv:
        assert srv.wait_ready()
        with socket.create_connection(("127.0.0.1", srv.server.http_port)) as sock:
            sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                         f"{{\"inp".encode())
            sock.settimeout(30)
            reply = sock.recv(65536).decode()
        assert reply.startswith("HTTP/1.1 408"), reply
        assert "--http-timeout-s" in reply
        assert srv.server.rest.limiter.active == 0
        assert _request(srv, "GET", "/v2/health/live")[0] == 200


def _begun_bodies(port: int, count: int, length: int = 1000) -> list[socket.socket]:
    """``count`` connections, each with an inference request whose body of ``length`` bytes has begun."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
                     f"{{\"inp".encode())
        socks.append(sock)
    return socks


class _Sender(threading.Thread):
    """Sends ``chunk`` on ``sock`` every 10 ms until stopped (or the server closes the connection)."""

    def __init__(self, sock: socket.socket, chunk: bytes) -> None:
        super().__init__(daemon=True)
        self.sock, self.chunk, self.running = sock, chunk, threading.Event()
        self.running.set()
        self.start()

    def run(self) -> None:
        with contextlib.suppress(OSError):
            while self.running.is_set():
                self.sock.sendall(self.chunk)
                time.sleep(0.01)

    def stop(self) -> None:
        self.running.clear()
        self.join()


def test_slow_bodies_over_many_connections_yield_their_slots_to_newcomers(monkeypatch, caplog):
    """Slow bodies, one per connection, held every RPC slot until --http-timeout-s: each connection held one slot,
    no more than a newcomer's share, so nothing was ended for anyone and every other client (gRPC's too) was
    refused. Now, while the server is full, a request whose body is PREEMPT_IDLE_S behind MIN_BODY_BYTES_PER_S is
    answered 503 (naming why) and its slot goes to the newcomer, the one furthest behind first: one that stopped
    sending, and one that trickles a byte at a time (never idle for long, but far behind); a body that keeps up is
    not ended."""
    monkeypatch.setattr(admission, "PREEMPT_IDLE_S", 0.2)
    monkeypatch.setattr(admission, "MIN_BODY_BYTES_PER_S", 2000.0)
    with running_server(http_timeout_s=60, max_concurrent_rpcs=4) as srv:
        assert srv.wait_ready()
        port = srv.server.http_port
        (trickling,) = _begun_bodies(port, 1)
        senders = [_Sender(trickling, b" ")]  # 100 bytes a second: behind from the start
        time.sleep(0.15)
        stalled = _begun_bodies(port, 2)
        (steady,) = _begun_bodies(port, 1, length=10**7)
        senders.append(_Sender(steady, b" " * 100))  # 10 kB a second: ahead all along
        try:
            deadline = time.monotonic() + 10
            while srv.server.rest.in_progress < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            x = np.random.default_rng().standard_normal((1, 3, 5, 6, 7), dtype=np.float32)
            status, _, body = _request(srv, "POST", f"/v2/models/{MODEL}/infer", _infer_body(x))
            assert status == 200, body
            y = np.asarray(json.loads(body)["outputs"][0]["data"], np.float32).reshape(1, -1)
            ref = reference_float64(torch.from_numpy(x), *reference_weights())
            assert relative_error(torch.from_numpy(y), ref) <= 1e-5
            stalled += _begun_bodies(port, 1)  # full again: gRPC's calls share the slots
            while srv.server.rest.in_progress < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            with Client(srv.url, timeout_s=30) as client:
                assert client.is_ready()
            assert srv.server.limiter.preempted == 2
            replies = {}
            for name, sock in [("trickling", trickling), *((f"stalled {i}", s) for i, s in enumerate(stalled)),
                               ("steady", steady)]:
                sock.settimeout(0.3)
                with contextlib.suppress(TimeoutError):
                    replies[name] = sock.recv(65536).decode()
            assert set(replies) == {"trickling", "stalled 0"}, replies  # the furthest behind, in turn
            for reply in replies.values():
                assert reply.startswith("HTTP/1.1 503") and "slower than" in reply, reply
            for name in replies:  # then closed, the rest of the body unread (not read for aiohttp's lingering time)
                sock = trickling if name == "trickling" else stalled[int(name.split()[1])]
                sock.settimeout(5)
                with contextlib.suppress(ConnectionResetError):
                    assert sock.recv(65536) == b""
            assert senders[1].is_alive()  # (still sending)
        finally:
            for sender in senders:
                sender.stop()
            for sock in (trickling, *stalled, steady):
                sock.close()
        assert srv.server.metrics.registry.get_sample_value(
            "voxserve_requests_total", {"model": MODEL, "code": "UNAVAILABLE"}) == 2
    # (the 503 was the whole ending: aiohttp logged no unhandled exception reading the rest of the body)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("length", [10, None], ids=["Content-Length", "chunked"])
def test_a_body_ended_for_a_newcomer_just_as_its_last_bytes_came_is_answered_503(length):
    """The preemption stored an error on the body's stream, raised at its next read: a body whose last read had
    returned, but whose reader had yet to resume, when a newcomer took its slot was read whole, and its request
    went on to run without a slot (two calls at a limit of one). Now the read itself is cancelled, wherever it
    is, and the request answered 503, whatever the turn of the loop at which the newcomer comes."""
    from aiohttp.streams import StreamReader

    from voxserve.server.protocol.rest import HttpError, RestServer

    class Settings:
        max_message_bytes, http_timeout_s = 1 << 20, 60.0

    class Server:  # what _read_body uses of the REST server
        settings = Settings()
        _read_chunks = RestServer._read_chunks

    async def trial(spins: int) -> str:
        limiter = admission.RpcLimiter(1)
        call = limiter.admit("http:slow", "/m")
        content = StreamReader(unittest.mock.Mock(_reading_paused=False), 1 << 16, loop=asyncio.get_running_loop())
        request = unittest.mock.Mock(headers={}, content_length=length, content=content)
        with admission.holding(call):  # (as the REST front end's guard holds it)
            reading = asyncio.ensure_future(RestServer._read_body(Server(), request))
        content.feed_data(b"x" * 5)
        await asyncio.sleep(PREEMPT_S * 1.5)  # behind 1 MB/s by more than PREEMPT_IDLE_S
        content.feed_data(b"x" * 5)
        content.feed_eof()
        for _ in range(spins):
            await asyncio.sleep(0)
        try:
            limiter.admit("http:newcomer", "/m")
        except ServingError:
            await reading
            return "the body was in before the newcomer came"
        with pytest.raises(HttpError) as err:
            await reading
        assert err.value.http_status == 503 and call.preempted is not None
        return "503"

    async def trials() -> list[str]:
        return [await trial(spins) for spins in range(6)]

    with unittest.mock.patch.object(admission, "PREEMPT_IDLE_S", PREEMPT_S):
        outcomes = asyncio.run(trials())
    assert "503" in outcomes, outcomes


PREEMPT_S = 0.05


def test_a_short_body_gets_400():
    with running_server() as srv:
        assert srv.wait_ready()
        with socket.create_connection(("127.0.0.1", srv.server.http_port)) as sock:
            sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                         f"{{}}".encode())
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(30)
            reply = sock.recv(65536).decode()
        # aiohttp ends the request at the connection's end; the server answers or closes, never a 5xx.
        assert reply == "" or reply.startswith("HTTP/1.1 4"), reply


# --- metrics, tokens, TLS ---------------------------------------------------------------


def test_rest_requests_are_counted_with_the_grpc_ones(server):
    def count(code: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics") as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("voxserve_requests_total{") and f'code="{code}"' in line)

    ok, bad = count("OK"), count("INVALID_ARGUMENT")
    x = np.zeros((1, 3, 3, 3, 3), np.float32)
    assert _request(server, "POST", f"/v2/models/{MODEL}/infer", _infer_body(x))[0] == 200
    assert _request(server, "POST", f"/v2/models/{MODEL}/infer", b"{oops")[0] == 400
    assert count("OK") == ok + 1 and count("INVALID_ARGUMENT") == bad + 1


def test_bearer_tokens_guard_every_route(tmp_path):
    token = "t" * 32
    (tmp_path / "tokens").write_text(token + "\n")
    with running_server(auth_token_file=str(tmp_path / "tokens"), open_health=True) as srv:
        assert srv.wait_ready()
        x = np.zeros((1, 3, 3, 3, 3), np.float32)
        for path, method, body in [(f"/v2/models/{MODEL}/infer", "POST", _infer_body(x)), ("/v2", "GET", None),
                                   (f"/v2/models/{MODEL}/config", "GET", None), ("/v2/no/such", "GET", None)]:
            status, headers, out = _request(srv, method, path, body)
            assert status == 401 and headers["WWW-Authenticate"] == "Bearer" and "Bearer" in _error(out), path
            status, _, _ = _request(srv, method, path, body, {"Authorization": "Bearer wrong-token-0123456789"})
            assert status == 401
        assert _request(srv, "POST", f"/v2/models/{MODEL}/infer", _infer_body(x),
                        {"Authorization": f"Bearer {token}"})[0] == 200
        # --open-health: the probes only
        for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready"):
            assert _request(srv, "GET", path)[0] == 200, path
        client = httpclient.InferenceServerClient(_url(srv))
        assert client.get_server_metadata(headers={"Authorization": f"Bearer {token}"})["name"] == "voxserve"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = CertificateAuthority(tmp_path_factory.mktemp("pki"), "rest")
    return {"ca": ca.path, "server": ca.issue("server", server=True), "client": ca.issue("client", server=False)}


def test_tls_and_mutual_tls(pki):
    import ssl

    with running_server(tls_cert=str(pki["server"].cert), tls_key=str(pki["server"].key),
                        tls_client_ca=str(pki["ca"])) as srv:
        assert srv.wait_ready()
        url = f"https://localhost:{srv.server.http_port}/v2/health/live"
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, context=context, timeout=30).read()  # no client certificate
        context.load_cert_chain(str(pki["client"].cert), str(pki["client"].key))
        with urllib.request.urlopen(url, context=context, timeout=30) as response:
            assert response.status == 200


# --- drain ------------------------------------------------------------------------------


def test_the_drain_answers_a_request_whose_body_is_still_arriving():
    with running_server(grace_period_s=20) as srv:
        assert srv.wait_ready()
        x = np.zeros((1, 3, 3, 3, 3), np.float32)
        body = _infer_body(x)
        with socket.create_connection(("127.0.0.1", srv.server.http_port)) as sock:
            sock.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                         f"\r\n".encode() + body[:10])
            deadline = time.monotonic() + 10
            while srv.server.rest.in_progress == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            stopping = srv.loop.call_soon_threadsafe  # the drain starts while the body is half sent
            import concurrent.futures

            drained: concurrent.futures.Future = asyncio.run_coroutine_threadsafe(srv.server.stop(20), srv.loop)
            time.sleep(1.5)  # longer than the REST server's own shutdown wait
            sock.sendall(body[10:])
            sock.settimeout(30)
            reply = sock.recv(65536).decode()
            drained.result(30)
            del stopping
        assert reply.startswith("HTTP/1.1 503") and "shutting down" in reply, reply


def test_a_draining_server_answers_503_and_not_ready():
    with running_server(grace_period_s=5) as srv:
        assert srv.wait_ready()
        srv.server.state.draining = True  # as stop() sets it first
        srv.server.state.ready = False
        x = np.zeros((1, 3, 3, 3, 3), np.float32)
        status, _, body = _request(srv, "POST", f"/v2/models/{MODEL}/infer", _infer_body(x))
        assert status == 503 and "shutting down" in _error(body)
        assert _request(srv, "GET", "/v2/health/ready")[0] == 400
        assert _request(srv, "GET", "/v2/health/live")[0] == 200
