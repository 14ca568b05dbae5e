"""What `voxserve kernel build` prints: one line whether the build ran or came from the cache, ptxas's whole report
behind --verbose, and a failed build's whole log in a file (no GPU needed; the real nvcc only where installed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from voxserve.cli import main
from voxserve.kernels import build as kernel_build

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"),
                                reason="nvcc (the CUDA toolkit) is not installed")

# Three entries as ptxas -v reports them (names shortened), two of them spilling.
_ENTRY = """ptxas info    : Compiling entry function '_ZN12_GLOBAL__N_1{mangled}' for 'sm_90a'
ptxas info    : Function properties for _ZN12_GLOBAL__N_1{mangled}
    {stack} bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads
ptxas info    : Used {registers} registers, used 1 barriers, 5760 bytes smem
ptxas info    : Compile time = 11.092 ms
"""
ENTRIES = [("17fused_tile_kernelI6__halfLi3ELi16ELi3ELi4ELi8EEEvPKT_NS_5ShapeEPfii", 0, 103),
           ("20fused_general_kernelI13__nv_bfloat16Li64EEEvPKT_NS_5ShapeEPKfS7_Pf", 32, 128),
           ("15fused_wg_kernelILi4ELb0EfEEvPKT1_NS_5ShapeEPfi", 8, 120)]
REPORT = "ptxas info    : 0 bytes gmem\n" + "".join(
    _ENTRY.format(mangled=m, stack=s, spill=s, registers=r) for m, s, r in ENTRIES * 40)  # 120 kernels


def test_ptxas_report_is_read_per_kernel():
    kernels = kernel_build.ptxas_kernels(REPORT)
    assert len(kernels) == 120
    assert [(k.name, k.arch, k.registers, k.spill_bytes) for k in kernels[:3]] == [
        ("fused_tile_kernel", "sm_90a", 103, 0), ("fused_general_kernel", "sm_90a", 128, 64),
        ("fused_wg_kernel", "sm_90a", 120, 16)]


@pytest.mark.parametrize("seconds", [0.0, 42.0])
def test_kernel_build_prints_one_line(monkeypatch, tmp_path, capsys, seconds):
    """Cached or not: one line, not ptxas's 400 (the report is beside the library, and on --verbose)."""
    library = tmp_path / "abc" / kernel_build.LIBRARY_NAME
    result = kernel_build.BuildResult(library, ("9.0a",), seconds, REPORT)
    monkeypatch.setattr(kernel_build, "build", lambda archs, force=False: result)
    assert main(["kernel", "build", "--arch", "9.0a"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1, out
    how = "already built (cache)" if not seconds else "built in 42.0 s"
    assert out.startswith(f"{library} for 9.0a: {how}; 120 kernels, up to 128 registers a thread, ")
    assert "spills in fused_general_kernel, fused_wg_kernel" in out
    assert str(tmp_path / "abc" / kernel_build.REPORT_NAME) in out
    assert main(["kernel", "build", "--arch", "9.0a", "--verbose"]) == 0
    assert capsys.readouterr().out.startswith(REPORT.rstrip())


def test_a_plain_90_build_says_it_has_no_warpgroup_kernel(tmp_path):
    result = kernel_build.BuildResult(tmp_path / kernel_build.LIBRARY_NAME, ("8.0", "9.0"), 1.0, "")
    assert "no warpgroup (wgmma) kernel (9.0a has it)" in result.summary()
    assert "wgmma" not in kernel_build.BuildResult(tmp_path, ("9.0a",), 1.0, "").summary()


def test_an_unreadable_arch_is_a_usage_error(capsys):
    assert main(["kernel", "build", "--arch", "hopper"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--arch" in err and "'hopper'" in err


@needs_nvcc
def test_a_failed_build_names_its_errors_and_keeps_the_whole_log(monkeypatch, tmp_path, capsys):
    source = tmp_path / "broken.cu"
    source.write_text("__global__ void k() { this is not C++; }\n")
    monkeypatch.setattr(kernel_build, "SOURCE", Path(source))
    monkeypatch.setenv("VOXSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    assert main(["kernel", "build", "--arch", "9.0a"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error" in err
    [log] = (tmp_path / "cache").glob(f"*/{kernel_build.FAILED_LOG_NAME}")
    assert str(log) in err
    text = log.read_text()
    assert "nvcc" in text.splitlines()[0] and "broken.cu" in text
    assert len(err.splitlines()) <= 22  # the error lines, at most 20 of them, not the whole log
