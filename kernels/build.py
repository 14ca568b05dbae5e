"""Building the fused CUDA kernel: nvcc, the architecture list and the build cache (no GPU needed).

``csrc/fused.cu`` is plain CUDA with a C launcher and no torch headers, so it
builds in seconds with nvcc alone and is independent of the installed
PyTorch's C++ ABI. A build is cached by source, flags and nvcc version; this
module runs on a machine without a GPU (the image build, CI's compile check,
``voxserve kernel build``) and asks torch only for the default architecture. Loading and launching the built
library is ``cuda.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "fused.cu"
LIBRARY_NAME = "libvoxserve_fused.so"
REPORT_NAME = "ptxas.txt"
FAILED_LOG_NAME = "nvcc-failed.txt"  # the whole output of a build that failed, beside where the library would be
# -split-compile=0: the back end optimises the many kernel instantiations in parallel, one job per CPU.
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", "-split-compile=0")
DEFAULT_ARCHS = ("9.0a",)  # H100 / H200, with Hopper's arch-specific instructions (wgmma)


class KernelBuildError(RuntimeError):
    """The fused kernel could not be built or loaded; the message says why and what to do."""


@dataclass(frozen=True)
class BuildResult:
    path: Path
    archs: tuple[str, ...]
    seconds: float  # 0 when it came from the cache
    ptxas_report: str

    @property
    def report_path(self) -> Path:
        """ptxas's report of the build (``-Xptxas -v``), kept beside the library."""
        return self.path.parent / REPORT_NAME

    def summary(self) -> str:
        """One line: the library, how it came (built, or from the cache) and what ptxas said of its kernels."""
        how = f"built in {self.seconds:.1f} s" if self.seconds else "already built (cache)"
        line = f"{self.path} for {','.join(self.archs)}: {how}"
        kernels = ptxas_kernels(self.ptxas_report)
        if kernels:
            spilling = sorted({k.name for k in kernels if k.spill_bytes})
            line += (f"; {len(kernels)} kernels, up to {max(k.registers for k in kernels)} registers a thread, "
                     + (f"spills in {', '.join(spilling)}" if spilling else "no spills"))
        bases = {a.removesuffix("+PTX") for a in self.archs}
        if "9.0" in bases and "9.0a" not in bases:
            line += "; 9.0 without the 'a': no warpgroup (wgmma) kernel (9.0a has it)"
        return line


@dataclass(frozen=True)
class KernelReport:
    """What ptxas reported for one entry function."""

    name: str  # the kernel's name without its template arguments, e.g. fused_tile_kernel
    arch: str  # e.g. sm_90a
    registers: int
    spill_bytes: int  # stores plus loads


_ENTRY = re.compile(r"Compiling entry function '(?P<mangled>[^']+)' for '(?P<arch>[^']+)'")
_SPILLS = re.compile(r"(?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (?P<registers>\d+) registers")


def _kernel_name(mangled: str) -> str:
    """The name ending in 'kernel' in an Itanium-mangled symbol, where each name is written <length><name>
    (``..._GLOBAL__N_117fused_tile_kernelI6__half...`` -> fused_tile_kernel); the whole symbol if none is."""
    for match in re.finditer("kernel", mangled):
        end = match.end()
        for start in range(match.start(), 0, -1):  # the shortest name first: one whose length precedes it
            name = mangled[start:end]
            if name.isidentifier() and mangled[:start].endswith(str(len(name))):
                return name
    return mangled


def ptxas_kernels(report: str) -> list[KernelReport]:
    """The entry functions of a ptxas report (``-Xptxas -v``), with their registers and spills."""
    kernels = []
    entries = list(_ENTRY.finditer(report))
    for i, entry in enumerate(entries):
        text = report[entry.end():entries[i + 1].start() if i + 1 < len(entries) else len(report)]
        spills, registers = _SPILLS.search(text), _REGISTERS.search(text)
        kernels.append(KernelReport(
            _kernel_name(entry["mangled"]), entry["arch"], int(registers["registers"]) if registers else 0,
            int(spills["stores"]) + int(spills["loads"]) if spills else 0))
    return kernels


