"""A CUDA client's memory in another process, for the GPU tests of CUDA shared memory: a child process that
allocates device memory, fills it, exports its CUDA IPC handle, reads it back, frees it or exits when told, and
answers over a pipe (one JSON line per command).

The child makes its CUDA calls through the driver library (libcuda, with ctypes: cuMemAlloc is what cudaMalloc
does in the primary context), not torch, so that an allocation is exactly one of its own (no caching allocator
between: a free is a real free) and the child starts in well under a second. The driver refuses a handle exported
by the process that opens it, so the exporter is always another process than the server; ``own_process_handle``
gives the test process's own, for that refusal.

Sizes are rounded up to 2 MiB: CUDA IPC shares the whole block an allocation was carved from, and only sizes of
2 MiB multiples are their own block (CUDA C Programming Guide, interprocess communication).

    with Exporter() as exporter:
        memory = exporter.alloc(nbytes, data)      # memory.handle: the 64 raw bytes; memory.size: bytes allocated
        ... register memory.handle, run requests ...
        exporter.read(memory, offset, count)       # the bytes there now (an output the server wrote)
        exporter.free(memory)                      # cuMemFree; or exporter.kill() (SIGKILL), exporter.exit()

Run as a script, this file is the child (``python tests/cuda_exporter.py DEVICE``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

HANDLE_BYTES = 64
GRANULE = 2 * 1024 * 1024  # sizes are rounded up to this (see the module's text)


def rounded(nbytes: int) -> int:
    return max(1, -(-nbytes // GRANULE)) * GRANULE


class CudaDriverError(RuntimeError):
    def __init__(self, call: str, name: str) -> None:
        super().__init__(f"{call}: {name}")
        self.call, self.name = call, name


class Driver:
    """The few CUDA driver calls an exporter makes, in ``device``'s primary context (made current on the calling
    thread)."""

    def __init__(self, device: int = 0) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
        self.lib.cuGetErrorName.argtypes = [ctypes.c_int, p(ctypes.c_char_p)]
        self.lib.cuDeviceGet.argtypes = [p(ctypes.c_int), ctypes.c_int]
        self.lib.cuDevicePrimaryCtxRetain.argtypes = [p(ctypes.c_void_p), ctypes.c_int]
        self.lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self.lib.cuMemAlloc_v2.argtypes = [p(u64), size_t]
        self.lib.cuMemFree_v2.argtypes = [u64]
        self.lib.cuMemcpyHtoD_v2.argtypes = [u64, ctypes.c_void_p, size_t]
        self.lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, u64, size_t]
        self.lib.cuIpcGetMemHandle.argtypes = [ctypes.c_void_p, u64]
        self.lib.cuMemGetAddressRange_v2.argtypes = [p(u64), p(size_t), u64]
        self.check(self.lib.cuInit(0), "cuInit")
        ordinal = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(ordinal), device), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), ordinal.value),
                   "cuDevicePrimaryCtxRetain")
        self.current()

    def current(self) -> None:
        self.check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def name(self, code: int) -> str:
        if code == 0:
            return "CUDA_SUCCESS"
        text = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(text))
        return (text.value or b"").decode() or f"CUresult {code}"

    def check(self, code: int, call: str) -> None:
        if code != 0:
            raise CudaDriverError(call, self.name(code))

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), "cuMemAlloc")
        return ptr.value

    def free(self, ptr: int) -> str:
        return self.name(self.lib.cuMemFree_v2(ptr))

    def write(self, ptr: int, data: bytes) -> None:
        if data:
            buffer = ctypes.create_string_buffer(data, len(data))
            self.check(self.lib.cuMemcpyHtoD_v2(ptr, buffer, len(data)), "cuMemcpyHtoD")

    def read(self, ptr: int, count: int) -> bytes:
        buffer = ctypes.create_string_buffer(max(count, 1))
        self.check(self.lib.cuMemcpyDtoH_v2(buffer, ptr, count), "cuMemcpyDtoH")
        return buffer.raw[:count]

    def export(self, ptr: int) -> bytes:
        handle = ctypes.create_string_buffer(HANDLE_BYTES)
        self.check(self.lib.cuIpcGetMemHandle(handle, ptr), "cuIpcGetMemHandle")
        return handle.raw

    def extent(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation ``ptr`` lies in."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                   "cuMemGetAddressRange")
        return base.value, size.value


# --- the child ----------------------------------------------------------------------------------------------------

def _serve(device: int) -> None:
    """Commands on stdin, one JSON line each; one JSON answer line each on stdout ({"error": ...} on a CUDA
    failure). Ends at "exit" or at the end of stdin, freeing nothing (the driver frees at the process's end)."""
    try:
        driver = Driver(device)
    except (OSError, CudaDriverError) as exc:
        print(json.dumps({"error": f"no CUDA: {exc}"}), flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            answer: dict[str, Any]
            if op == "alloc":
                ptr = driver.alloc(command["size"])
                driver.write(ptr, bytes.fromhex(command["data"]))
                base, size = driver.extent(ptr)
                answer = {"ptr": ptr, "handle": driver.export(ptr).hex(), "base": base, "extent": size}
            elif op == "write":
                driver.write(command["ptr"] + command["offset"], bytes.fromhex(command["data"]))
                answer = {}
            elif op == "read":
                answer = {"data": driver.read(command["ptr"] + command["offset"], command["count"]).hex()}
            elif op == "free":
                answer = {"result": driver.free(command["ptr"])}
            elif op == "exit":
                print(json.dumps({}), flush=True)
                return
            else:
                answer = {"error": f"unknown command {op!r}"}
        except CudaDriverError as exc:
            answer = {"error": str(exc)}
        print(json.dumps(answer), flush=True)


# --- the test's side ----------------------------------------------------------------------------------------------

class NoExporter(RuntimeError):
    """The child could not use CUDA (no driver or device): the caller skips."""


@dataclass(frozen=True)
class Memory:
    """One allocation of an exporter: ``handle`` its raw CUDA IPC handle, ``size`` the bytes allocated (the asked
    size rounded up to 2 MiB), ``extent`` the allocation's size as the driver reports it in the exporter."""

    ptr: int
    handle: bytes
    size: int
    extent: int


class Exporter:
    """The child process (see the module's text); a context manager that ends it (and what it allocated)."""

    def __init__(self, device: int = 0) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, str(device)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        try:
            first = self._answer("start")
        except RuntimeError as exc:
            self.close()
            raise NoExporter(str(exc)) from None
        if "error" in first:
            self.close()
            raise NoExporter(first["error"])

    def _answer(self, what: str) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the exporter process ended (exit status {self.proc.poll()}) at {what}")
        return json.loads(line)

    def _ask(self, op: str, **fields: Any) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")  # on a pipe: megabytes fit no argument list
        self.proc.stdin.flush()
        answer = self._answer(op)
        if "error" in answer:
            raise RuntimeError(f"the exporter's {op}: {answer['error']}")
        return answer

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def alloc(self, nbytes: int, data: bytes = b"") -> Memory:
        """Device memory of at least ``nbytes`` (rounded up to 2 MiB), starting with ``data`` (the rest
        unwritten)."""
        if len(data) > nbytes:
            raise ValueError(f"{len(data)} bytes of data do not fit in {nbytes}")
        size = rounded(nbytes)
        answer = self._ask("alloc", size=size, data=data.hex())
        return Memory(answer["ptr"], bytes.fromhex(answer["handle"]), size, answer["extent"])

    def write(self, memory: Memory, offset: int, data: bytes) -> None:
        self._ask("write", ptr=memory.ptr, offset=offset, data=data.hex())

    def read(self, memory: Memory, offset: int, count: int) -> bytes:
        return bytes.fromhex(self._ask("read", ptr=memory.ptr, offset=offset, count=count)["data"])

    def free(self, memory: Memory) -> str:
        """cuMemFree: the driver's answer (CUDA_SUCCESS even while another process maps the memory)."""
        return str(self._ask("free", ptr=memory.ptr)["result"])

    def exit(self) -> None:
        """The child exits of its own accord, freeing nothing first (the driver frees at its end)."""
        self._ask("exit")
        self.proc.wait(30)

    def kill(self) -> None:
        """SIGKILL: the child dies at once, holding its memory."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def own_process_handle(nbytes: int = GRANULE, device: int = 0) -> tuple[bytes, Any]:
    """A handle of device memory allocated by THIS process (the server's own, when it runs in process), and a
    function that frees it."""
    driver = Driver(device)
    ptr = driver.alloc(rounded(nbytes))
    handle = driver.export(ptr)

    def free() -> None:
        driver.current()
        driver.free(ptr)

    return handle, free


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
