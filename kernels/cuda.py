"""Launching the fused CUDA kernel: load the built library with ctypes, run it, register it as the op's CUDA kernel.

The library comes from ``build.py`` (nvcc, cached) or is a prebuilt one named
by VOXSERVE_KERNEL_LIBRARY; it is loaded once per process, on first use. The
launches go on PyTorch's current stream, so the op works under
``torch.cuda.graph`` capture and beside any other PyTorch work. Besides the
forward pass: the launch plan (``plan``), a stream's completion written to an
eventfd (``notify``), one-call gathers of host spans (``copy_spans``) and another
process's device memory opened from its CUDA IPC handle (``ipc_open``/``ipc_close``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from . import ops
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
log = logging.getLogger(__name__)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(SUPPORTED_INPUT_DTYPES)}  # fused.cu's dtype codes
_PRECISION_CODES = {"fp32": 0, "tf32": 1}  # ops.PRECISIONS

ENTRY_POINTS = ("voxserve_last_error", "voxserve_is_specialised", "voxserve_workspace_floats", "voxserve_forward",
                "voxserve_layout_size", "voxserve_forward_layout", "voxserve_plan", "voxserve_notify",
                "voxserve_copy_spans", "voxserve_execution_size",
                "voxserve_events_create", "voxserve_events_destroy", "voxserve_event_query",
                "voxserve_event_synchronize", "voxserve_elapsed_ms", "voxserve_graph_capture",
                "voxserve_graph_destroy", "voxserve_execute", "voxserve_ipc_open", "voxserve_ipc_close",
                "voxserve_ipc_error_name")
IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
EVENTS = 5  # per execution: DMA in start and end, kernel start and end, result back


class Execution(ctypes.Structure):
    """fused.cu's VoxExecution: everything one serving execution needs, handed over in one call (execute)."""

    _fields_ = [
        ("spans", ctypes.c_void_p), ("nspans", ctypes.c_longlong), ("bytes", ctypes.c_longlong),
        ("padded_bytes", ctypes.c_longlong), ("host_copy_ns", ctypes.c_longlong),
        ("staging", ctypes.c_void_p), ("dev_in", ctypes.c_void_p), ("graph_exec", ctypes.c_void_p),
        ("w_dev", ctypes.c_void_p), ("b_dev", ctypes.c_void_p), ("w_host", ctypes.c_void_p),
        ("b_host", ctypes.c_void_p), ("out", ctypes.c_void_p), ("workspace", ctypes.c_void_p),
        ("host_out", ctypes.c_void_p), ("out_bytes", ctypes.c_longlong),
        ("copy_stream", ctypes.c_void_p), ("compute_stream", ctypes.c_void_p),
        ("events", ctypes.c_void_p * EVENTS), ("sizes", ctypes.c_longlong * 5), ("strides", ctypes.c_longlong * 5),
        ("dtype", ctypes.c_int), ("cout", ctypes.c_int), ("k", ctypes.c_int), ("variant", ctypes.c_int),
        ("precision", ctypes.c_int), ("device", ctypes.c_int), ("stage", ctypes.c_int), ("notify_fd", ctypes.c_int),
        ("out_spans", ctypes.c_void_p), ("nout_spans", ctypes.c_longlong),
    ]


