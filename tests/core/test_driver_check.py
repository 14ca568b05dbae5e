"""The NVIDIA driver check at start-up, with the driver's version faked: a CUDA build of torch on a driver older
than the CUDA 13.0 floor says so in one line (and serves on the CPU under --device auto, refuses an explicit GPU)."""

from __future__ import annotations

import logging

import pytest

from voxserve.server.core import model


@pytest.fixture
def cuda_torch(monkeypatch):
    """As if torch were a CUDA build (the CPU wheel's torch.version.cuda is None)."""
    monkeypatch.setattr(model.torch.version, "cuda", "13.0")


def _driver(monkeypatch, version: str | None) -> None:
    monkeypatch.setattr(model, "nvidia_driver_version", lambda: version)


def test_minimum_is_the_cuda_13_0_floor():
    assert model.MIN_NVIDIA_DRIVER == "580.65.06"


@pytest.mark.parametrize(("version", "too_old"), [
    ("575.57.08", True), ("580.65.05", True), ("550.163.01", True), ("580", True),
    ("580.65.06", False), ("580.82.07", False), ("580.126.09", False), ("590.44.01", False), ("1000.1", False),
])
def test_driver_versions_compare_numerically(monkeypatch, cuda_torch, version, too_old):
    _driver(monkeypatch, version)
    assert (model.driver_problem() is not None) is too_old


def test_an_old_driver_under_auto_serves_on_the_cpu_with_one_clear_line(monkeypatch, cuda_torch, caplog):
    _driver(monkeypatch, "550.54.14")
    with caplog.at_level(logging.ERROR, logger=model.log.name):
        device, kernel = model.select_device("auto")
    assert device.type == "cpu" and kernel == "reference-cpu-fallback"
    (record,) = [r for r in caplog.records if "NVIDIA driver" in r.getMessage()]
    message = record.getMessage()
    assert "\n" not in message
    assert "550.54.14 is older than 580.65.06" in message and "serving on the CPU" in message


def test_an_old_driver_refuses_an_explicit_gpu(monkeypatch, cuda_torch):
    _driver(monkeypatch, "575.57.08")
    with pytest.raises(RuntimeError, match=r"--device cuda:0: NVIDIA driver 575\.57\.08 is older than 580\.65\.06"):
        model.select_device("cuda:0")
    monkeypatch.setattr(model.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model.torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"--device cuda:0: NVIDIA driver 575\.57\.08 is older"):
        model.select_devices("auto", "all")


def test_no_driver_or_a_cpu_torch_is_not_a_driver_problem(monkeypatch, cuda_torch):
    _driver(monkeypatch, None)  # no NVML / no NVIDIA driver: the CPU path as before
    assert model.driver_problem() is None
    monkeypatch.setattr(model.torch.version, "cuda", None)
    _driver(monkeypatch, "470.42.01")  # a CPU torch never opens the driver
    assert model.driver_problem() is None
    assert model.select_device("cpu") == (model.torch.device("cpu"), "reference-cpu")


def test_a_current_driver_goes_on_to_the_device_probe(monkeypatch, cuda_torch):
    _driver(monkeypatch, "580.95.05")
    monkeypatch.setattr(model.torch.cuda, "is_available", lambda: False)
    assert model.select_device("auto") == (model.torch.device("cpu"), "reference-cpu")
