"""The served model: weights on a device, the fused op, and the warm-up check that gates readiness.

No gRPC here: the service layer translates requests into ``Model.run`` calls.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from voxserve import kernels
from voxserve.kernels import cuda as cuda_kernels
from voxserve.kernels.graphs import GraphCache

from .weights import Weights

if TYPE_CHECKING:
    from .pipeline import CudaPipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutionTimes:
    """Where one execution's time went, in nanoseconds."""

    input_ns: int  # host tensor -> device tensor
    infer_ns: int  # the model itself
    output_ns: int  # result back to a host array


class WarmupError(RuntimeError):
    """The warm-up inference did not match the reference: the server must not become ready."""


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere gives inf)."""
    out64, ref64 = out.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return float("inf")
    return float(torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64))


# The fused kernel is compiled with CUDA 13.0 and PyPI's torch carries CUDA 13 libraries: the oldest Linux driver
# NVIDIA lists for CUDA 13.0 (the r580 branch, CUDA 13.x minor-version compatibility).
MIN_NVIDIA_DRIVER = "580.65.06"


def nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver's version ("580.95.05") from NVML; None where there is no NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver loaded, no GPU: nothing to check
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def driver_problem() -> str | None:
    """One sentence when a CUDA build of torch finds an NVIDIA driver older than MIN_NVIDIA_DRIVER, else None."""
    if torch.version.cuda is None:
        return None
    found = nvidia_driver_version()
    if found is None:
        return None
    if _version_tuple(found) >= _version_tuple(MIN_NVIDIA_DRIVER):
        return None
    return (f"NVIDIA driver {found} is older than {MIN_NVIDIA_DRIVER}, the oldest this build supports "
            f"(CUDA 13.0, r580 series): update the host's driver")


def select_device(requested: str) -> tuple[torch.device, str]:
    """Resolve --device into a torch device and the kernel label that will run on it."""
    if requested == "cpu":
        return torch.device("cpu"), "reference-cpu"
    problem = driver_problem()
    if problem is not None:
        if requested != "auto":
            raise RuntimeError(f"--device {requested}: {problem}")
        log.error("%s; serving on the CPU", problem)
        return torch.device("cpu"), "reference-cpu-fallback"
    if requested == "auto" and not torch.cuda.is_available():
        log.info("no CUDA device visible: serving on the CPU")
        return torch.device("cpu"), "reference-cpu"
    device = torch.device("cuda:0" if requested in ("auto", "cuda") else requested)
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device {requested}: no CUDA device is visible to this process")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise RuntimeError(f"--device {requested}: only {torch.cuda.device_count()} CUDA device(s) visible")
    problem = cuda_kernels.load_problem()
    if problem is not None:
        log.error("fused CUDA kernel unavailable (%s): falling back to the CPU reference path", problem)
        return torch.device("cpu"), "reference-cpu-fallback"
    return device, "fused-cuda"


def select_devices(device: str, devices: str = "") -> list[tuple[torch.device, str]]:
    """--devices (all, or GPU indices '0,1') when given, else --device: the devices to serve on."""
    if not devices:
        return [select_device(device)]
    if not torch.cuda.is_available():
        raise RuntimeError(f"--devices {devices}: no CUDA device is visible to this process")
    count = torch.cuda.device_count()
    indices = list(range(count)) if devices == "all" else [int(i) for i in devices.split(",")]
    missing = [i for i in indices if i >= count]
    if missing:
        raise RuntimeError(f"--devices {devices}: GPU(s) {missing} not visible; {count} CUDA device(s) visible")
    chosen = [select_device(f"cuda:{i}") for i in indices]
    if any(d.type != "cuda" for d, _ in chosen):  # the kernel cannot load: one CPU runner, as with --device
        return [chosen[0]]
    return chosen


def wire_to_tensor(arr: np.ndarray, datatype: str) -> torch.Tensor:
    """A torch view of a wire-typed numpy array (BF16 arrives as uint16 bits); no copy."""
    with warnings.catch_warnings():
        # Request bytes are immutable; the model only reads them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if datatype == "BF16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)


def tensor_to_wire(x: torch.Tensor) -> tuple[np.ndarray, str]:
    """The inverse of wire_to_tensor: a CPU tensor as a wire-typed numpy array (a view) and its datatype."""
    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16), "BF16"
    if x.dtype == torch.float16:
        return x.numpy(), "FP16"
    return x.to(torch.float32).numpy(), "FP32"


class Model:
    """Weights resident on one device and the op that runs them.

    On a GPU every execution goes through a CudaPipeline (pinned staging, copy and compute streams);
    on the CPU it runs in the calling thread.
    """

    def __init__(self, weights: Weights, device: torch.device, kernel: str, max_batch: int,
                 precision: str = "fp32") -> None:
        self.weights = weights
        self.device = device
        # The CPU path is float32 whatever the mode; the label says when the GPU multiplies in TF32.
        self.precision = precision if device.type == "cuda" else "fp32"
        self.kernel = kernel if self.precision == "fp32" else f"{kernel}+{self.precision}"
        self.max_batch = max_batch
        self.weight_on_device = weights.weight.to(device)
        self.bias_on_device = weights.bias.to(device)
        # Repeated small shapes replay a captured CUDA graph instead of re-launching.
        self.graphs = (GraphCache(self.weight_on_device, self.bias_on_device, precision=self.precision)
                       if device.type == "cuda" else None)
        self.pipeline = None
        if device.type == "cuda":
            from .pipeline import CudaPipeline

            # The fused op's launcher: the pipeline enqueues each execution with one library call (its native path).
            launcher = cuda_kernels.Launcher(self.weight_on_device, self.bias_on_device, self.precision)
            self.pipeline = CudaPipeline(device, self.cout, self.compute, self.graphs, native=launcher)

    @property
    def cin(self) -> int:
        return self.weights.cin

    @property
    def cout(self) -> int:
        return self.weights.cout

    @property
    def k(self) -> int:
        return self.weights.k

    @property
    def gpu_pipeline(self) -> CudaPipeline:
        """The CUDA pipeline of a model on a GPU (there is none on the CPU)."""
        if self.pipeline is None:
            raise RuntimeError(f"the model on {self.device} has no CUDA pipeline")
        return self.pipeline

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The fused op on x (already on this device), on the current stream; graphs for repeated shapes."""
        entry = self.graphs.lookup(x) if self.graphs is not None else None
        if entry is not None:
            entry.stage(x)
            return entry.replay()
        with torch.inference_mode():
            y = kernels.fused_forward(x, self.weight_on_device, self.bias_on_device, self.precision)
        if self.graphs is not None:
            self.graphs.note(x)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, Cin, D, H, W) CPU tensor -> (N, Cout) float32 on the CPU, max_batch samples at a time."""
        parts = [self.run_tensor(x[i : i + self.max_batch])[0] for i in range(0, x.shape[0], self.max_batch)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def run_arrays(self, arrays: list[np.ndarray], datatype: str) -> tuple[np.ndarray, ExecutionTimes]:
        """One execution of wire-typed arrays of equal sample shape (at most max_batch samples together)."""
        if self.pipeline is not None:
            pending = self.pipeline.submit(arrays, datatype)
            assert pending is not None  # it waits for a slot
            out, input_ns, infer_ns, output_ns = self.pipeline.wait(pending)
            return out, ExecutionTimes(input_ns, infer_ns, output_ns)
        # On the CPU a single request runs on a view of its bytes; a batch costs one concatenation.
        batch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        y, times = self.run_tensor(wire_to_tensor(batch, datatype))
        return y.numpy(), times

    def run_device_arrays(self, arrays: list, datatype: str) -> tuple[np.ndarray, ExecutionTimes]:
        """One execution of tensors where they lie in clients' CUDA memory (``devicemem.DeviceArray``s): the
        kernel reads a single request's tensor in place; several are first gathered on the device (one copy on
        the device, none through the host). (N, Cout) float32 on the host; an array's ``result`` (device memory)
        gets its rows on the device too. Synchronous, with torch's calls: the pipeline's native path
        (CudaPipeline.submit) does the same without a thread waiting, wherever the fused op's library runs."""
        t0 = time.perf_counter_ns()
        parts = [torch.as_tensor(a, device=self.device) for a in arrays]  # no copy: each keeps its array (lease)
        if datatype == "BF16":  # its bits travel as uint16
            parts = [p.view(torch.bfloat16) for p in parts]
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
        results = [(int(a.shape[0]), a.result) for a in arrays]
        y, times = self._forward_timed(x, t0, time.perf_counter_ns(), results)
        return y.numpy(), times

    def run_tensor(self, x: torch.Tensor) -> tuple[torch.Tensor, ExecutionTimes]:
        """One execution of a CPU tensor, each phase timed; (N, Cout) float32 on the CPU."""
        if self.pipeline is not None:
            arr, datatype = tensor_to_wire(x)
            out, times = self.run_arrays([arr], datatype)
            return torch.from_numpy(out), times
        t0 = time.perf_counter_ns()
        xd = x.to(self.device)
        return self._forward_timed(xd, t0, time.perf_counter_ns())

    def _forward_timed(self, xd: torch.Tensor, t0: int, t1: int,
                       results: list | None = None) -> tuple[torch.Tensor, ExecutionTimes]:
        """The fused op on ``xd`` (on this device since ``t1``, its input phase begun at ``t0``), the output back
        on the CPU; each phase timed. ``results``: per request of the batch in order, its rows and the device memory
        (a DeviceArray) they are copied to on the device, or None."""
        with torch.inference_mode():
            yd = kernels.fused_forward(xd, self.weight_on_device, self.bias_on_device, self.precision)
            row = 0
            for rows, result in results or ():
                if result is not None:
                    # (on the region's own device, which need not be this model's: a copy across devices then)
                    torch.as_tensor(result).copy_(yd[row : row + rows])
                row += rows
        t2 = time.perf_counter_ns()
        y = yd.to("cpu")
        t3 = time.perf_counter_ns()
        return y, ExecutionTimes(t1 - t0, t2 - t1, t3 - t2)

    def recover(self) -> str | None:
        """After a failed execution: free cached memory and graphs, then check the device still works.

        Returns None when the device is usable again, else why not (a sticky CUDA error, such as an
        illegal address, poisons the process's context: only a restart clears it).
        """
        if self.device.type != "cuda":
            return None
        try:
            if self.graphs is not None:
                self.graphs.clear()
            if self.pipeline is not None:
                self.pipeline.reset()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            probe = torch.ones(4, device=self.device) * 2  # an allocation and a kernel must work again
            if float(probe.sum()) != 8.0:
                return "a probe computation on the device gave a wrong answer"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def warm_up(self, seed: int | None = None) -> float:
        """Run fresh random inputs through the serving path and compare with float64.

        Returns the largest relative error seen; raises WarmupError above the precision mode's bound
        (kernels.ERROR_BOUNDS: 1e-5 for fp32).
        """
        bound = kernels.ERROR_BOUNDS[self.precision]
        gen = torch.Generator().manual_seed(seed if seed is not None else time.time_ns() % 2**63)
        k = self.k
        shapes = [(2, self.cin, k + 2, k + 3, k + 5), (1, self.cin, k, k, k)]
        if (self.cin, self.cout, k) == (3, 16, 3):
            shapes.append((4, 3, 16, 32, 32))
        worst = 0.0
        for shape in shapes:
            x = torch.randn(shape, generator=gen)
            err = relative_error(self.forward(x), kernels.reference_float64(x, self.weights.weight, self.weights.bias))
            log.debug("warm-up %s: relative error %.2e", shape, err)
            worst = max(worst, err)
            if not err <= bound:
                raise WarmupError(
                    f"warm-up on {self.kernel} for input {shape}: relative error {err:.3e} vs float64 "
                    f"exceeds {bound:.0e}"
                )
        return worst