def find_nvcc() -> str:
    """nvcc from $CUDA_HOME/bin, else PATH; KernelBuildError if there is none."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [Path(cuda_home) / "bin" / "nvcc"] if cuda_home else []
    which = shutil.which("nvcc")
    if which:
        candidates.append(Path(which))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise KernelBuildError(
        "the CUDA compiler nvcc was not found (looked in $CUDA_HOME/bin, PATH and /usr/local/cuda/bin); "
        "install the CUDA toolkit or set CUDA_HOME")


def parse_arch_list(text: str) -> tuple[str, ...]:
    """'8.0;9.0a;9.0+PTX' or '80 90' -> ('8.0', '9.0a', '9.0+PTX'), the TORCH_CUDA_ARCH_LIST convention."""
    archs = []
    for item in text.replace(",", " ").replace(";", " ").split():
        ptx = item.endswith("+PTX")
        base = item.removesuffix("+PTX")
        if "." not in base and base.isdigit() and len(base) >= 2:
            base = f"{base[:-1]}.{base[-1]}"
        major, _, minor = base.partition(".")
        suffix = minor[-1:] if minor[-1:] in ("a", "f") else ""  # arch-specific targets, e.g. 9.0a
        if not (major.isdigit() and minor.removesuffix(suffix).isdigit()):
            raise KernelBuildError(f"cannot read CUDA architecture {item!r} (expected e.g. 9.0 or 9.0+PTX)")
        archs.append(base + ("+PTX" if ptx else ""))
    if not archs:
        raise KernelBuildError(f"empty CUDA architecture list {text!r}")
    return tuple(archs)


def default_archs() -> tuple[str, ...]:
    """VOXSERVE_CUDA_ARCH_LIST, else TORCH_CUDA_ARCH_LIST, else the visible GPUs, else sm_90."""
    for var in ("VOXSERVE_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST"):
        if os.environ.get(var):
            return parse_arch_list(os.environ[var])
    try:
        import torch  # only here: asking the GPUs' capability; the rest of the build needs no torch
    except ImportError:  # a build-only install: no torch, so no GPU to ask
        return DEFAULT_ARCHS
    if torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        # 9.0 builds as 9.0a: the warpgroup kernel needs Hopper's arch-specific instructions.
        return tuple(f"{a}.{b}" + ("a" if (a, b) == (9, 0) else "") for a, b in caps)
    return DEFAULT_ARCHS


def _gencode(arch: str) -> list[str]:
    base = arch.removesuffix("+PTX")
    num = base.replace(".", "")
    flags = [f"-gencode=arch=compute_{num},code=sm_{num}"]
    if arch.endswith("+PTX"):
        flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def arch_flags(archs: tuple[str, ...]) -> list[str]:
    """nvcc flags for the architectures; with 9.0a, VOXSERVE_WGMMA tells the host code the warpgroup kernel is there."""
    flags = [f for a in archs for f in _gencode(a)]
    if any(a.removesuffix("+PTX") == "9.0a" for a in archs):
        flags.append("-DVOXSERVE_WGMMA")
    return flags


def cache_dir() -> Path:
    root = os.environ.get("VOXSERVE_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "voxserve" / "kernels"


def build(archs: tuple[str, ...] | None = None, out_dir: Path | None = None, force: bool = False) -> BuildResult:
    """Compile csrc/fused.cu into a shared library, or reuse the cached build of the same source and flags."""
    archs = archs or default_archs()
    nvcc = find_nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    flags = [*NVCC_FLAGS, *arch_flags(archs)]
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), version, *flags]).encode()).hexdigest()[:16]
    target_dir = (out_dir or cache_dir()) / digest
    target = target_dir / LIBRARY_NAME
    report_path = target_dir / REPORT_NAME
    if target.exists() and not force:
        return BuildResult(target, archs, 0.0, report_path.read_text() if report_path.exists() else "")
    target_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        tmp_lib = Path(tmp) / LIBRARY_NAME
        cmd = [nvcc, *flags, "-Xptxas", "-v", "-o", str(tmp_lib), str(SOURCE)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            log_path = target_dir / FAILED_LOG_NAME
            log_path.write_text(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
            errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()] or \
                proc.stderr.splitlines()[-20:]
            raise KernelBuildError(f"nvcc failed with {len(errors)} error line(s); the whole log is in {log_path}:\n"
                                   + "\n".join(errors[:20]))
        report_path.write_text(proc.stderr)
        os.replace(tmp_lib, target)  # atomic: concurrent builders never see a partial library
    seconds = time.perf_counter() - started
    log.info("built %s for %s in %.1f s", target, ",".join(archs), seconds)
    return BuildResult(target, archs, seconds, proc.stderr)
