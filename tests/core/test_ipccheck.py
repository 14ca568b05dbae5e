"""The process that reads a CUDA IPC handle's memory before the server maps it (server/core/ipccheck.py), driven here
with a stand-in child that answers as the real one does (a range read, a refusal, a fault that kills it, a hang);
the real child runs in the GPU tests (tests/core/test_cuda_shm_hostile_gpu.py)."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from voxserve.server.core import ipccheck
from voxserve.server.core.devicemem import DeviceMemoryError
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.core.ipccheck import HandleChecker

# The handle's first byte says what the stand-in does with it.
STANDIN = r"""
import json, sys, time
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    handle = bytes.fromhex(request["handle"])
    if handle[0] == 7:  # says what it was asked to read
        print(json.dumps({"extent": request["nbytes"] if request["nbytes"] is not None else -1}), flush=True)
    elif handle[0] == 1:
        print(json.dumps({"extent": 4096 * handle[1]}), flush=True)
    elif handle[0] == 2:
        sys.exit(1)  # the read faulted and took the process with it
    elif handle[0] == 3:
        time.sleep(60)
    elif handle[0] == 5:  # something else on its stdout first (a library's message), then its answer
        print("a line that is not an answer", flush=True)
        print(json.dumps({"extent": 4096 * handle[1]}), flush=True)
    elif handle[0] == 6:
        print(json.dumps(["not", "an", "object"]), flush=True)
    elif handle[0] == 4:
        print(json.dumps({"reason": "reading the memory it maps failed (cuMemcpyDtoD)",
                          "cuda_error": "CUDA_ERROR_ILLEGAL_ADDRESS", "exit": True}), flush=True)
        sys.exit(1)
    else:
        print(json.dumps({"reason": "it does not open", "cuda_error": "CUDA_ERROR_INVALID_VALUE"}), flush=True)
"""


def _handle(kind: int, pages: int = 1) -> bytes:
    return bytes([kind, pages]) + bytes(62)


@pytest.fixture
def checker():
    c = HandleChecker([sys.executable, "-c", STANDIN])
    yield c
    c.close()


def _refused(checker: HandleChecker, handle: bytes) -> DeviceMemoryError:
    with pytest.raises(DeviceMemoryError) as err:
        checker.check(handle, 0)
    return err.value


def _unavailable(checker: HandleChecker, handle: bytes) -> str:
    """The server's own failure to check a handle: UNAVAILABLE (retry), not the client's INVALID_ARGUMENT."""
    with pytest.raises(ServingError) as err:
        checker.check(handle, 0)
    assert err.value.code == Status.UNAVAILABLE
    return err.value.message


def test_a_handle_whose_range_reads_gives_its_extent(checker):
    assert checker.check(_handle(1, 3), 0) == 3 * 4096
    assert checker.check(_handle(1, 5), 1) == 5 * 4096
    assert checker.started == 1  # one child for every check


def test_a_read_that_faults_refuses_the_handle_and_the_next_check_gets_a_new_child(checker):
    assert checker.check(_handle(1), 0) == 4096
    error = _refused(checker, _handle(2))
    assert "faulted" in error.reason and error.cuda_error == "cudaErrorIllegalAddress"
    assert checker.check(_handle(1, 2), 0) == 8192 and checker.started == 2
    error = _refused(checker, _handle(4))  # the child says so, then exits
    assert "cuMemcpyDtoD" in error.reason and error.cuda_error == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert checker.check(_handle(1), 0) == 4096 and checker.started == 3


def test_a_handle_that_does_not_open_keeps_the_child(checker):
    error = _refused(checker, _handle(9))
    assert error.reason == "it does not open" and error.cuda_error == "CUDA_ERROR_INVALID_VALUE"
    assert checker.check(_handle(1), 0) == 4096 and checker.started == 1


def test_a_child_that_hangs_is_killed_and_replaced(checker, monkeypatch):
    monkeypatch.setattr(ipccheck, "CHECK_TIMEOUT_S", 0.5)
    assert "did not answer in time" in _refused(checker, _handle(3)).reason
    assert checker.check(_handle(1), 0) == 4096 and checker.started == 2


def test_a_child_that_answers_garbage_is_replaced_and_the_next_handle_gets_its_own_answer(checker):
    """A line that is not an answer refuses the handle (UNAVAILABLE: the server's fault, not an INTERNAL error
    escaping) and ends the child: the answer it may still send must never be taken for the next handle's."""
    assert "garbage" in _unavailable(checker, _handle(5, 2))
    assert checker.check(_handle(1, 7), 0) == 7 * 4096 and checker.started == 2
    assert "garbage" in _unavailable(checker, _handle(6))
    assert checker.check(_handle(1, 3), 0) == 3 * 4096 and checker.started == 3


