"""bench/service_bench.py's report: Triton's rows in the CUDA shared-memory tables beside voxserve's, and each of
the targets stated as met, missed or not measured from the rows it has."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from voxserve.client.bench import LevelResult

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def service_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # (it imports its neighbours: rest_load, triton_peer)
    return importlib.import_module("service_bench")


def _row(target: str, rps: float, samples: int, concurrency: int) -> LevelResult:
    seconds = 2.0
    return LevelResult(target, concurrency, int(rps * seconds), 0, seconds, samples, samples * 196608,
                       latencies_ms=[1.0, 2.0, 3.0])


def _targets(text: str) -> dict[str, tuple[str, str]]:
    """{target: (measured, verdict)} of the report's targets table."""
    table = text.split("## Against the targets", 1)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0][2:]: (cells[1], cells[3].rstrip(" |")) for cells in rows[1:]}


def test_the_report_says_which_targets_the_rows_meet(service_bench):
    args = argparse.Namespace(batch=128, duration=3.0, frontends=0, native_frontends=0, engines=1, commit="abc1234",
                              max_batch=None)
    out = {key: [] for key in ("full", "fp16", "shm", "cuda_shm", "batch1", "cuda_shm_batch1", "rest_full",
                               "rest_batch1")}
    out["full"] += [_row("raw sink", 100, 128, 1), _row("voxserve", 95, 128, 1), _row("Triton", 50, 128, 1)]
    out["shm"] += [_row("voxserve", 1700, 128, 4), _row("Triton", 90, 128, 4)]
    out["cuda_shm"] += [_row("voxserve", 4000, 128, 1), _row("voxserve", 5200, 128, 4), _row("Triton", 300, 128, 4)]
    out["batch1"] += [_row("voxserve", 10000, 1, 64), _row("Triton", 6000, 1, 64)]
    out["cuda_shm_batch1"] += [_row("voxserve", 25000, 1, 64), _row("Triton", 30000, 1, 64)]
    text = service_bench.render(args, out, "test GPU", 10.0, [], h2d_gb_s=50.0)
    assert "- commit: abc1234\n" in text  # as given (a device's copy of the tree has older git metadata)
    assert "## Full batch in CUDA shared memory (the client's GPU memory)" in text
    cuda_table = text.split("## Full batch in CUDA shared memory", 1)[1].split("##", 1)[0]
    assert "| Triton | 4 | 300.0 |" in cuda_table and "| voxserve | 4 | 5200.0 |" in cuda_table
    targets = _targets(text)
    assert targets["CUDA shared memory, full batch"] == ("5,200 req/s (voxserve, p99 3.0 ms)", "met")  # best level
    assert targets["batch 1 at c=64: CUDA shared memory vs the wire, in process"] == (
        "2.50x (25000 vs 10000 req/s)", "missed")
    assert targets["vs Triton, full batch in CUDA shared memory (the client's GPU memory)"] == ("17.33x", "met")
    assert targets["vs Triton, batch 1 in CUDA shared memory at concurrency 64"] == ("0.83x", "missed")
    assert targets["system shared memory, full batch"][1] == "met"
    # 1,700 full batches a second are 42.8 GB/s: 86 % of the copy engine's rate measured in the run
    assert targets["system shared memory, full batch, vs the host-to-device copy rate from pinned memory (this run)"] \
        == ("86% (42.8 of 50.0 GB/s)", "met")
    assert targets["vs Triton, full batch in system shared memory"][1] == "met"
    assert targets["full-batch FP32 vs raw gRPC ceiling"] == ("95% (95.0 vs 100.0 req/s)", "met")
    assert targets["FP16 vs FP32 samples/s"] == ("-", "not measured")
    assert targets["vs MLServer, batch 1 at c=64"] == ("-", "not measured")


def test_the_shared_memory_targets_take_the_front_ends_rows_too(service_bench):
    """With --frontends, the best of the one-process and the front-end rows meets a shared-memory goal, and the batch-1
    ratio of CUDA shared memory to the wire is stated for each topology."""
    args = argparse.Namespace(batch=128, duration=3.0, frontends=12, native_frontends=12, engines=1, commit=None,
                              max_batch=None)
    fe = "voxserve --frontends 12"
    out = {key: [] for key in ("full", "fp16", "shm", "cuda_shm", "batch1", "cuda_shm_batch1", "rest_full",
                               "rest_batch1")}
    out["cuda_shm"] += [_row("voxserve", 1000, 128, 16), _row(fe, 2900, 128, 16)]
    out["batch1"] += [_row("voxserve", 1600, 1, 64), _row(fe, 10000, 1, 64), _row(f"{fe}, native", 17000, 1, 64)]
    out["cuda_shm_batch1"] += [_row("voxserve", 1500, 1, 64), _row(fe, 8000, 1, 64)]
    targets = _targets(service_bench.render(args, out, "test GPU", 10.0, []))
    assert targets["CUDA shared memory, full batch"] == (f"2,900 req/s ({fe}, p99 3.0 ms)", "missed")
    assert targets["batch 1 at c=64: CUDA shared memory vs the wire, in process"] == (
        "0.94x (1500 vs 1600 req/s)", "missed")
    assert targets[f"batch 1 at c=64: CUDA shared memory vs the wire, `{fe}`"] == (
        "0.80x (8000 vs 10000 req/s)", "missed")
    assert targets[f"batch 1 at c=64: CUDA shared memory vs the wire, `{fe}, native`"] == ("-", "not measured")
    assert targets["batch 1 at c=64, in process"] == ("1,600 req/s (p99 3.0 ms)", "missed")
    assert targets["batch 1 at c=64, through front ends"] == (f"17,000 req/s ({fe}, native, p99 3.0 ms)", "met")
    assert targets["system shared memory, full batch, vs the host-to-device copy rate from pinned memory (this run)"] \
        == ("-", "not measured")  # (no copy rate measured: no GPU, or no system shared-memory rows)


