"""A CUDA IPC handle is read in a process of its own before the server maps it.

A handle's 64 bytes come from the client and the driver trusts them: on an H200 a live handle with one byte changed
still opens, mapping an address or a range the exporter's memory does not back (found by
tests/core/test_cuda_shm_hostile_gpu.py). The first read there faults, and a fault poisons the whole CUDA context:
every request of every client on that device would fail until the server restarts. Nothing inside the process can
find out safely whether a mapping is whole, so the question goes to a sacrificial one: ``HandleChecker`` keeps a
child process (``python -m voxserve.server.core.ipccheck``, plain driver calls through ctypes: no torch, quick to
start) that opens the handle, reads every byte the server may access through it (the region's byte_size from the
mapped address) and says how large the mapped range is; a handle that does not open, or whose bytes do not read, is
refused, and if the read faulted the child
exits (its context is gone) and the next check starts a new one. The server then opens the handle itself and maps
the very pages the child read: the exporter's memory stays allocated while any process maps it.

The child costs one more CUDA context on each device it checks a handle for (hundreds of MB of device memory) and a
registration the time to read its region once (a device-to-device copy: milliseconds per GB), no more than a
request reading the region costs.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

from .devicemem import HANDLE_BYTES, DeviceMemoryError
from .errors import ServingError, Status

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # the child reads a range in copies of at most this many bytes
START_TIMEOUT_S = 60.0  # for the child to load the driver
CHECK_TIMEOUT_S = 60.0  # for one handle: opening it and reading its range (at copy speed: milliseconds per GB)


class HandleChecker:
    """The checking child, started on first use and again after it dies; one check at a time (registrations are
    rare). ``command``: the child's argv (tests give a stand-in)."""

    def __init__(self, command: Sequence[str] | None = None) -> None:
        self.command = list(command) if command is not None else [sys.executable, "-m", __name__]
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self.started = 0  # children started, ever

    def check(self, handle: bytes, device: int, nbytes: int | None = None) -> int:
        """The bytes from the address ``handle`` maps on ``device`` to the end of its range, once another process
        has read the first ``nbytes`` of them (what the server may access through it: a region's byte_size; None:
        all); DeviceMemoryError (a sentence for the client, CUDA's name) if it does not open or does not read;
        ServingError UNAVAILABLE when the server cannot check it (its checking process does not start, or answers
        garbage). Blocking: call it off the event loop."""
        if len(handle) != HANDLE_BYTES:
            raise DeviceMemoryError(f"a CUDA IPC handle is {HANDLE_BYTES} bytes, not {len(handle)}")
        with self._lock:
            answer = self._ask({"handle": handle.hex(), "device": device, "nbytes": nbytes})
        if "extent" in answer:
            return int(answer["extent"])
        reason = str(answer.get("reason", "it could not be checked"))
        if answer.get("unavailable"):  # the server's failure, not the handle's: the client may retry
            raise ServingError(Status.UNAVAILABLE, f"the CUDA IPC handle could not be checked: {reason}; retry")
        raise DeviceMemoryError(reason, str(answer.get("cuda_error", "")))

    def _ask(self, request: dict) -> dict:
        proc = self._child()
        if proc is None:
            return {"reason": "the server could not start the process that checks CUDA IPC handles (see its log)",
                    "unavailable": True}
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = _readline(proc, CHECK_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            log.warning("the CUDA IPC handle checker failed (%s): starting another for the next handle", exc)
            self._stop(proc)
            return {"reason": "the process that checks CUDA IPC handles did not answer in time"}
        if not line:  # it died: the handle's read took its context with it
            self._stop(proc)
            return {"reason": "reading the memory it maps faulted (the handle does not name memory its exporter "
                              "allocated)", "cuda_error": "cudaErrorIllegalAddress"}
        answer = _parse(line)
        if answer is None or ("extent" in answer and type(answer["extent"]) is not int):
            # Not an answer: whatever it still writes must not be read as the next handle's
            log.warning("the CUDA IPC handle checker wrote %r: starting another for the next handle", line[:200])
            self._stop(proc)
            return {"reason": "the process that checks CUDA IPC handles answered garbage", "unavailable": True}
        if answer.get("exit"):  # its context cannot be trusted any more
            self._stop(proc)
        return answer

    def _child(self) -> subprocess.Popen[str] | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        try:
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    bufsize=1, close_fds=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except OSError as exc:
            log.error("the CUDA IPC handle checker did not start: %s", exc)
            return None
        try:
            line = _readline(proc, START_TIMEOUT_S)
        except TimeoutError as exc:
            log.error("the CUDA IPC handle checker did not start: %s", exc)
            self._stop(proc)
            return None
        if (_parse(line) or {}).get("ready") is not True:
            log.error("the CUDA IPC handle checker did not start: %s", line.strip() or "it exited")
            self._stop(proc)
            return None
        self._proc = proc
        self.started += 1
        return proc

    def _stop(self, proc: subprocess.Popen[str]) -> None:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        if self._proc is proc:
            self._proc = None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop(self._proc)


def _parse(line: str) -> dict | None:
    """The child's JSON object on ``line``; None for anything else."""
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """One line of the child's, or TimeoutError (the child is then killed by the caller)."""
    assert proc.stdout is not None
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)  # type: ignore
    reader.start()
    reader.join(timeout_s)
    if reader.is_alive():
        proc.kill()
        reader.join(5)
        raise TimeoutError(f"no answer within {timeout_s:.0f} s")
    return result[0] if result else ""


