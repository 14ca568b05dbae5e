"""The Python side of native front ends (--frontend-impl native): the partner's accounting of what a native front
end reports it served, the client a handed-over call names, and the native front end's command line. The binary
itself, against a real engine: tests/native/; the whole server with it: test_native_frontends.py."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from voxserve.server.core.errors import Status
from voxserve.server.metrics import Metrics
from voxserve.server.protocol import partner
from voxserve.server.protocol.inference import InferenceService
from voxserve.server.protocol.security import SecurityConfigError
from voxserve.server.protocol.service import ServingState
from voxserve.server.settings import Settings, add_arguments, from_namespace
from voxserve.server.topology import native


def from_args(argv: list[str]) -> Settings:
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, {})
    return from_namespace(parser.parse_args(argv))


def _report(inflight: int, rows: list[tuple[int, ...]]) -> bytes:
    """A report body of ``rows``: (code, served, elapsed ns, queue ns, samples, input bytes[, input path])."""
    header = np.zeros(1, partner.REPORT_HEADER)
    header["inflight"], header["count"] = inflight, len(rows)
    records = np.zeros(len(rows), partner.RECORD)
    for i, (code, served, elapsed, queue, samples, nbytes, *path) in enumerate(rows):
        records[i] = (code, served, path[0] if path else 0, b"\0" * 5, elapsed, queue, samples, nbytes)
    return header.tobytes() + records.tobytes()


def _value(metrics: Metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model": "voxnet", **labels})
    return 0.0 if value is None else value


def test_reports_are_accounted_as_this_process_accounts_its_own_requests():
    metrics = Metrics("voxnet")
    state = ServingState()
    service = InferenceService(state, metrics, "voxnet", "1")
    reports = partner.Reports(service)
    ok, exhausted = Status.OK.value, Status.RESOURCE_EXHAUSTED.value
    assert reports.apply(_report(3, [(ok, 1, 2_000_000, 500_000, 4, 1024), (ok, 1, 4_000_000, 100, 1, 256),
                                     (exhausted, 1, 10_000, 0, 0, 0)])) == 3
    assert _value(metrics, "voxserve_requests_total", code="OK") == 2
    assert _value(metrics, "voxserve_requests_total", code="RESOURCE_EXHAUSTED") == 1
    assert _value(metrics, "voxserve_samples_total") == 5
    assert _value(metrics, "voxserve_input_bytes_total", path="wire") == 1280
    assert _value(metrics, "voxserve_request_duration_seconds_count") == 3
    assert _value(metrics, "voxserve_request_duration_seconds_sum") == pytest.approx(0.00601)
    assert _value(metrics, "voxserve_inflight_requests") == 3
    snap = state.stats.snapshot()
    assert snap.inference_count == 5 and snap.success.count == 2 and snap.success.ns == 6_000_000
    assert snap.queue.ns == 500_100 and snap.fail.count == 1 and snap.fail.ns == 10_000
    reports.apply(_report(1, []))  # the gauge follows what is in progress there now
    assert _value(metrics, "voxserve_inflight_requests") == 1


def test_reported_input_bytes_are_counted_by_their_path():
    metrics = Metrics("voxnet")
    reports = partner.Reports(InferenceService(ServingState(), metrics, "voxnet", "1"))
    ok = Status.OK.value
    reports.apply(_report(0, [(ok, 1, 10, 0, 1, 1000, 0), (ok, 1, 10, 0, 2, 300, 2), (ok, 1, 10, 0, 2, 30, 2)]))
    assert _value(metrics, "voxserve_input_bytes_total", path="wire") == 1000
    assert _value(metrics, "voxserve_input_bytes_total", path="cuda_shm") == 330
    assert _value(metrics, "voxserve_input_bytes_total", path="system_shm") == 0


@pytest.mark.parametrize("body", [b"", b"\0" * 8, _report(0, [(0, 1, 1, 1, 1, 1)])[:-1],
                                  _report(0, [(0, 1, 1, 1, 1, 1)]) + b"\0", _report(-1, []),
                                  _report(0, [(0, 1, 1, 1, 1, 1, 3)])])
def test_a_body_that_is_not_a_report_is_refused_and_counts_nothing(body):
    metrics = Metrics("voxnet")
    reports = partner.Reports(InferenceService(ServingState(), metrics, "voxnet", "1"))
    with pytest.raises(ValueError):
        reports.apply(body)
    assert _value(metrics, "voxserve_requests_total", code="OK") == 0


def test_a_handed_over_call_names_the_client_the_native_front_end_saw():
    def context(metadata, peer="unix:/run/frontend-0.sock"):
        return SimpleNamespace(invocation_metadata=lambda: metadata, peer=lambda: peer)

    assert partner.forwarded_peer(context((("x-voxserve-peer", "ipv4:10.0.0.7:5123"),))) == "ipv4:10.0.0.7:5123"
    assert partner.forwarded_peer(context((("authorization", "Bearer x"),))) == "unix:/run/frontend-0.sock"
    assert partner.forwarded_peer(context(None, peer="")) == ""


def test_the_native_front_ends_command_carries_the_servers_limits_and_options(tmp_path):
    settings = from_args(["--max-queue-size", "77", "--max-concurrent-rpcs", "300", "--max-request-samples", "9",
                          "--max-message-bytes", str(32 << 20), "--model-name", "m", "--frontends", "2",
                          "--frontend-impl", "native"])
    args = native.command(tmp_path / "voxserve-frontend", settings, "frontend-1", ["/r/engine-0.sock", "/r/e1.sock"],
                          "/r/frontend-1.sock", 8123, None)
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert args[0] == str(tmp_path / "voxserve-frontend")
    assert flags["--listen"] == f"{settings.host}:8123" and flags["--partner"] == "unix:/r/frontend-1.sock"
    assert flags["--max-queue-size"] == "77" and flags["--max-concurrent-rpcs"] == "300"
    assert flags["--max-request-samples"] == "9" and flags["--model-name"] == "m" and flags["--fast-path"] == "1"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--engine"] == ["/r/engine-0.sock", "/r/e1.sock"]
    grpc_args = [args[i + 1] for i, a in enumerate(args) if a == "--grpc-arg"]
    assert f"grpc.max_receive_message_length={32 << 20}" in grpc_args and "grpc.so_reuseport=0" not in grpc_args
    assert "--token-digests" not in args and "--tls-cert" not in args and "--regions-dir" not in args
    with_regions = native.command(tmp_path / "b", settings, "f", ["/e"], "/p", 1, None, "/r/regions")
    assert with_regions[with_regions.index("--regions-dir") + 1] == "/r/regions"
    traced = from_args(["--frontends", "2", "--frontend-impl", "native", "--access-log"])
    flags = native.command(tmp_path / "b", traced, "f", ["/e"], "/p", 1, None)
    assert flags[flags.index("--fast-path") + 1] == "0"  # the Python path traces and logs


def test_token_digests_are_written_privately_and_a_bad_token_file_stops_the_start(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# rotated\nold-token-0123456789abcdef\n  new-token-0123456789abcdef  \n")
    settings = Settings(auth_token_file=str(tokens))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = native.write_token_digests(settings, str(run_dir))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Path(path).read_text().split() == [hashlib.sha256(t).hexdigest() for t in
                                          (b"old-token-0123456789abcdef", b"new-token-0123456789abcdef")]
    assert native.write_token_digests(Settings(), str(run_dir)) is None
    (tmp_path / "short").write_text("short\n")
    with pytest.raises(SecurityConfigError):
        native.write_token_digests(Settings(auth_token_file=str(tmp_path / "short")), str(tmp_path))


def test_frontend_impl_native_needs_front_ends():
    with pytest.raises(ValueError, match="--frontend-impl"):
        from_args(["--frontend-impl", "native"])
    with pytest.raises(ValueError, match="--frontend-impl"):
        from_args(["--frontend-impl", "cpp", "--frontends", "2"])
    assert from_args(["--frontend-impl", "native", "--frontends", "auto"]).frontend_impl == "native"