def test_front_end_configurations_name_their_engines(service_bench):
    """--engines N runs every front-end configuration with N engine processes (--replicas N) and says so in its rows'
    names; one engine adds no flag."""
    one = argparse.Namespace(frontends=12, native_frontends=8, engines=1)
    assert service_bench.frontend_configurations(one) == [
        ("voxserve --frontends 12", 12, []),
        ("voxserve --frontends 8, native", 8, ["--frontend-impl", "native"])]
    two = argparse.Namespace(frontends=12, native_frontends=0, engines=2)
    assert service_bench.frontend_configurations(two) == [
        ("voxserve --frontends 12, 2 engines", 12, ["--replicas", "2"])]


def _stand_ins(service_bench, monkeypatch) -> tuple[list, list]:
    """Servers and levels that run nothing: the flags each server was started with, and each level's (target,
    samples, concurrency), in order."""
    import contextlib

    servers, levels = [], []

    @contextlib.contextmanager
    def server(flags):
        servers.append(flags)
        yield argparse.Namespace(url="127.0.0.1:1", http_port=2)

    def level(url, payload, samples, tensor_bytes, concurrency, target, *rest, **options):
        levels.append((target, samples, concurrency))
        return _row(target, 100, samples, concurrency)

    monkeypatch.setattr(service_bench, "ServerProcess", server)
    monkeypatch.setattr(service_bench, "level", level)
    return servers, levels


def test_tables_runs_only_the_levels_of_the_tables_asked_for(service_bench, monkeypatch):
    """--tables cuda_shm_batch1,batch1: batch-1 levels on the wire and in CUDA shared memory, in process and through
    front ends, with and without batching; no raw sink, no full-batch level, no REST, no system shared memory; the
    report holds those two tables only."""
    servers, levels = _stand_ins(service_bench, monkeypatch)

    def refused(*args, **kwargs):
        raise AssertionError("not asked for")

    monkeypatch.setattr(service_bench, "setup_cuda_shared_memory", lambda *a: (b"request", lambda: None))
    for name in ("raw_sink", "setup_shared_memory", "rest_level", "mlserver"):
        monkeypatch.setattr(service_bench, name, refused)
    args = argparse.Namespace(batch=128, duration=1.0, frontends=0, native_frontends=4, engines=2, commit=None,
                              device="auto", full_concurrency=[1, 16], processes=1, full_processes=1, connections=1,
                              triton=None, mlserver_python=None, mlserver_pythonpath=None,
                              tables=["cuda_shm_batch1", "batch1"], max_batch=None)
    out = service_bench.run(args, [], lambda rows: None)
    native = "voxserve --frontends 4, native, 2 engines"
    assert levels == [("voxserve", 1, 64), ("voxserve", 1, 64), ("voxserve, no batching", 1, 64),
                      (native, 1, 64), (native, 1, 64), (f"{native}, no batching", 1, 64)]
    assert len(servers) == 4 and sum("--no-batching" in flags for flags in servers) == 2
    assert [flags[flags.index("--max-batch") + 1] for flags in servers] == ["128"] * 4  # (--batch: the default)
    assert list(out) == ["batch1", "cuda_shm_batch1"]
    text = service_bench.render(args, out, "test GPU", 1.0, [])
    assert [line for line in text.splitlines() if line.startswith("## ")] == [
        "## Batch 1 at concurrency 64", "## Batch 1 in CUDA shared memory at concurrency 64", "## Against the targets"]
    assert _targets(text)["full-batch FP32 vs raw gRPC ceiling"] == ("-", "not measured")


def test_max_batch_is_every_servers_limit_and_the_report_names_it(service_bench, monkeypatch):
    """--max-batch 512: every voxserve server runs with --max-batch 512, Triton's models get max_batch_size 512, and
    the report's header says so; the full batch sent stays --batch's 128 samples."""
    servers, levels = _stand_ins(service_bench, monkeypatch)
    tritons = []

    def triton(wheel, **options):
        tritons.append(options["max_batch"])
        raise service_bench.TritonUnavailable("not here")

    monkeypatch.setattr(service_bench, "triton_server", triton)
    monkeypatch.setattr(service_bench, "setup_shared_memory", lambda *a: (b"request", lambda: None))
    args = argparse.Namespace(batch=128, duration=1.0, frontends=0, native_frontends=4, engines=1, commit=None,
                              device="cpu", full_concurrency=[16], processes=1, full_processes=1, connections=1,
                              triton="wheel", triton_instances=2, mlserver_python=None, mlserver_pythonpath=None,
                              tables=["shm"], max_batch=512)
    notes: list[str] = []
    out = service_bench.run(args, notes, lambda rows: None)
    assert len(servers) == 2 and all(flags[flags.index("--max-batch") + 1] == "512" for flags in servers)
    assert tritons == [512]
    assert levels == [("voxserve", 128, 16), ("voxserve --frontends 4, native", 128, 16)]
    assert "every server's most samples in one execution: 512" in service_bench.render(args, out, "test", 1.0, notes)
