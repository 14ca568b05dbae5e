"""The fused kernel compiles with nvcc alone (no GPU), for Hopper, without register spills in its hot kernels."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from voxserve.cli import main
from voxserve.kernels import build as kernel_build
from voxserve.kernels import cuda as cuda_kernels

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"),
                                reason="nvcc (the CUDA toolkit) is not installed")


@needs_nvcc
def test_kernel_builds_for_sm90a_and_hot_kernels_do_not_spill(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VOXSERVE_KERNEL_CACHE", str(tmp_path))
    assert main(["kernel", "build", "--arch", "9.0a"]) == 0
    out = capsys.readouterr().out
    built = list(tmp_path.glob("*/libvoxserve_fused.so"))
    assert len(built) == 1 and built[0].stat().st_size > 0
    report = next(tmp_path.glob("*/ptxas.txt")).read_text()
    # Per entry: the "Compiling entry function" line, then its stack/spill line.
    entries = re.findall(
        r"Compiling entry function '(\S+)' for 'sm_90a'\n[^\n]*\n\s*\d+ bytes stack frame, (\d+) bytes spill stores",
        report)
    hot = [(name, spills) for name, spills in entries if "tile_kernel" in name or "window_kernel" in name
           or "tc_kernel" in name]
    assert len(hot) >= 4, report[:2000]
    assert all(spills == "0" for _, spills in hot), hot
    # The warpgroup kernels (one per rows-per-plane count, both precisions, three input types) are built,
    # and ptxas kept their wgmma pipelined (it says C7514 when it serialises them).
    assert sum("fused_wg_kernel" in name for name, _ in entries) == 48
    assert "C7514" not in report
    # a second build comes from the cache
    assert main(["kernel", "build", "--arch", "9.0a"]) == 0
    assert "already built (cache)" in capsys.readouterr().out
    assert "registers" in out


def test_sm90a_builds_enable_the_warpgroup_kernel():
    assert "-DVOXSERVE_WGMMA" in kernel_build.arch_flags(("9.0a",))
    assert "-DVOXSERVE_WGMMA" in kernel_build.arch_flags(("8.0", "9.0a+PTX"))
    assert "-DVOXSERVE_WGMMA" not in kernel_build.arch_flags(("8.0", "9.0"))


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(kernel_build.Path, "is_file", lambda self: False)
    with pytest.raises(kernel_build.KernelBuildError, match="nvcc was not found"):
        kernel_build.find_nvcc()


def test_arch_list_parsing():
    assert kernel_build.parse_arch_list("8.0;9.0a 90+PTX") == ("8.0", "9.0a", "9.0+PTX")
    with pytest.raises(kernel_build.KernelBuildError, match="cannot read CUDA architecture"):
        kernel_build.parse_arch_list("hopper")


def test_server_falls_back_to_cpu_when_the_kernel_cannot_load(monkeypatch, caplog):
    from voxserve.server.core import model

    monkeypatch.setattr(model.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(model.cuda_kernels, "load_problem", lambda: "nvcc was not found")
    device, kernel = model.select_device("auto")
    assert device.type == "cpu" and kernel == "reference-cpu-fallback"
    assert "falling back to the CPU reference path" in caplog.text


def test_prebuilt_library_path_must_exist(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_kernels, "_library", None)
    monkeypatch.setenv("VOXSERVE_KERNEL_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(kernel_build.KernelBuildError, match="does not exist"):
        cuda_kernels.library()


def test_prebuilt_library_of_an_older_source_is_refused_by_name(monkeypatch):
    with open("/proc/self/maps") as maps:  # any shared library without the entry points: this process's libc
        libc = next((line.split()[-1] for line in maps if "/libc.so" in line or "/libc-" in line), None)
    if libc is None:
        pytest.skip("no libc path in /proc/self/maps")
    monkeypatch.setattr(cuda_kernels, "_library", None)
    monkeypatch.setenv("VOXSERVE_KERNEL_LIBRARY", libc)
    with pytest.raises(kernel_build.KernelBuildError, match=r"lacks voxserve_last_error.*notify.*older source"):
        cuda_kernels.library()