def test_a_child_that_starts_with_garbage_is_stopped(tmp_path):
    pid_file = str(tmp_path / "pid")
    broken = HandleChecker([sys.executable, "-c", f"import os, sys; open({pid_file!r}, 'w').write(str(os.getpid()));"
                            "print('not a hello', flush=True); sys.stdin.read()"])
    assert "could not start" in _unavailable(broken, _handle(1))
    with open(pid_file) as f:
        pid = int(f.read())
    with pytest.raises(ChildProcessError):  # killed and reaped: not left blocked on its stdin
        os.waitpid(pid, os.WNOHANG)


def test_no_child_no_registration():
    broken = HandleChecker([sys.executable, "-c", "import json; print(json.dumps({'ready': False}))"])
    assert "could not start" in _unavailable(broken, _handle(1))
    assert "64 bytes" in _refused(broken, b"short").reason


def test_the_real_child_says_why_it_cannot_start_without_a_driver(monkeypatch):
    """Without libcuda (this machine) the real child reports it is not ready, and the check is refused."""
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is present: the GPU tests run the real child")
    except OSError:
        pass
    real = HandleChecker()
    assert "could not start" in _unavailable(real, _handle(1)) and real.started == 0


def test_the_childs_handle_is_the_clients_64_bytes_nuls_and_all():
    """A handle is mostly zero bytes: a character-string field would cut it at the first NUL (and every live
    handle would then fail to open in the child)."""
    handle = bytes([7, 0, 0, 9]) + bytes(58) + b"\x00\xff"
    assert bytes(ipccheck._Handle.from_buffer_copy(handle)) == handle


class _AsyncFaultDriver:
    """libcuda's calls as the child makes them, for a handle whose range faults: a device-to-device copy returns
    at once (the driver API does no host-side synchronization for one), and its fault is known only once the
    context is synchronized; closing the mapping says nothing of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        def call(*args):
            self.calls.append(name)
            if name == "cuIpcOpenMemHandle_v2":
                args[0]._obj.value = 1 << 20
            elif name == "cuMemGetAddressRange_v2":
                args[0]._obj.value, args[1]._obj.value = 1 << 20, 3 * ipccheck.CHUNK_BYTES // 2
            elif name == "cuGetErrorName":
                args[1]._obj.value = b"CUDA_ERROR_ILLEGAL_ADDRESS"
            elif name == "cuCtxSynchronize":
                return 700  # CUDA_ERROR_ILLEGAL_ADDRESS, of a copy above
            return 0

        return call


def test_the_child_reports_a_range_read_only_once_the_copies_are_done():
    """The extent is the answer only after every copy of the range has completed: an answer sent while they are
    still queued would pass a handle whose read then faults (and the child's next check would carry the error)."""
    fake = _AsyncFaultDriver()
    driver = object.__new__(ipccheck._Driver)
    driver.lib, driver._contexts = fake, {0: (ctypes.c_void_p(), 1 << 30)}
    answer = driver.check(_handle(1), 0, None)  # the whole range: 1.5 chunks
    assert fake.calls.count("cuMemcpyDtoD_v2") == 2
    assert answer.get("exit") is True and answer["cuda_error"] == "CUDA_ERROR_ILLEGAL_ADDRESS", answer
    assert "extent" not in answer
    fake.calls.clear()
    driver.check(_handle(1), 0, ipccheck.CHUNK_BYTES // 4)  # only the region's bytes
    assert fake.calls.count("cuMemcpyDtoD_v2") == 1


def test_the_child_is_told_how_many_bytes_the_server_may_access(checker):
    """It reads a region's byte_size from the mapped address, not the whole allocation: a registration costs the
    device no more than one request reading the region (a register/unregister loop on a large allocation would
    otherwise read all of it each time)."""
    assert checker.check(_handle(7), 0, 12345) == 12345
    assert checker.check(_handle(7), 0) == -1  # None: all of it
