"""What CUDA does with the memory a co-located client hands the server (the CUDA and system shared-memory
paths): each question asked on the device and answered by what it returned, written as a table.

    python bench/probes/cuda_ipc_probe.py [--out bench/results/cuda-ipc-probe-<gpu>.md]
    compute-sanitizer --tool memcheck python bench/probes/cuda_ipc_probe.py --overread-only

1. cudaIpcOpenMemHandle on forged handles (random, zeros, a real one with bytes flipped): the error, whether it
   is sticky (the runtime's last error, a launch after it), and whether the fused op still runs;
2. a handle of this process's own memory;
3. a real handle from another process: the mapping's extent (cuMemGetAddressRange) against the size allocated,
   the bytes read through it, and opening it twice;
4. the exporter frees its memory while mapped, allocates again and exports again;
5. the exporter is killed (SIGKILL) while mapped: reads and writes through the mapping afterwards, the close,
   the device's memory;
6. the fused op on inputs that end where their allocation ends (each kernel variant, FP32/FP16/BF16): with
   --overread-only under compute-sanitizer, any read past the allocation shows as an error;
7. cudaHostRegister on an mmap of a /dev/shm segment, DMA from it, then the file truncated and DMA again;
   the host-to-device rate from the registered mapping against pinned and pageable memory.

The exporter is a child process (CUDA refuses a handle exported by the process that opens it) making its CUDA
calls through ctypes, not torch: the way a client in another language would.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

HANDLE_BYTES = 64
IPC_LAZY_ENABLE_PEER_ACCESS = 1
MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST = 1, 2
HOST_REGISTER_DEFAULT = 0


def _library_path(fragment: str) -> str:
    """The path of a shared library this process has loaded (torch loads its cudart on CUDA's first use)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if line.split() else ""
        if fragment in path and path.endswith(tuple(f".so{s}" for s in ("", ".13", ".12", ".1"))):
            return path
    for candidate in (f"{fragment}.so.13", f"{fragment}.so.12", f"{fragment}.so"):
        try:
            ctypes.CDLL(candidate)
            return candidate
        except OSError:
            continue
    raise OSError(f"no {fragment} loaded or loadable")


class IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class Cuda:
    """The few runtime and driver calls the probe needs, through ctypes."""

    def __init__(self, cudart_path: str) -> None:
        self.rt = ctypes.CDLL(cudart_path)
        self.drv = ctypes.CDLL("libcuda.so.1")
        self.rt.cudaGetErrorName.restype = ctypes.c_char_p
        self.rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcMemHandle, ctypes.c_uint]
        self.rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcMemHandle), ctypes.c_void_p]
        self.drv.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                     ctypes.c_uint64]

    def name(self, code: int) -> str:
        return f"{code} {self.rt.cudaGetErrorName(code).decode()}" if code else "0 cudaSuccess"

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self.check(self.rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cudaMalloc")
        return ptr.value or 0

    def free(self, ptr: int) -> int:
        return self.rt.cudaFree(ctypes.c_void_p(ptr))

    def export(self, ptr: int) -> bytes:
        handle = IpcMemHandle()
        self.check(self.rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES)

    def open(self, handle: bytes, clear: bool = True) -> tuple[int, int]:
        """(error code, pointer); ``clear``: clear the last error after a failure."""
        ptr = ctypes.c_void_p()
        code = self.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), IpcMemHandle.from_buffer_copy(handle),
                                            IPC_LAZY_ENABLE_PEER_ACCESS)
        if code and clear:
            self.last_error()  # an API error, recorded as the last error: cleared, or the next launch is blamed
        return code, ptr.value or 0

    def close(self, ptr: int) -> int:
        return self.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))

    def last_error(self) -> int:
        return self.rt.cudaGetLastError()

    def peek(self) -> int:
        return self.rt.cudaPeekAtLastError()

    def extent(self, ptr: int) -> tuple[int, int, int]:
        """(driver result, base, size) of the allocation ``ptr`` lies in."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        code = self.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        return code, base.value, size.value

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> int:
        return self.rt.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), kind)

    def host_register(self, ptr: int, nbytes: int) -> int:
        return self.rt.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), HOST_REGISTER_DEFAULT)

    def host_unregister(self, ptr: int) -> int:
        return self.rt.cudaHostUnregister(ctypes.c_void_p(ptr))

    def synchronize(self) -> int:
        return self.rt.cudaDeviceSynchronize()

    def check(self, code: int, what: str) -> None:
        if code:
            self.last_error()
            raise RuntimeError(f"{what}: {self.name(code)}")


# --- the exporter: another process, commands on stdin, answers as JSON lines on stdout -----------------------

EXPORTER = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[2])
from cuda_ipc_probe import Cuda
cuda = Cuda(sys.argv[1])
ptr = None
def alloc(nbytes):
    global ptr
    ptr = cuda.malloc(nbytes)
    head = min(nbytes, 1 << 20)
    pattern = ctypes.create_string_buffer(b"\x5a" * head, head)
    cuda.check(cuda.memcpy(ptr, ctypes.addressof(pattern), head, 1), "cudaMemcpy")
    return {"handle": cuda.export(ptr).hex(), "ptr": ptr, "bytes": nbytes}
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "alloc":
        out = alloc(int(arg))
    elif cmd == "free":
        out = {"free": cuda.name(cuda.free(ptr))}
    else:
        break
    print(json.dumps(out), flush=True)
"""