# --- the child ----------------------------------------------------------------------------------------------------

class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]  # CUipcMemHandle, passed by value (raw bytes: a
    # c_char field would stop at the first NUL)


class _Driver:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, p(ctypes.c_char_p)]
        lib.cuDeviceGet.argtypes = [p(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [p(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuIpcOpenMemHandle_v2.argtypes = [p(u64), _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [u64]
        lib.cuMemGetAddressRange_v2.argtypes = [p(u64), p(size_t), u64]
        lib.cuMemAlloc_v2.argtypes = [p(u64), size_t]
        lib.cuMemcpyDtoD_v2.argtypes = [u64, u64, size_t]
        lib.cuCtxSynchronize.argtypes = []
        self.lib = lib
        self._check(lib.cuInit(0), "cuInit")
        self._contexts: dict[int, tuple[ctypes.c_void_p, int]] = {}  # device -> (primary context, scratch buffer)

    def name(self, code: int) -> str:
        text = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(text))
        return (text.value or b"").decode() or f"CUresult {code}"

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            raise _Failed(call, self.name(code))

    def _on(self, device: int) -> int:
        """Make ``device``'s primary context current; its scratch buffer."""
        if device not in self._contexts:
            handle, context = ctypes.c_int(), ctypes.c_void_p()
            self._check(self.lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle.value),
                        "cuDevicePrimaryCtxRetain")
            self._check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
            buffer = ctypes.c_uint64()
            self._check(self.lib.cuMemAlloc_v2(ctypes.byref(buffer), CHUNK_BYTES), "cuMemAlloc")
            self._contexts[device] = (context, buffer.value)
        context, scratch = self._contexts[device]
        self._check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        return scratch

    def check(self, handle: bytes, device: int, nbytes: int | None) -> dict:
        scratch = self._on(device)
        address = ctypes.c_uint64()
        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, as the server opens it
        code = self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(address), _Handle.from_buffer_copy(handle), 1)
        if code != 0:  # nothing mapped: the context is fine
            return {"reason": "it does not open", "cuda_error": self.name(code)}
        try:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            self._check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address.value),
                        "cuMemGetAddressRange")
            extent = base.value + size.value - address.value
            end = extent if nbytes is None else min(max(0, nbytes), extent)
            done = 0
            while done < end:  # every byte the server may read or write through this mapping
                n = min(CHUNK_BYTES, end - done)
                self._check(self.lib.cuMemcpyDtoD_v2(scratch, address.value + done, n), "cuMemcpyDtoD")
                done += n
            # A device-to-device copy returns before it is done (no host-side synchronization): its fault is
            # known only here
            self._check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")
        except _Failed as failed:
            return {"reason": f"reading the memory it maps failed ({failed.call})", "cuda_error": failed.name,
                    "exit": True}
        self._check(self.lib.cuIpcCloseMemHandle(address.value), "cuIpcCloseMemHandle")
        return {"extent": extent}


class _Failed(Exception):
    def __init__(self, call: str, name: str) -> None:
        super().__init__(f"{call}: {name}")
        self.call, self.name = call, name


def _serve() -> int:
    """Requests on stdin, one JSON line each ({"handle": hex, "device": n, "nbytes": n or null}); one answer line each
    on stdout:
    {"extent": bytes} or {"reason", "cuda_error"[, "exit"]}. Exits after a failed read (its context is poisoned)."""
    try:
        driver = _Driver()
    except (OSError, _Failed) as exc:
        print(json.dumps({"ready": False, "error": str(exc)}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            nbytes = request.get("nbytes")
            answer = driver.check(bytes.fromhex(request["handle"]), int(request["device"]),
                                  None if nbytes is None else int(nbytes))
        except _Failed as failed:  # the context itself failed: say so and go
            answer = {"reason": f"{failed.call} failed", "cuda_error": failed.name, "exit": True}
        print(json.dumps(answer), flush=True)
        if answer.get("exit"):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