class Layout(ctypes.Structure):
    """fused.cu's VoxLayout: voxserve_forward's arguments that one argument layout fixes (voxserve_forward_layout)."""

    _fields_ = [("sizes", ctypes.c_longlong * 5), ("strides", ctypes.c_longlong * 5), ("dtype", ctypes.c_int),
                ("cout", ctypes.c_int), ("k", ctypes.c_int), ("precision", ctypes.c_int), ("device", ctypes.c_int)]


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
        lib.voxserve_layout_size.restype = ll
        if lib.voxserve_layout_size() != ctypes.sizeof(Layout):
            raise KernelBuildError(f"{path}: its VoxLayout is {lib.voxserve_layout_size()} bytes, kernels/cuda.py's "
                                   f"mirror {ctypes.sizeof(Layout)}: rebuild the library")
        # Pointers only (and the variant): ctypes converts these several times faster than arrays and integers.
        lib.voxserve_forward_layout.argtypes = [p, p, f, f, f, f, f, f, p, i]
        lib.voxserve_forward_layout.restype = i
        lib.voxserve_plan.argtypes = [p, i, ctypes.POINTER(ll), ctypes.POINTER(ll), i, i, i, i, i,
                                      ctypes.POINTER(ctypes.c_int)]
        lib.voxserve_plan.restype = i
        lib.voxserve_notify.argtypes = [p, i, i]
        lib.voxserve_notify.restype = i
        lib.voxserve_copy_spans.argtypes = [p, p, i, p, i]
        lib.voxserve_copy_spans.restype = i
        lib.voxserve_execution_size.restype = ll
        if lib.voxserve_execution_size() != ctypes.sizeof(Execution):
            raise KernelBuildError(f"{path}: its VoxExecution is {lib.voxserve_execution_size()} bytes, "
                                   f"kernels/cuda.py's mirror {ctypes.sizeof(Execution)}: rebuild the library")
        lib.voxserve_events_create.argtypes = [i, i, p]
        lib.voxserve_events_create.restype = i
        lib.voxserve_events_destroy.argtypes = [i, p]
        lib.voxserve_events_destroy.restype = None
        lib.voxserve_event_query.argtypes = [p]
        lib.voxserve_event_query.restype = i
        lib.voxserve_event_synchronize.argtypes = [p]
        lib.voxserve_event_synchronize.restype = i
        lib.voxserve_elapsed_ms.argtypes = [p, p, ctypes.POINTER(ctypes.c_float)]
        lib.voxserve_elapsed_ms.restype = i
        lib.voxserve_graph_capture.argtypes = [p, i, ctypes.POINTER(ll), ctypes.POINTER(ll), i, i, f, f, f, f, f, f, i,
                                               i, i, p, ctypes.POINTER(ctypes.c_void_p)]
        lib.voxserve_graph_capture.restype = i
        lib.voxserve_graph_destroy.argtypes = [p]
        lib.voxserve_graph_destroy.restype = None
        lib.voxserve_execute.argtypes = [ctypes.POINTER(Execution)]
        lib.voxserve_execute.restype = i
        ull = ctypes.c_ulonglong
        lib.voxserve_ipc_open.argtypes = [ctypes.c_char_p, i, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ull),
                                          ctypes.POINTER(ull), ctypes.POINTER(ctypes.c_int)]
        lib.voxserve_ipc_open.restype = i
        lib.voxserve_ipc_close.argtypes = [p, i]
        lib.voxserve_ipc_close.restype = i
        lib.voxserve_ipc_error_name.argtypes = []
        lib.voxserve_ipc_error_name.restype = ctypes.c_char_p
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
    A change through ``.data`` is not counted by PyTorch, so it is not seen here:
    change weights in place under ``torch.no_grad()`` instead. Tensors made under
    ``torch.inference_mode`` have no version counter: they are copied on every
    call (a warning says so once). Device addresses are unique across devices
    (unified addressing), so the key needs no device. The capacity covers a model
    per GPU of a process serving many (--devices): the specialised weights are
    5 KB each. Lookups take no lock (a dict read and a move to the end); inserts do.
    """

    def __init__(self, capacity: int = 64) -> None:
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self._warned_uncached = False

    def get(self, weight: torch.Tensor, bias: torch.Tensor):
        try:
            key = (weight.data_ptr(), weight._version, bias.data_ptr(), bias._version)
        except RuntimeError:  # inference-mode tensors have no version counter: never cache them
            key = None
        entry = self._entries.get(key) if key is not None else None
        if entry is not None and key is not None:
            # Least recently used first out (one C call: atomic under the GIL). KeyError: another thread evicted it
            # meanwhile; the entry read is still whole. (try, not contextlib.suppress: a third of the lookup's cost)
            try:  # noqa: SIM105
                self._entries.move_to_end(key)
            except KeyError:
                pass
            return entry[2], entry[3]
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("voxserve::fused_forward: run the op once outside CUDA graph capture first, so the "
                               "weights' host copy exists (a copy during capture would synchronise)")
        w_host = weight.detach().to("cpu", torch.float32).contiguous()
        b_host = bias.detach().to("cpu", torch.float32).contiguous()
        entry = (weight, bias, w_host, b_host)
        if key is None and not self._warned_uncached:
            self._warned_uncached = True
            log.warning("voxserve::fused_forward: weights made under torch.inference_mode have no version counter, so "
                        "their host copy is made again on every call (a device-to-host copy that waits for the GPU); "
                        "make the weights outside inference_mode to have it kept")
        if key is not None:
            with self._lock:
                self._entries[key] = entry
                while len(self._entries) > self._capacity:
                    self._entries.popitem(last=False)
        return w_host, b_host


_host_weights = _HostWeights()


def _check_devices(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    if weight.get_device() != x.get_device() or bias.get_device() != x.get_device():
        raise ValueError(f"weight and bias must be on x's device ({x.device}); got {weight.device} and {bias.device}")


class _Prepared:
    """What forward() works out once per argument layout (the key of _layout_key), after checking the arguments
    as the op does: the library's Layout of them, the workspace size, whether the specialised kernel runs, and
    what each call reads as plain Python values (a ctypes field is slower to read)."""

    __slots__ = ("cout", "device", "fallback", "floats", "index", "layout", "layout_ptr", "n", "specialised")

    def __init__(self, lib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, precision: str) -> None:
        ops.check_arguments(x, weight, bias)
        check_precision(precision)
        _check_devices(x, weight, bias)
        self.n, cin = int(x.shape[0]), int(x.shape[1])
        self.cout, k = int(weight.shape[0]), int(weight.shape[2])
        self.device, self.index = x.device, x.get_device()
        self.specialised = bool(lib.voxserve_is_specialised(cin, self.cout, k))
        # Beyond the kernel's register budget: the reference on the GPU, same numbers, slower.
        self.fallback = self.cout > GENERAL_MAX_COUT and not self.specialised
        self.layout = Layout((ctypes.c_longlong * 5)(*x.shape), (ctypes.c_longlong * 5)(*x.stride()),
                             _DTYPE_CODES[x.dtype], self.cout, k, _PRECISION_CODES[precision], self.index)
        self.floats = lib.voxserve_workspace_floats(self.layout.sizes, self.cout, k)
        if self.floats < 0:
            raise ValueError(f"shape {tuple(x.shape)} is invalid for kernel size {k}")
        self.layout_ptr = ctypes.addressof(self.layout)  # (the struct lives as long as this)


_prepared: dict[tuple, _Prepared] = {}
MAX_PREPARED = 256  # distinct argument layouts remembered (then forgotten all at once)
_FLOAT32 = torch.float32
_NEEDS_WORKSPACE = 2  # voxserve_forward's answer when its one-launch scratch cannot take a call
# The current stream's raw handle by device index: PyTorch's own fast accessor where it has one (what its
# compiled code calls), else the public one.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def _layout_key(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, precision: str) -> tuple:
    """Every property of the arguments that _Prepared checks or derives its fields from."""
    return (x.shape, x.stride(), x.dtype, x.get_device(), weight.shape, weight.dtype, weight.get_device(),
            bias.shape, bias.dtype, bias.get_device(), precision)


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, variant: int = 0,
            precision: str = "fp32", *, one_launch: bool = True) -> torch.Tensor:
    """Launch the fused kernel on PyTorch's current stream; (N, Cout) float32 on x's device.

    The arguments are checked as the op checks them (shapes, dtypes, precision) and against x's device once
    per layout: a call whose layout was seen before goes straight to the launch. One launch: the kernel's last
    block of each sample writes its means, the per-block sums kept in the library's scratch for the stream.
    Under graph capture (and for the rare call the scratch cannot take) a workspace from PyTorch's allocator
    holds the sums and a second small kernel writes the means; ``one_launch=False`` asks for that path (the
    same bits).
    """
    lib = _library.lib if _library is not None else library().lib
    key = _layout_key(x, weight, bias, precision)
    prep = _prepared.get(key)
    if prep is None:
        prep = _Prepared(lib, x, weight, bias, precision)
        if len(_prepared) >= MAX_PREPARED:
            _prepared.clear()
        _prepared[key] = prep
    if prep.fallback:
        return reference(x.to(_FLOAT32), weight, bias)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if not bias.is_contiguous():
        bias = bias.contiguous()
    out = torch.empty(prep.n, prep.cout, device=prep.device, dtype=_FLOAT32)  # (sizes apart: parsed faster)
    w_host_ptr = b_host_ptr = None
    if prep.specialised:
        w_host, b_host = _host_weights.get(weight, bias)
        w_host_ptr, b_host_ptr = w_host.data_ptr(), b_host.data_ptr()
    args = (prep.layout_ptr, x.data_ptr(), weight.data_ptr(), bias.data_ptr(), w_host_ptr, b_host_ptr, out.data_ptr())
    stream = _raw_stream(prep.index)
    rc = lib.voxserve_forward_layout(*args, None, stream, variant) if one_launch else _NEEDS_WORKSPACE
    if rc == _NEEDS_WORKSPACE:
        workspace = torch.empty(prep.floats, device=prep.device, dtype=_FLOAT32)  # freed stream-ordered: no wait
        rc = lib.voxserve_forward_layout(*args, workspace.data_ptr(), stream, variant)
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


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: {library().lib.voxserve_last_error().decode()}")


class Event:
    """A CUDA timing event made by the kernel library (the native pipeline's), with torch.cuda.Event's query,
    synchronize and elapsed_time."""

    __slots__ = ("handle", "lib")

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.lib = library().lib

    def query(self) -> bool:
        rc = self.lib.voxserve_event_query(self.handle)
        if rc == 2:
            _check(1, "cudaEventQuery")
        return rc == 0

    def synchronize(self) -> None:
        _check(self.lib.voxserve_event_synchronize(self.handle), "cudaEventSynchronize")

    def elapsed_time(self, end: Event) -> float:
        ms = ctypes.c_float()
        _check(self.lib.voxserve_elapsed_ms(self.handle, end.handle, ctypes.byref(ms)), "cudaEventElapsedTime")
        return ms.value


def create_events(device: int, n: int = EVENTS) -> ctypes.Array:
    """``n`` timing events on ``device`` (destroy_events gives them back)."""
    events = (ctypes.c_void_p * n)()
    _check(library().lib.voxserve_events_create(device, n, events), "cudaEventCreate")
    return events


def destroy_events(events: ctypes.Array) -> None:
    library().lib.voxserve_events_destroy(len(events), events)


class Launcher:
    """The fused op's fixed arguments for one model on one device: fills an Execution's launch fields and captures
    the op into CUDA graphs of the library's own (server/core/pipeline.py's native path)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, precision: str = "fp32", variant: int = 0) -> None:
        check_precision(precision)
        self.lib = library().lib
        self.device = weight.device
        self.weight = weight.detach().to(torch.float32).contiguous()
        self.bias = bias.detach().to(torch.float32).contiguous()
        self.cout, self.cin, self.k = int(weight.shape[0]), int(weight.shape[1]), int(weight.shape[2])
        self.specialised = bool(self.lib.voxserve_is_specialised(self.cin, self.cout, self.k))
        self.precision, self.variant = precision, variant
        self.w_host = self.b_host = None
        if self.specialised:
            self.w_host, self.b_host = _host_weights.get(self.weight, self.bias)
        self._workspace: dict[tuple, int] = {}

    @property
    def supported(self) -> bool:
        """Whether the fused kernel computes this model (beyond 64 channels only the specialised one does)."""
        return self.specialised or self.cout <= GENERAL_MAX_COUT

    def workspace_floats(self, shape: tuple[int, ...]) -> int:
        floats = self._workspace.get(shape)
        if floats is None:
            floats = self.lib.voxserve_workspace_floats((ctypes.c_longlong * 5)(*shape), self.cout, self.k)
            if floats < 0:
                raise ValueError(f"shape {shape} is invalid for kernel size {self.k}")
            self._workspace[shape] = floats
        return floats

    def fill(self, ex: Execution) -> None:
        """Set ``ex``'s launch fields that never change for this model."""
        ex.w_dev, ex.b_dev = self.weight.data_ptr(), self.bias.data_ptr()
        ex.w_host = self.w_host.data_ptr() if self.w_host is not None else None
        ex.b_host = self.b_host.data_ptr() if self.b_host is not None else None
        ex.cout, ex.k, ex.variant = self.cout, self.k, self.variant
        ex.precision, ex.device = _PRECISION_CODES[self.precision], self.device.index or 0

    def capture(self, x: int, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor, workspace: torch.Tensor,
                stream: torch.cuda.Stream) -> int:
        """A graph of the op on the contiguous ``shape`` input at device address ``x`` into ``out`` (its handle;
        destroy_graph frees it). It waits for ``stream``, once."""
        sizes = (ctypes.c_longlong * 5)(*shape)
        strides = (ctypes.c_longlong * 5)(*contiguous_strides(shape))
        handle = ctypes.c_void_p()
        _check(self.lib.voxserve_graph_capture(
            x, _DTYPE_CODES[dtype], sizes, strides, self.cout, self.k, self.weight.data_ptr(), self.bias.data_ptr(),
            self.w_host.data_ptr() if self.w_host is not None else None,
            self.b_host.data_ptr() if self.b_host is not None else None, out.data_ptr(), workspace.data_ptr(),
            self.variant, _PRECISION_CODES[self.precision], self.device.index or 0, stream.cuda_stream,
            ctypes.byref(handle)), "voxserve_graph_capture")
        return int(handle.value or 0)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def destroy_graph(handle: int) -> None:
    library().lib.voxserve_graph_destroy(handle)


