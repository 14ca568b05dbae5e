"""The voxserve CLI (weights, infer, health, --help) and the weights loader."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from voxserve.cli import main
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core import weights as weights_io
from voxserve.server.core.model import relative_error
from voxserve.server.settings import Settings, flag_name

from ..conftest import REPO


def test_weights_default_writes_reference_weights(tmp_path, capsys):
    out = tmp_path / "w.safetensors"
    assert main(["weights", "default", str(out)]) == 0
    loaded = weights_io.load(out)
    w, b = reference_weights()
    assert torch.equal(loaded.weight, w) and torch.equal(loaded.bias, b)
    assert main(["weights", "default", str(out), "--cin", "2", "--cout", "5", "-k", "4", "--seed", "3"]) == 0
    assert weights_io.load(out).weight.shape == (5, 2, 4, 4, 4)


@pytest.mark.parametrize("action", ["default", "convert"])
def test_written_weights_are_readable_by_others_as_the_umask_allows(tmp_path, action):
    """A weights file mounted into a container is read by its non-root user: written as open() would (the
    umask), not 0600."""
    src = tmp_path / "state.pt"
    torch.save({"conv.weight": torch.randn(16, 3, 3, 3, 3), "conv.bias": torch.randn(16)}, src)
    out = tmp_path / "w.safetensors"
    old = os.umask(0o022)
    try:
        args = ["weights", "default", str(out)] if action == "default" else ["weights", "convert", str(src), str(out)]
        assert main(args) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


@pytest.mark.parametrize("keys", [("conv.weight", "conv.bias"), ("conv_weight", "conv_bias")])
def test_weights_convert_state_dict(tmp_path, keys):
    w, b = reference_weights(cin=2, cout=4, k=3, seed=5)
    src, dst = tmp_path / "sd.pt", tmp_path / "w.safetensors"
    torch.save({keys[0]: w, keys[1]: b}, src)
    assert main(["weights", "convert", str(src), str(dst)]) == 0
    loaded = weights_io.load(dst)
    assert torch.equal(loaded.weight, w) and torch.equal(loaded.bias, b)


def test_weights_convert_refuses_other_files(tmp_path, capsys):
    src = tmp_path / "sd.pt"
    torch.save({"weight": torch.zeros(1)}, src)
    assert main(["weights", "convert", str(src), str(tmp_path / "o.safetensors")]) == 2
    assert "needs conv.weight and conv.bias" in capsys.readouterr().err
    src.write_bytes(b"garbage")
    assert main(["weights", "convert", str(src), str(tmp_path / "o.safetensors")]) == 2
    assert "not a loadable PyTorch state dict" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("weight", "bias", "message"),
    [
        (torch.zeros(16, 3, 3, 3), torch.zeros(16), "must have shape (Cout, Cin, k, k, k)"),
        (torch.zeros(16, 3, 3, 3, 2), torch.zeros(16), "must have shape (Cout, Cin, k, k, k)"),
        (torch.zeros(16, 3, 9, 9, 9), torch.zeros(16), "kernel size k=9 is outside 1..7"),
        (torch.zeros(16, 3, 3, 3, 3), torch.zeros(15), "conv.bias must have shape (16,)"),
        (torch.zeros(16, 3, 3, 3, 3, dtype=torch.int32), torch.zeros(16), "must be floating point"),
        (torch.full((16, 3, 3, 3, 3), float("nan")), torch.zeros(16), "NaN or infinite"),
    ],
)
def test_weights_shapes_checked(tmp_path, weight, bias, message):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"conv.weight": weight, "conv.bias": bias}, str(path))
    with pytest.raises(weights_io.WeightsError) as err:
        weights_io.load(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_weights_missing_file():
    with pytest.raises(weights_io.WeightsError, match="does not exist"):
        weights_io.load("/nonexistent/w.safetensors")


def test_infer_and_health_commands(server, tmp_path, capsys):
    x = np.random.default_rng().standard_normal((2, 3, 5, 6, 7), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "y.npy"
    assert main(["infer", "--url", server.url, "--input", str(tmp_path / "x.npy"), "--output", str(out)]) == 0
    y = np.load(out)
    w, b = reference_weights()
    assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
    for dtype in ("fp16", "bf16"):
        assert main(["infer", "--url", server.url, "--random", "1,3,4,4,4", "--dtype", dtype]) == 0
    assert main(["infer", "--url", server.url, "--random", "1,4,4,4,4"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert main(["health", "--url", server.url]) == 0
    assert main(["health", "--url", "127.0.0.1:1", "--timeout-s", "2"]) == 1


def test_help_documents_every_flag():
    text = subprocess.run([sys.executable, "-m", "voxserve", "serve", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={"COLUMNS": "200", "PATH": ""}).stdout
    for field in dataclasses.fields(Settings):
        assert flag_name(field.name) in text and f"VOXSERVE_{field.name.upper()}" in text
        assert " ".join(field.metadata["help"].split()[:4]) in " ".join(text.split())


def test_generated_protocol_code_is_current():
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a development dependency")
    proc = subprocess.run([sys.executable, "-m", "voxserve.proto.generate", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--devices", "0,x"], "--devices='0,x': must be 'all' or comma-separated GPU indices"),
    (["--devices", "all", "--device", "cpu"], "cannot be combined with --device cpu"),
    (["--max-request-voxels", "0"], "--max-request-voxels=0: must be >= 1"),
    (["--precision", "bf16"], "--precision='bf16': must be fp32 or tf32"),
])
def test_serve_flags_are_validated(flags, message):
    from voxserve.cli import build_parser
    from voxserve.server.settings import from_namespace

    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        from_namespace(build_parser().parse_args(["serve", *flags]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_devices_without_a_gpu_is_a_clear_start_up_error():
    from voxserve.server.core.model import select_devices

    with pytest.raises(RuntimeError, match="--devices all: no CUDA device is visible"):
        select_devices("auto", "all")
    assert select_devices("auto", "")[0][1] == "reference-cpu"


def test_tf32_precision_on_the_cpu_serves_float32_numbers(rng):
    from voxserve.kernels import reference_float64
    from voxserve.server.core.model import Model
    from voxserve.server.core.weights import default_weights

    weights = default_weights()
    model = Model(weights, torch.device("cpu"), "reference-cpu", 8, precision="tf32")
    assert model.precision == "fp32" and model.kernel == "reference-cpu"  # the label never claims TF32 on the CPU
    x = torch.randn(3, 3, 6, 7, 8, generator=rng)
    out = model.forward(x)
    ref = reference_float64(x, weights.weight, weights.bias)
    assert float((out.double() - ref).norm() / ref.norm()) <= 1e-5
