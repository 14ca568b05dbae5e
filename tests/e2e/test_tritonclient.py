"""A standard v2 client, tritonclient.grpc, gets correct answers from voxserve unchanged."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.model import relative_error

# Only look for it: the driver runs tritonclient in a process of its own, as a user's program would.
if importlib.util.find_spec("tritonclient") is None:
    pytest.skip("tritonclient[grpc] (a test dependency) is not installed", allow_module_level=True)

SHAPES = [(2, 3, 16, 32, 32), (1, 3, 3, 3, 3), (3, 3, 5, 9, 17)]


def test_tritonclient_end_to_end(server, rng, tmp_path):
    w, b = reference_weights()
    inputs = {}
    for i, shape in enumerate(SHAPES):
        x = torch.randn(shape, generator=rng).numpy()
        np.save(tmp_path / f"in_{i}.npy", x)
        inputs[i] = x
    driver = Path(__file__).with_name("tritonclient_driver.py")
    proc = subprocess.run([sys.executable, str(driver), server.url, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())

    assert report["live"] and report["ready"] and report["model_ready"]
    assert report["metadata"]["name"] == "voxnet"
    assert report["config"]["config"]["input"][0]["dims"] == ["3", "-1", "-1", "-1"]
    assert report["server"]["name"] == "voxserve"
    assert report["bad"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "smaller than the kernel size" in report["bad"]["message"]
    stats = report["statistics"]["model_stats"][0]
    assert int(stats["inference_count"]) >= 2 * sum(s[0] for s in SHAPES)

    for i, x in inputs.items():
        y32 = np.load(tmp_path / f"out_FP32_{i}.npy")
        assert y32.shape == (x.shape[0], 16)
        assert relative_error(torch.from_numpy(y32), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
        x16 = torch.from_numpy(x.astype(np.float16).astype(np.float32))
        y16 = np.load(tmp_path / f"out_FP16_{i}.npy")
        assert relative_error(torch.from_numpy(y16), reference_float64(x16, w, b)) <= 1e-5
