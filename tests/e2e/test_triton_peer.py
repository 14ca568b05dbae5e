"""The Triton peer of bench/service_bench.py, on the CPU: the real tritonserver (nvidia-pytriton's) running
voxserve's model in its Python backend, answering `voxserve bench` and our client, over the wire and in
system shared memory, with float64's answers."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from voxserve.cli import main
from voxserve.client import Client, SharedMemoryBuffer
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.model import relative_error

_spec = importlib.util.spec_from_file_location(
    "triton_peer_server", Path(__file__).resolve().parents[2] / "bench" / "triton_peer" / "server.py")
assert _spec is not None and _spec.loader is not None
triton_peer = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # (its dataclass looks it up)
_spec.loader.exec_module(triton_peer)
_rest_spec = importlib.util.spec_from_file_location("rest_load", Path(__file__).resolve().parents[2] / "bench" /
                                                    "rest_load.py")
assert _rest_spec is not None and _rest_spec.loader is not None
rest_load = importlib.util.module_from_spec(_rest_spec)
_rest_spec.loader.exec_module(rest_load)


def test_what_is_not_triton_is_refused_with_the_reason(tmp_path):
    with pytest.raises(triton_peer.TritonUnavailable, match=r"neither the nvidia-pytriton\S* wheel nor a folder"):
        triton_peer.triton_server(str(tmp_path / "missing.whl")).__enter__()
    (tmp_path / "empty.whl").write_bytes(b"not a zip")
    with pytest.raises(triton_peer.TritonUnavailable, match="cannot unpack"):
        triton_peer.triton_server(str(tmp_path / "empty.whl")).__enter__()
    with zipfile.ZipFile(tmp_path / "other.whl", "w") as zf:
        zf.writestr("other/__init__.py", "")
    with pytest.raises(triton_peer.TritonUnavailable, match="holds no pytriton/tritonserver"):
        triton_peer.triton_server(str(tmp_path / "other.whl")).__enter__()
    with zipfile.ZipFile(tmp_path / "nostub.whl", "w") as zf:  # a server, but no stub for this Python
        zf.writestr("pytriton/tritonserver/bin/tritonserver", "")
        zf.writestr("pytriton/tritonserver/python_backend_stubs/2.7/triton_python_backend_stub", "")
    with pytest.raises(triton_peer.TritonUnavailable, match=r"stub for Python 3\.\d+ \(there are stubs for 2\.7\)"):
        triton_peer.triton_server(str(tmp_path / "nostub.whl")).__enter__()


@pytest.fixture(scope="module")
def triton() -> Iterator:
    """One FP32 model, one instance, on the CPU: the least that exercises the peer."""
    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton (in the bench extra; `pip install --no-deps nvidia-pytriton==0.7.0` is "
                    "enough) is not installed")
    try:
        with triton_peer.triton_server("auto", datatypes=("FP32",), instances=1, device="cpu") as peer:
            yield peer
    except triton_peer.TritonStartError:
        raise  # found but broken: a failure, not a skip
    except triton_peer.TritonUnavailable as exc:
        pytest.skip(f"Triton cannot run here: {exc}")


@pytest.mark.parametrize("shared_memory", [False, True], ids=["wire", "shared-memory"])
def test_voxserve_bench_against_triton(triton, capsys, shared_memory):
    rc = main(["bench", "--url", triton.url, "--model-name", triton.models["FP32"], "--batch", "2",
               "--shape", "3,8,8,8", "--concurrency", "1", "--requests", "1", "--json",
               *(["--shared-memory"] if shared_memory else [])])
    report = json.loads(capsys.readouterr().out)
    level = report["levels"][0]
    assert rc == 0 and level["errors"] == 0 and level["requests"] == 1, level["first_error"]
    assert report["server"] == f"triton {triton.version}" and level["target"] == "triton"
    assert level["server_compute_ms"] > 0  # Triton's ModelStatistics, read as ours are


def test_triton_answers_match_float64(triton, rng):
    w, b = reference_weights()
    x = torch.randn((3, 3, 5, 9, 17), generator=rng).numpy()
    ref = reference_float64(torch.from_numpy(x), w, b)
    with Client(triton.url, model=triton.models["FP32"]) as c:
        assert relative_error(torch.from_numpy(c.infer(x)), ref) <= 1e-5
        with SharedMemoryBuffer("voxtest_triton_in", x.nbytes) as shm_in, \
                SharedMemoryBuffer("voxtest_triton_out", 3 * 16 * 4) as shm_out:
            shm_in.write(x)
            c.register_system_shared_memory("in", shm_in.key, shm_in.size)
            c.register_system_shared_memory("out", shm_out.key, shm_out.size)
            try:
                c.infer_shared_memory(x.shape, "in", output_region="out")
                y = shm_out.read(np.float32, (3, 16))
            finally:
                c.unregister_system_shared_memory()
    assert relative_error(torch.from_numpy(y), ref) <= 1e-5


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_the_rest_driver_against_tritons_http_endpoint(triton, binary):
    """service_bench's REST rows for Triton: its HTTP endpoint answers bench/rest_load.py's requests."""
    x = np.random.default_rng().standard_normal((2, 3, 5, 6, 7), dtype=np.float32)
    body, json_length = rest_load.rest_body(x, "FP32", binary)
    result = asyncio.run(rest_load.run_rest_level(triton.http_url, body, 2, x.nbytes, 2, duration_s=None, requests=4,
                                                  model=triton.models["FP32"], target="triton",
                                                  json_length=json_length))
    assert result.errors == 0 and result.requests == 4, result.first_error
