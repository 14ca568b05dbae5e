"""Launching the fused CUDA kernel: load the built library with ctypes, run it, register it as the op's CUDA kernel.

The library comes from ``build.py`` (nvcc, cached) or is a prebuilt one named
by VOXSERVE_KERNEL_LIBRARY; it is loaded once per process, on first use. The
launches go on PyTorch's current stream, so the op works under
``torch.cuda.graph`` capture and beside any other PyTorch work. Besides the
forward pass: the launch plan (``plan``), a stream's completion written to an
eventfd (``notify``) and one-call gathers of host spans (``copy_spans``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from .build import KernelBuildError, build
from .ops import SUPPORTED_INPUT_DTYPES, _fused_forward_op, check_precision
from .reference import reference

GENERAL_MAX_COUT = 64
# Kernel choice for the reference configuration (make_plan in csrc/fused.cu): 0 chooses, 1 forces the
# tile kernel, 2 the sliding-window kernel, 3 the tensor-core kernel (3xTF32; the default), 4 the
# sliding-window kernel with each voxel's channels split over 2 lanes, 5 the warpgroup (wgmma) tensor-core
# kernel (the default where the library has sm_90a code and the GPU is compute capability 9.0; 3
# elsewhere); 2-5 take contiguous float32 input only, other inputs fall back to the tile kernel.
VARIANTS = (1, 2, 3, 4, 5)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(SUPPORTED_INPUT_DTYPES)}  # fused.cu's dtype codes
_PRECISION_CODES = {"fp32": 0, "tf32": 1}  # ops.PRECISIONS

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
