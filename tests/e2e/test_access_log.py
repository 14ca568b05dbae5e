"""--access-log: one record per inference request on voxserve.access, with its fields, as text and as JSON;
sampled at --access-log-sample-rate (failures always logged); none when off."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from voxserve.client import Client, build_request
from voxserve.proto import pb_grpc
from voxserve.server.logs import ACCESS_LOGGER, FORMAT, AccessLog, JsonFormatter, printable
from voxserve.server.settings import Settings

from ..conftest import running_server


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def access_records() -> Iterator[list[logging.LogRecord]]:
    handler = Records()
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def _x(n: int = 2) -> np.ndarray:
    return np.zeros((n, 3, 4, 4, 4), np.float32)


def test_one_record_per_request_with_its_fields_as_text_and_json(access_records):
    with running_server(access_log=True, log_level="WARNING") as srv:  # written whatever --log-level says
        assert srv.wait_ready()
        with grpc.insecure_channel(srv.url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            stub.ModelInfer(build_request(_x(2), "voxnet", "FP32", request_id="a-1"), timeout=30)
            with pytest.raises(grpc.RpcError):
                stub.ModelInfer(build_request(_x(1), "other\nmodel", "FP32", request_id="a-2"), timeout=30)
            list(stub.ModelStreamInfer(iter([build_request(_x(1), "voxnet", "FP32", request_id="a-3")]), timeout=30))
    ok, missing, streamed = access_records
    assert ok.levelno == logging.INFO and ok.name == ACCESS_LOGGER
    fields = {k: getattr(ok, k) for k in ("transport", "method", "code", "model", "request_id", "samples",
                                          "input_bytes")}
    assert fields == {"transport": "grpc", "method": "ModelInfer", "code": "OK", "model": "voxnet",
                      "request_id": "a-1", "samples": 2, "input_bytes": _x(2).nbytes}
    assert ok.peer.startswith("ipv4:127.0.0.1:") and ok.duration_ms > 0
    assert (missing.code, missing.request_id, missing.samples, missing.input_bytes) == ("NOT_FOUND", "a-2", 0, 0)
    assert missing.model == "other\\nmodel"  # a client's newline cannot start a forged line
    assert (streamed.method, streamed.code, streamed.request_id) == ("ModelStreamInfer", "OK", "a-3")

    text = logging.Formatter(FORMAT).format(ok)
    assert " INFO voxserve.access: grpc ModelInfer OK " in text and " ms model=voxnet samples=2 " in text
    assert "id=a-1" in text and "peer=ipv4:127.0.0.1:" in text
    assert "\n" not in logging.Formatter(FORMAT).format(missing)
    entry = json.loads(JsonFormatter().format(ok))
    assert {k: entry[k] for k in ("logger", "transport", "method", "code", "model", "request_id", "samples",
                                  "input_bytes")} == {"logger": ACCESS_LOGGER, **fields}
    assert isinstance(entry["duration_ms"], float) and entry["peer"] == ok.peer and "http_status" not in entry


def test_rest_requests_are_logged_with_their_http_status(access_records):
    with running_server(access_log=True, max_message_bytes=4096) as srv:
        assert srv.wait_ready()
        x = _x(1)
        body = json.dumps({"id": "r-1", "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                                    "data": x.ravel().tolist()}]}).encode()
        url = f"http://127.0.0.1:{srv.server.http_port}/v2/models/voxnet/infer"
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=30) as response:
            assert response.status == 200
        for payload in (b"{oops", b"x" * 5000):  # not JSON; over --max-message-bytes (never read)
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(urllib.request.Request(url, data=payload), timeout=30)
    ok, bad, large = access_records
    assert (ok.transport, ok.method, ok.code, ok.http_status, ok.request_id, ok.samples) == (
        "http", "POST /v2/models/{model}/infer", "OK", 200, "r-1", 1)
    assert ok.peer.startswith("http:127.0.0.1:")
    assert (bad.transport, bad.code, bad.http_status) == ("http", "INVALID_ARGUMENT", 400)
    assert (large.transport, large.code, large.http_status) == ("http", "RESOURCE_EXHAUSTED", 413)
    assert " INFO voxserve.access: http POST /v2/models/{model}/infer 200 OK " in logging.Formatter(FORMAT).format(ok)


def test_calls_refused_before_their_handler_are_logged(access_records, tmp_path):
    token = "t" * 32
    tokens = tmp_path / "tokens"
    tokens.write_text(token + "\n")
    with running_server(access_log=True, auth_token_file=str(tokens)) as srv:
        assert srv.wait_ready()
        with grpc.insecure_channel(srv.url) as ch, pytest.raises(grpc.RpcError):
            pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(build_request(_x(1), "voxnet", "FP32"), timeout=30)
    assert [(r.method, r.code) for r in access_records] == [("ModelInfer", "UNAUTHENTICATED")]


def test_sampled_through_the_server_with_failures_always_logged(access_records):
    with running_server(access_log=True, access_log_sample_rate=0.5) as srv:
        assert srv.wait_ready()
        access_log = srv.server.access_log
        assert access_log is not None and access_log.sample_rate == 0.5
        draws = iter([0.1, 0.7, 0.3, 0.9, 0.99, 0.99])
        access_log.draw = lambda: next(draws)  # the seam: logged when the draw is below the rate
        with Client(srv.url) as c:
            for _ in range(4):
                c.infer(_x(1))
        with grpc.insecure_channel(srv.url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            for _ in range(2):  # failures: logged whatever the draw
                with pytest.raises(grpc.RpcError):
                    stub.ModelInfer(build_request(_x(1), "other", "FP32"), timeout=30)
    assert [r.code for r in access_records] == ["OK", "OK", "NOT_FOUND", "NOT_FOUND"]
    assert next(draws) == 0.99  # failures did not draw


def test_the_rate_is_the_share_logged():
    logger = logging.getLogger("voxserve.test-access-rate")
    handler = Records()
    logger.addHandler(handler)
    logger.propagate = False
    try:
        access_log = AccessLog(0.1, logger=logger)  # the real random draw: 20000 requests, 2000 +- 42 expected
        for _ in range(20_000):
            access_log.record(transport="grpc", method="ModelInfer", code="OK", duration_ms=1.0)
        assert 1500 <= len(handler.records) <= 2500
        handler.records.clear()
        AccessLog(1.0, draw=lambda: pytest.fail("rate 1 draws nothing"), logger=logger).record(
            transport="http", method="infer", code="OK", duration_ms=1.0, http_status=200)
        assert handler.records[0].getMessage().startswith("http infer 200 OK 1.000 ms")
    finally:
        logger.removeHandler(handler)


def test_off_nothing_is_logged(server, access_records):
    assert server.server.access_log is None and not server.server.service._observed
    with Client(server.url) as c:
        c.infer(_x(1))
    assert access_records == []


def test_rate_outside_the_range_names_the_flag():
    from voxserve.server.settings import validate

    for rate in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="--access-log-sample-rate"):
            validate(Settings(access_log_sample_rate=rate))


def test_printable_keeps_one_bounded_line():
    assert printable("ok-id") == "ok-id"
    assert printable("a\nb\x00") == "a\\nb\\x00"
    assert printable("x" * 300) == "x" * 256 + "..."
