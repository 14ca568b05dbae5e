"""--log-format json: every line a process of the server writes is one JSON object with the documented fields."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import time

import pytest

from voxserve.server.logs import JsonFormatter

from ..conftest import REPO
from .test_lifecycle import _free_port

GUARD_S = 120


def test_json_records_carry_their_fields_context_and_traceback():
    record = logging.LogRecord("voxserve.x", logging.ERROR, __file__, 1, "failed %s", ("once",), None)
    record.request_id, record.model = "r-1", "voxnet"
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "ERROR" and entry["logger"] == "voxserve.x" and entry["message"] == "failed once"
    assert entry["request_id"] == "r-1" and entry["model"] == "voxnet" and "peer" not in entry
    assert "ValueError: boom" in entry["exception"] and entry["time"].endswith("+00:00")


@pytest.mark.parametrize("frontends", ["0", "1"])
def test_every_process_logs_json_lines(frontends):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "voxserve", "serve", "--device", "cpu", "--host", "127.0.0.1",
                             "--grpc-port", str(port), "--http-port", "0", "--metrics-port", "-1",
                             "--log-format", "json",
                             "--frontends", frontends], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    try:
        deadline = time.monotonic() + GUARD_S
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if '"ready: model' in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=GUARD_S)
        lines += rest.splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "".join(lines)[-3000:]
    # Every line Python's logging writes is a JSON object; gRPC's C core may print its own (rare) text lines.
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    text_records = [line for line in lines if re.match(r"\d{4}-\d\d-\d\d [\d:,]+ (DEBUG|INFO|WARNING|ERROR) ", line)]
    assert not text_records, text_records[:3]
    assert any(e["message"].startswith("ready: model") for e in entries)
    assert any(e["message"].startswith("stopped:") for e in entries)
    assert all({"time", "level", "logger", "message", "pid"} <= set(e) for e in entries)
    if frontends != "0":  # the supervisor, the engine and the front end alike
        assert len({e["pid"] for e in entries}) >= 3, {e["pid"] for e in entries}