def execute(ex: Execution) -> None:
    """Enqueue the execution ``ex`` describes (fused.cu: voxserve_execute)."""
    lib = _library.lib if _library is not None else library().lib
    if lib.voxserve_execute(ctypes.byref(ex)) != 0:
        _check(1, "voxserve_execute")


class IpcError(Exception):
    """A CUDA IPC call that failed: ``code`` the CUDA error number, ``name`` CUDA's name for it, the message the
    library's (which call, CUDA's description)."""

    def __init__(self, code: int, name: str, message: str) -> None:
        super().__init__(message)
        self.code, self.name = code, name


def _ipc_error(lib, rc: int) -> IpcError:
    return IpcError(rc, (lib.voxserve_ipc_error_name() or b"").decode(), lib.voxserve_last_error().decode())


def ipc_open(handle: bytes, device: int) -> tuple[int, int, int, int]:
    """Open another process's cudaIpcMemHandle_t (its ``IPC_HANDLE_BYTES`` raw bytes) in ``device``'s primary
    context: (address, allocation base, allocation size, the memory's device ordinal); IpcError if it does not
    open (nothing stays open, and CUDA's last error is cleared)."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
    lib = library().lib
    ptr, base, size, ordinal = ctypes.c_void_p(), ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_int()
    rc = lib.voxserve_ipc_open(handle, device, ctypes.byref(ptr), ctypes.byref(base), ctypes.byref(size),
                               ctypes.byref(ordinal))
    if rc != 0:
        raise _ipc_error(lib, rc)
    return int(ptr.value or 0), base.value, size.value, ordinal.value


def ipc_close(address: int, device: int) -> None:
    """Close what ipc_open mapped at ``address`` in ``device``'s context; IpcError if CUDA refuses."""
    lib = library().lib
    rc = lib.voxserve_ipc_close(address, device)
    if rc != 0:
        raise _ipc_error(lib, rc)


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES[dtype]


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
def _cuda_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    return forward(x, weight, bias, precision=precision)


ops._cuda_kernel = _cuda_kernel  # eager calls skip the dispatcher (ops.fused_forward)
