"""The fused CUDA kernel: build it with nvcc (cached), load it with ctypes, register it as the op's CUDA kernel.

The kernel source (``csrc/fused.cu``) is plain CUDA with a C launcher and no
torch headers, so it builds in seconds and is independent of the installed
PyTorch's C++ ABI. The launch goes on PyTorch's current stream, so the op works
under ``torch.cuda.graph`` capture and beside any other PyTorch work.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .ops import _fused_forward_op, check_precision
from .reference import reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "fused.cu"
LIBRARY_NAME = "libvoxserve_fused.so"
# -split-compile=0: the back end optimises the many kernel instantiations in parallel, one job per CPU.
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", "-split-compile=0")
DEFAULT_ARCHS = ("9.0a",)  # H100 / H200, with Hopper's arch-specific instructions (wgmma)
GENERAL_MAX_COUT = 64
# Kernel choice for the reference configuration (make_plan in csrc/fused.cu): 0 chooses, 1 forces the
# tile kernel, 2 the sliding-window kernel, 3 the tensor-core kernel (3xTF32; the default), 4 the
# sliding-window kernel with each voxel's channels split over 2 lanes, 5 the warpgroup (wgmma) tensor-core
# kernel (the default where the library has sm_90a code and the GPU is compute capability 9.0; 3
# elsewhere); 2-5 take contiguous float32 input only, other inputs fall back to the tile kernel.
VARIANTS = (1, 2, 3, 4, 5)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_PRECISION_CODES = {"fp32": 0, "tf32": 1}  # ops.PRECISIONS


class KernelBuildError(RuntimeError):
    """The fused kernel could not be built or loaded; the message says why and what to do."""


@dataclass(frozen=True)
class BuildResult:
    path: Path
    archs: tuple[str, ...]
    seconds: float  # 0 when it came from the cache
    ptxas_report: str


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
    report_path = target_dir / "ptxas.txt"
    if target.exists() and not force:
        return BuildResult(target, archs, 0.0, report_path.read_text() if report_path.exists() else "")
    target_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        tmp_lib = Path(tmp) / LIBRARY_NAME
        cmd = [nvcc, *flags, "-Xptxas", "-v", "-o", str(tmp_lib), str(SOURCE)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelBuildError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        report_path.write_text(proc.stderr)
        os.replace(tmp_lib, target)  # atomic: concurrent builders never see a partial library
    seconds = time.perf_counter() - started
    log.info("built %s for %s in %.1f s", target, ",".join(archs), seconds)
    return BuildResult(target, archs, seconds, proc.stderr)


ENTRY_POINTS = ("voxserve_last_error", "voxserve_is_specialised", "voxserve_workspace_floats", "voxserve_forward",
                "voxserve_plan", "voxserve_notify", "voxserve_copy_spans")


class _Library:
    """The loaded shared library with typed entry points."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        missing = [name for name in ENTRY_POINTS if not hasattr(lib, name)]
        if missing:
            raise KernelBuildError(f"{path} lacks {', '.join(missing)}: it was built from an older source; "
                                   f"rebuild it (voxserve kernel build) or unset VOXSERVE_KERNEL_LIBRARY")
        ll, i, p, f = ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p
        lib.voxserve_last_error.restype = ctypes.c_char_p
        lib.voxserve_is_specialised.argtypes = [i, i, i]
        lib.voxserve_is_specialised.restype = i
        lib.voxserve_workspace_floats.argtypes = [ctypes.POINTER(ll), i, i]
        lib.voxserve_workspace_floats.restype = ll
        lib.voxserve_forward.argtypes = [p, i, ctypes.POINTER(ll), ctypes.POINTER(ll), i, i, f, f, f, f, f, f, i, i, i,
                                         p]
        lib.voxserve_forward.restype = i
        lib.voxserve_plan.argtypes = [p, i, ctypes.POINTER(ll), ctypes.POINTER(ll), i, i, i, i, i,
                                      ctypes.POINTER(ctypes.c_int)]
        lib.voxserve_plan.restype = i
        lib.voxserve_notify.argtypes = [p, i, i]
        lib.voxserve_notify.restype = i
        lib.voxserve_copy_spans.argtypes = [p, p, i, p, i]
        lib.voxserve_copy_spans.restype = i
        self.lib = lib
        self.path = path


_load_lock = threading.Lock()
_library: _Library | None = None


def library() -> _Library:
    """Load the kernel library once per process: a prebuilt one named by VOXSERVE_KERNEL_LIBRARY (the
    Docker image ships one), else build it (or take the cached build)."""
    global _library
    with _load_lock:
        if _library is None:
            prebuilt = os.environ.get("VOXSERVE_KERNEL_LIBRARY")
            if prebuilt and not Path(prebuilt).is_file():
                raise KernelBuildError(f"VOXSERVE_KERNEL_LIBRARY={prebuilt} does not exist")
            _library = _Library(Path(prebuilt) if prebuilt else build().path)
        return _library


