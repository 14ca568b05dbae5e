"""`voxserve bench` against an in-process server: a short run, JSON results, raw-sink comparison."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest

from voxserve.cli import main


def test_bench_reports_every_level_and_the_raw_ceiling(server, capsys):
    rc = main(["bench", "--url", server.url, "--batch", "2", "--shape", "3,4,5,6", "--concurrency", "1,3",
               "--requests", "6", "--compare-raw", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    levels = report["levels"]
    assert [(lv["target"], lv["concurrency"]) for lv in levels] == [
        ("voxserve", 1), ("voxserve", 3), ("raw sink", 1), ("raw sink", 3)]
    for lv in levels:
        assert lv["requests"] == 6 and lv["errors"] == 0
        assert lv["samples_per_s"] == pytest.approx(2 * lv["requests_per_s"])
        assert 0 < lv["p50_ms"] <= lv["p90_ms"] <= lv["p99_ms"]
    assert all(lv["server_compute_ms"] > 0 and lv["server_queue_ms"] >= 0 for lv in levels[:2])
    assert report["tensor_bytes"] == 2 * 3 * 4 * 5 * 6 * 4 < report["request_bytes"]
    assert levels[0]["mb_per_s"] == pytest.approx(levels[0]["requests_per_s"] * report["tensor_bytes"] / 1e6)


def test_bench_counts_errors_and_fails_when_nothing_succeeds(server, capsys):
    rc = main(["bench", "--url", server.url, "--shape", "4,4,5,6", "--concurrency", "2", "--requests", "4", "--json"])
    assert rc == 1  # wrong Cin: every request is rejected
    assert json.loads(capsys.readouterr().out)["levels"][0]["errors"] == 4


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_bench_plot(server, tmp_path, capsys):
    out = tmp_path / "curve.png"
    assert main(["bench", "--url", server.url, "--shape", "3,4,4,4", "--concurrency", "1,2", "--requests", "3",
                 "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000


def test_bench_over_shared_memory(server, capsys):
    rc = main(["bench", "--url", server.url, "--batch", "2", "--shape", "3,4,5,6", "--concurrency", "2",
               "--requests", "4", "--shared-memory", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    level = report["levels"][0]
    assert level["requests"] == 4 and level["errors"] == 0
    assert report["request_bytes"] < 1000  # only the request's description crossed the socket
    from voxserve.client import Client

    with Client(server.url) as c:
        assert c.system_shared_memory_status() == {}  # the bench cleaned up its regions


def test_bench_spreads_workers_over_connections(server, capsys):
    rc = main(["bench", "--url", server.url, "--batch", "2", "--shape", "3,4,5,6", "--concurrency", "4",
               "--requests", "8", "--connections", "3", "--json"])
    assert rc == 0
    level = json.loads(capsys.readouterr().out)["levels"][0]
    assert level["requests"] == 8 and level["errors"] == 0 and level["server_compute_ms"] > 0


def test_bench_load_processes_send_together(server, capsys):
    before = time.time()
    rc = main(["bench", "--url", server.url, "--batch", "2", "--shape", "3,4,5,6", "--concurrency", "5",
               "--duration", "1.5", "--processes", "2", "--connections", "2", "--json"])
    assert rc == 0
    level = json.loads(capsys.readouterr().out)["levels"][0]
    assert level["requests"] > 0 and level["errors"] == 0 and level["server_compute_ms"] > 0
    # Both processes send over the same window (a barrier starts them): the level lasts one duration, measured
    # from the first request to the last answer, not the sum or the stagger of two.
    assert 1.5 <= level["seconds"] < 3.0 and level["wall_start"] >= before
    rc = main(["bench", "--url", server.url, "--shape", "3,4,5,6", "--concurrency", "3", "--requests", "10",
               "--processes", "3", "--json"])
    level = json.loads(capsys.readouterr().out)["levels"][0]
    assert rc == 0 and level["requests"] == 10 and level["errors"] == 0


def test_bench_on_streams(server, capsys):
    """--streaming: every request travels on a ModelStreamInfer stream (one per connection, shared by its
    workers) and is counted once, answered or refused, here and against the raw sink."""
    from voxserve.client import Client

    with Client(server.url) as c:
        before = c.model_statistics().inference_count
    rc = main(["bench", "--url", server.url, "--batch", "2", "--shape", "3,4,5,6", "--concurrency", "1,5",
               "--requests", "12", "--connections", "2", "--streaming", "--compare-raw", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["streaming"] is True
    levels = report["levels"]
    assert [(lv["target"], lv["concurrency"]) for lv in levels] == [
        ("voxserve", 1), ("voxserve", 5), ("raw sink", 1), ("raw sink", 5)]
    for lv in levels:
        assert lv["requests"] == 12 and lv["errors"] == 0
        assert 0 < lv["p50_ms"] <= lv["p99_ms"]
    with Client(server.url) as c:
        assert c.model_statistics().inference_count - before == 2 * 12 * 2  # 24 requests of 2 samples served
    # Refused requests come back in band and count as errors, each once.
    rc = main(["bench", "--url", server.url, "--shape", "4,4,5,6", "--concurrency", "3", "--requests", "6",
               "--streaming", "--json"])
    assert rc == 1
    assert json.loads(capsys.readouterr().out)["levels"][0]["errors"] == 6


def test_bench_on_a_stream_the_server_ends_fails_fast(tmp_path, capsys):
    """A stream the server ends (here: refused without a token) fails its requests at once, not after the
    per-request timeout, and the ones sent after it too."""
    from ..conftest import running_server

    tokens = tmp_path / "tokens"
    tokens.write_text("a-token-long-enough-for-the-server\n")
    with running_server(auth_token_file=str(tokens)) as srv:
        assert srv.wait_ready()
        started = time.monotonic()
        rc = main(["bench", "--url", srv.url, "--shape", "3,4,5,6", "--concurrency", "3", "--requests", "9",
                   "--streaming", "--timeout-s", "60", "--json"])
        assert time.monotonic() - started < 20
    assert rc == 1
    level = json.loads(capsys.readouterr().out)["levels"][0]
    assert level["errors"] == 9 and level["requests"] == 0


def test_bench_over_cuda_shared_memory(capsys, monkeypatch):
    """--cuda-shared-memory: input and output in one CUDA region of the bench's own (cuda-bindings faked over a
    server's fake device layer), only the request's description on the wire, the region unregistered and freed
    at the end."""
    from voxserve.client import Client, cuda
    from voxserve.testing.fake_devicemem import FakeDeviceMemory

    from ..fake_cuda import FakeCuda, FakeLayerServer

    memory = FakeDeviceMemory(2)
    fake = FakeCuda(memory, devices=2)
    monkeypatch.setattr(cuda, "_modules", fake.modules)
    srv = FakeLayerServer(memory)
    try:
        assert srv.wait_ready(), srv.server.load_error
        rc = main(["bench", "--url", srv.url, "--batch", "2", "--shape", "3,4,5,6", "--concurrency", "1,3",
                   "--requests", "6", "--cuda-shared-memory", "--cuda-device", "1", "--json"])
        assert rc == 0
        report = json.loads(capsys.readouterr().out)
        assert report["cuda_shared_memory"] is True and report["shared_memory"] is False
        for level in report["levels"]:
            assert level["requests"] == 6 and level["errors"] == 0, level["first_error"]
        assert report["request_bytes"] < 1000 < report["tensor_bytes"]
        assert memory.opens > 0 and memory.mapped == 0  # the server mapped it, and unmapped it at the unregister
        assert not fake.allocations and fake.devices_used == {1} and fake.current == 0  # on device 1, freed
        with Client(srv.url) as c:
            assert c.cuda_shared_memory_status() == {}
        assert main(["bench", "--url", srv.url, "--batch", "2", "--shape", "3,4,5,6", "--concurrency", "1",
                     "--requests", "2", "--cuda-shared-memory"]) == 0
        assert "of input tensor in CUDA shared memory (device 0)" in capsys.readouterr().out
    finally:
        srv.stop()


def test_bench_cuda_shared_memory_refusals(server, capsys, monkeypatch):
    from voxserve.client import cuda

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--url", server.url, "--shared-memory", "--cuda-shared-memory"])
    assert exit_.value.code == 2
    assert "--cuda-shared-memory: not allowed with argument --shared-memory" in capsys.readouterr().err
    monkeypatch.setattr(cuda, "_modules", None)
    monkeypatch.setitem(sys.modules, "cuda", None)  # cuda-bindings not installed
    assert main(["bench", "--url", server.url, "--cuda-shared-memory", "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert "--cuda-shared-memory: CUDA shared memory needs cuda-bindings" in err and "voxserve[cuda]" in err
    assert "Traceback" not in err