class Exporter:
    def __init__(self, cudart: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", EXPORTER, cudart, str(Path(__file__).parent)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, command: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the exporter exited ({self.proc.poll()}) on {command!r}")
        return json.loads(line)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(30)


def _wrap(ptr: int, nbytes: int, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] | None = None):
    """A torch tensor over device memory at ``ptr``, without a copy."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    typestr = {torch.uint8: "|u1", torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<V2"}[dtype]

    interface = {"shape": shape or (nbytes // itemsize,), "typestr": "<i2" if dtype == torch.bfloat16 else typestr,
                 "data": (ptr, False), "version": 3, "strides": None}
    holder = type("DeviceMemory", (), {"__cuda_array_interface__": interface})()
    tensor = torch.as_tensor(holder, device="cuda")
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor  # (no typestr for bfloat16)


def _healthy(weight, bias) -> str:
    """Whether the device still works: a torch kernel and the fused op, synchronised."""
    from voxserve.kernels import ops

    try:
        x = torch.randn(2, 3, 8, 8, 8, device="cuda")
        y = ops.fused_forward(x, weight, bias)
        torch.cuda.synchronize()
        return "ok" if torch.isfinite(y).all() else "non-finite output"
    except Exception as exc:
        return f"FAILED: {exc}"


def probe_handles(cuda: Cuda, cudart: str, weight, bias, rows: list[tuple[str, str]]) -> None:
    exporter = Exporter(cudart)
    try:
        nbytes = 3 * 1024 * 1024 + 4096  # not a multiple of 2 MiB: does the extent report it or the rounded size?
        real = exporter.ask(f"alloc {nbytes}")
        handle = bytes.fromhex(real["handle"])
        flipped = bytearray(handle)
        for i in range(0, HANDLE_BYTES, 7):
            flipped[i] ^= 0xFF
        for label, forged in (("random bytes", os.urandom(HANDLE_BYTES)), ("zeros", bytes(HANDLE_BYTES)),
                              ("a real handle, every 7th byte flipped", bytes(flipped))):
            code, ptr = cuda.open(forged, clear=False)
            recorded = cuda.peek()
            cuda.last_error()
            sticky = cuda.peek()
            if code == 0:
                cuda.close(ptr)
            rows.append((f"open a forged handle: {label}",
                         f"{cuda.name(code)}; recorded as the last error: {cuda.name(recorded)}; after clearing it: "
                         f"{cuda.name(sticky)} (sticky if not 0); the device afterwards: {_healthy(weight, bias)}"))
        own = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        code, ptr = cuda.open(cuda.export(own.data_ptr()))
        cuda.last_error()
        rows.append(("open a handle of this process's own memory", cuda.name(code)))
        if code == 0:
            cuda.close(ptr)

        code, ptr = cuda.open(handle)
        rows.append(("open another process's real handle", cuda.name(code)))
        if code:
            return
        dcode, base, size = cuda.extent(ptr)
        rows.append((f"cuMemGetAddressRange of the mapping (exporter allocated {nbytes} bytes)",
                     f"result {dcode}; base == pointer: {base == ptr}; size {size}"))
        data = _wrap(ptr, 1 << 20)
        rows.append(("the bytes read through the mapping (exporter wrote 0x5A to the first MiB)",
                     "as written" if bool((data == 0x5A).all()) else "DIFFERENT"))
        code2, ptr2 = cuda.open(handle)
        cuda.last_error()
        rows.append(("open the same handle again while it is open", f"{cuda.name(code2)}; same pointer: "
                     f"{ptr2 == ptr}" if code2 == 0 else cuda.name(code2)))
        if code2 == 0:
            rows.append(("... close the second opening", cuda.name(cuda.close(ptr2))))
            rows.append(("... the first still reads", "as written" if bool((data == 0x5A).all()) else "DIFFERENT"))

        freed = exporter.ask("free")
        torch.cuda.synchronize()
        try:
            still = "the old bytes" if bool((data == 0x5A).all()) else "other bytes"
            torch.cuda.synchronize()
        except Exception as exc:
            still = f"FAILED: {exc}"
        rows.append(("the exporter frees the memory while it is mapped (its cudaFree: "
                     f"{freed['free']}); a read through the mapping", f"{still}; device: {_healthy(weight, bias)}"))
        again = exporter.ask(f"alloc {nbytes}")
        code3, ptr3 = cuda.open(bytes.fromhex(again["handle"]))
        cuda.last_error()
        rows.append(("... it allocates again (same address: "
                     f"{again['ptr'] == real['ptr']}) and exports: open the new handle", cuda.name(code3)))
        if code3 == 0:
            cuda.close(ptr3)
        rows.append(("close the first mapping", cuda.name(cuda.close(ptr))))
        del data

        killed = exporter.ask(f"alloc {64 << 20}")
        code, ptr = cuda.open(bytes.fromhex(killed["handle"]))
        assert code == 0, cuda.name(code)
        view = _wrap(ptr, 64 << 20)
        free_before = torch.cuda.mem_get_info()[0]
        exporter.kill()
        time.sleep(0.5)
        try:
            for _ in range(1000):
                view.add_(1)
            torch.cuda.synchronize()
            after = "1000 writes and reads: no error"
        except Exception as exc:
            after = f"FAILED: {exc}"
        rows.append(("the exporter is killed (SIGKILL) while its 64 MiB are mapped", f"{after}; device: "
                     f"{_healthy(weight, bias)}"))
        del view
        close = cuda.close(ptr)
        torch.cuda.synchronize()
        time.sleep(0.5)
        free_after = torch.cuda.mem_get_info()[0]
        rows.append(("... then the mapping is closed", f"{cuda.name(close)}; device memory free +"
                     f"{(free_after - free_before) / 2**20:.0f} MiB"))
    finally:
        exporter.stop()


def probe_overread(cuda: Cuda, weight, bias, rows: list[tuple[str, str]]) -> None:
    """The fused op on inputs flush against their allocation's end (exactly 2 MiB multiples): compute-sanitizer
    names any read past it; bare, a fault would fail the op."""
    from voxserve.kernels import cuda as kcuda

    shapes = [(128, 3, 16, 32, 32), (1, 3, 16, 32, 32), (3, 3, 5, 9, 17), (2, 3, 7, 7, 7)]
    for shape in shapes:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for variant in (0, *kcuda.VARIANTS):
                itemsize = torch.empty((), dtype=dtype).element_size()
                nbytes = itemsize * int(torch.tensor(shape).prod())
                alloc = -(-nbytes // (2 << 20)) * (2 << 20)
                base = cuda.malloc(alloc)
                try:
                    x = _wrap(base + alloc - nbytes, nbytes, dtype, shape)
                    x.copy_(torch.randn(shape, device="cuda").to(dtype))
                    y = kcuda.forward(x, weight, bias, variant=variant)
                    ref = kcuda.forward(x.clone(), weight, bias, variant=variant)
                    torch.cuda.synchronize()
                    result = "ok" if torch.equal(y, ref) else "DIFFERS from a torch allocation's"
                except Exception as exc:
                    result = f"FAILED: {exc}"
                finally:
                    cuda.free(base)
                rows.append((f"fused op, input {list(shape)} {str(dtype)[6:]} ending at its allocation's end, "
                             f"variant {variant}", result))


def probe_host_register(cuda: Cuda, rows: list[tuple[str, str]]) -> None:
    nbytes = 64 << 20
    path = f"/dev/shm/voxserve-probe-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.pwrite(fd, b"\x5a" * nbytes, 0)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        code = cuda.host_register(address, nbytes)
        rows.append(("cudaHostRegister of a 64 MiB mmap of a /dev/shm segment", cuda.name(code)))
        if code:
            cuda.last_error()
            return
        dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        code = cuda.memcpy(dst.data_ptr(), address, nbytes, MEMCPY_HOST_TO_DEVICE)
        rows.append(("DMA from the registered mapping", f"{cuda.name(code)}; bytes: "
                     f"{'as written' if code == 0 and bool((dst == 0x5A).all()) else 'DIFFERENT'}"))
        rate = {}
        pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        for label, src in (("registered /dev/shm mmap", address), ("torch pinned", pinned.data_ptr()),
                           ("pageable", pageable.data_ptr())):
            cuda.memcpy(dst.data_ptr(), src, nbytes, MEMCPY_HOST_TO_DEVICE)
            t0 = time.perf_counter()
            for _ in range(10):
                cuda.check(cuda.memcpy(dst.data_ptr(), src, nbytes, MEMCPY_HOST_TO_DEVICE), label)
            rate[label] = 10 * nbytes / (time.perf_counter() - t0) / 1e9
        rows.append(("host-to-device rate (cudaMemcpy, 64 MiB)",
                     "; ".join(f"{k} {v:.1f} GB/s" for k, v in rate.items())))
        os.ftruncate(fd, 0)  # the client truncates its segment while it is registered
        dst.zero_()
        code = cuda.memcpy(dst.data_ptr(), address, nbytes, MEMCPY_HOST_TO_DEVICE)
        sticky = cuda.last_error()
        content = "the old bytes" if code == 0 and bool((dst == 0x5A).all()) else "zeros" if code == 0 and \
            not bool(dst.any()) else "mixed" if code == 0 else "-"
        rows.append(("the segment truncated to 0 while registered: DMA from the mapping again",
                     f"{cuda.name(code)} (last error {cuda.name(sticky)}); bytes: {content}"))
        os.ftruncate(fd, nbytes)
        os.pwrite(fd, b"\x33" * 4096, 0)
        code = cuda.memcpy(dst.data_ptr(), address, 4096, MEMCPY_HOST_TO_DEVICE)
        rows.append(("... grown again and rewritten by the client: DMA", f"{cuda.name(code)}; bytes: "
                     f"{'the new ones' if bool((dst[:4096] == 0x33).all()) else 'not the new ones'}"))
        rows.append(("cudaHostUnregister", cuda.name(cuda.host_unregister(address))))
        del pinned, pageable
        torch.cuda.synchronize()
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--overread-only", action="store_true", help="only part 6 (run it under compute-sanitizer)")
    args = parser.parse_args()
    from voxserve.kernels import reference_weights

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    cudart = _library_path("libcudart")
    cuda = Cuda(cudart)
    weight, bias = (t.cuda() for t in reference_weights())
    rows: list[tuple[str, str]] = []
    if args.overread_only:
        probe_overread(cuda, weight, bias, rows)
    else:
        for part in (probe_handles, probe_host_register):
            try:
                part(*((cuda, cudart, weight, bias, rows) if part is probe_handles else (cuda, rows)))
            except Exception as exc:
                rows.append((f"{part.__name__} stopped", f"{type(exc).__name__}: {exc}"))
        probe_overread(cuda, weight, bias, rows)
    device = torch.cuda.get_device_name(0)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# CUDA IPC and host-registration probe: {device}", "",
             f"- date: {now}; torch {torch.__version__}, CUDA {torch.version.cuda}, {cudart}, Python "
             f"{platform.python_version()}; commit {commit or 'unknown'}",
             f"- command: `{' '.join(['python', *sys.argv])}`", "", "| question | what CUDA did |", "|---|---|",
             *(f"| {q} | {a} |" for q, a in rows), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