@functools.lru_cache(maxsize=1)
def load_problem() -> str | None:
    """Build/load the fused kernel once; None on success or a sentence saying why not."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    try:
        library()
    except (KernelBuildError, OSError) as exc:
        return str(exc)
    return None


class _HostWeights:
    """Host copies of weight tensors, for the specialised kernel's by-value weight parameter.

    Keyed by the tensors' storage and version counter; the cache holds the
    tensors themselves so that their memory cannot be reused by other tensors
    while an entry lives, and an in-place update bumps the version (a new entry).
    """

    def __init__(self, capacity: int = 4) -> None:
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, weight: torch.Tensor, bias: torch.Tensor):
        try:
            key = (weight.data_ptr(), weight._version, bias.data_ptr(), bias._version, weight.device)
        except RuntimeError:  # inference-mode tensors have no version counter: never cache them
            key = None
        with self._lock:
            if key is not None and key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key][2:]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("voxserve::fused_forward: run the op once outside CUDA graph capture first, so the "
                               "weights' host copy exists (a copy during capture would synchronise)")
        w_host = weight.detach().to("cpu", torch.float32).contiguous()
        b_host = bias.detach().to("cpu", torch.float32).contiguous()
        entry = (weight, bias, w_host, b_host)
        if key is not None:
            with self._lock:
                self._entries[key] = entry
                while len(self._entries) > self._capacity:
                    self._entries.popitem(last=False)
        return entry[2:]


_host_weights = _HostWeights()


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, variant: int = 0,
            precision: str = "fp32") -> torch.Tensor:
    """Launch the fused kernel on PyTorch's current stream; (N, Cout) float32 on x's device."""
    check_precision(precision)
    n, cin, d, h, w = x.shape
    cout, k = int(weight.shape[0]), int(weight.shape[2])
    lib = library().lib
    specialised = bool(lib.voxserve_is_specialised(cin, cout, k))
    if cout > GENERAL_MAX_COUT and not specialised:
        # Beyond the kernel's register budget: the reference on the GPU, same numbers, slower.
        return reference(x.to(torch.float32), weight, bias)
    sizes = (ctypes.c_longlong * 5)(n, cin, d, h, w)
    strides = (ctypes.c_longlong * 5)(*x.stride())
    floats = lib.voxserve_workspace_floats(sizes, cout, k)
    if floats < 0:
        raise ValueError(f"shape {tuple(x.shape)} is invalid for kernel size {k}")
    weight = weight.to(torch.float32).contiguous()
    bias = bias.to(torch.float32).contiguous()
    out = torch.empty((n, cout), device=x.device, dtype=torch.float32)
    workspace = torch.empty(floats, device=x.device, dtype=torch.float32)
    w_host_ptr = b_host_ptr = None
    if specialised:
        w_host, b_host = _host_weights.get(weight, bias)
        w_host_ptr, b_host_ptr = w_host.data_ptr(), b_host.data_ptr()
    stream = torch.cuda.current_stream(x.device).cuda_stream
    rc = lib.voxserve_forward(
        x.data_ptr(), _DTYPE_CODES[x.dtype], sizes, strides, cout, k, weight.data_ptr(), bias.data_ptr(),
        w_host_ptr, b_host_ptr, out.data_ptr(), workspace.data_ptr(), variant, _PRECISION_CODES[precision],
        x.device.index or 0, stream)
    if rc != 0:
        raise RuntimeError(f"voxserve::fused_forward: {lib.voxserve_last_error().decode()}")
    return out


def notify(stream: torch.cuda.Stream, fd: int) -> None:
    """Enqueue on ``stream`` a write of 1 to the eventfd ``fd``, made once everything enqueued before it has
    finished (a CUDA host function): an event loop watching ``fd`` learns of the end without a thread blocking."""
    lib = library().lib
    if lib.voxserve_notify(stream.cuda_stream, fd, stream.device.index or 0) != 0:
        raise RuntimeError(f"voxserve_notify: {lib.voxserve_last_error().decode()}")


def copy_spans(dst: torch.Tensor, spans: np.ndarray, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream`` the copy of host spans (an (n, 2) int64 array of address, bytes) one after another
    into ``dst`` (contiguous device memory of at least their total size): a batch's requests gathered straight
    from page-locked memory, in one call however many there are (spans back to back go as one copy)."""
    spans = np.ascontiguousarray(spans, dtype=np.int64)
    total = int(spans[:, 1].sum())
    if dst.nbytes < total:
        raise ValueError(f"the spans hold {total} bytes, more than the {dst.nbytes} of dst")
    lib = library().lib
    if lib.voxserve_copy_spans(dst.data_ptr(), spans.ctypes.data, len(spans), stream.cuda_stream,
                               stream.device.index or 0) != 0:
        raise RuntimeError(f"voxserve_copy_spans: {lib.voxserve_last_error().decode()}")


PLAN_FIELDS = ("kernel", "threads", "rows", "tiles_h", "tiles_w", "chunks", "blocks_per_sample", "terms")
KERNEL_NAMES = {0: "general", 1: "tile", 2: "window", 3: "tensor-core", 4: "split-window", 5: "warpgroup"}


def plan(x: torch.Tensor, cout: int = 16, k: int = 3, variant: int = 0, precision: str = "fp32") -> dict:
    """The launch plan forward() would use for x (kernel, block and tiling), as a dict of PLAN_FIELDS."""
    check_precision(precision)
    sizes = (ctypes.c_longlong * 5)(*x.shape)
    strides = (ctypes.c_longlong * 5)(*x.stride())
    out = (ctypes.c_int * len(PLAN_FIELDS))()
    if library().lib.voxserve_plan(x.data_ptr(), _DTYPE_CODES[x.dtype], sizes, strides, cout, k, variant,
                                   _PRECISION_CODES[precision], x.device.index or 0, out) != 0:
        raise ValueError(f"shape {tuple(x.shape)} is invalid for kernel size {k}")
    result = dict(zip(PLAN_FIELDS, out, strict=True))
    result["kernel"] = KERNEL_NAMES[result["kernel"]]
    return result


@_fused_forward_op.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    return forward(x, weight, bias, precision=precision)
