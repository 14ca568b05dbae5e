"""Hostile and careless CUDA shared-memory clients against a real server on a GPU: garbage and forged IPC handles,
handles of the wrong length, of the server's own process, of memory freed before or after registration, sizes
beyond the allocation, device ids out of range, an unregister while requests read the region, and the client
process dying while registered.

None may crash the server or leave the CUDA context in a sticky error: after every case the server answers a
wire request and a request in a fresh legitimate CUDA region (input read there, output written there) with
float64's answers, the process's CUDA context still runs work, and voxserve_input_bytes_total{path="cuda_shm"}
counted the bytes of exactly the requests that read a region. The client's memory is another process's
(tests/cuda_exporter.py). Skipped without a CUDA device."""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from voxserve.client import Client, InferenceError
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.model import relative_error

from ..conftest import ServerThread
from ..cuda_exporter import GRANULE, HANDLE_BYTES, Exporter, NoExporter, own_process_handle

pytestmark = pytest.mark.gpu

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
# A request on memory its exporter freed, or whose exporter died: its stale bytes, or an error of its own; never
# the server's end (UNAVAILABLE: the device lost) or an unknown failure.
STALE_ERRORS = (INVALID, grpc.StatusCode.INTERNAL)
SAMPLE = (1, 3, 16, 32, 32)


# --- fixtures and checks --------------------------------------------------------------------------------------

def _exporter() -> Exporter:
    try:
        return Exporter()
    except NoExporter as exc:
        pytest.skip(f"no exporter process: {exc}")


@pytest.fixture(scope="module")
def healthy(gpu_server) -> Iterator[Exporter]:
    """A well-behaved client process: the fresh legitimate regions of the checks after each case."""
    with _exporter() as exporter:
        yield exporter


@pytest.fixture
def hostile(gpu_server) -> Iterator[Exporter]:
    """The case's own client process (killed, exited, freeing its memory)."""
    with _exporter() as exporter:
        yield exporter


@pytest.fixture
def client(gpu_server) -> Iterator[Client]:
    with Client(gpu_server.url, timeout_s=60) as c:
        yield c
        # nothing a case registered outlives it (the next case registers the same names)
        c.unregister_cuda_shared_memory()


def _x(n: int = 2) -> np.ndarray:
    return np.random.default_rng().standard_normal((n, *SAMPLE[1:]), dtype=np.float32)


def _assert_exact(y: np.ndarray, x: np.ndarray) -> None:
    """``y`` is the model's answer to ``x`` within 1e-5 of float64."""
    w, b = reference_weights()
    assert y.shape == (x.shape[0], w.shape[0])
    assert relative_error(torch.from_numpy(np.ascontiguousarray(y)), reference_float64(torch.from_numpy(x), w, b)) \
        <= 1e-5


def _cout() -> int:
    return int(reference_weights()[0].shape[0])


def _counted(srv: ServerThread, path: str) -> float:
    return srv.server.metrics.registry.get_sample_value("voxserve_input_bytes_total",
                                                        {"model": "voxnet", "path": path}) or 0.0


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except InferenceError as exc:
        return exc.code
    return OK


def _refused(code: grpc.StatusCode, call: Callable[[], object]) -> InferenceError:
    with pytest.raises(InferenceError) as err:
        call()
    assert err.value.code == code, err.value
    return err.value


def _until(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Wait for ``condition`` (a guard against a hang, not a time limit on the server)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still not so after {limit_s:.0f} s: {what}")
        time.sleep(0.01)


def _assert_still_serving(srv: ServerThread, exporter: Exporter) -> None:
    """The server answers a wire request and requests in a fresh legitimate CUDA region correctly, counts their
    bytes by path, holds no region afterwards, and the process's CUDA context runs work (no sticky error)."""
    x = _x()
    out = x.shape[0] * _cout() * 4
    before = {p: _counted(srv, p) for p in ("wire", "cuda_shm")}
    with Client(srv.url, timeout_s=60) as client:
        _assert_exact(client.infer(x), x)
        memory = exporter.alloc(x.nbytes + out, x.tobytes())
        name = f"fresh-{uuid.uuid4().hex[:8]}"
        client.register_cuda_shared_memory(name, memory.handle, 0, x.nbytes + out)
        try:
            assert client.infer_shared_memory(x.shape, name, output_region=name, output_offset=x.nbytes) is None
            written = np.frombuffer(exporter.read(memory, x.nbytes, out), "<f4").reshape(x.shape[0], _cout())
            _assert_exact(written.copy(), x)
            _assert_exact(client.infer_shared_memory(x.shape, name), x)
        finally:
            client.unregister_cuda_shared_memory(name)
            exporter.free(memory)
        assert client.cuda_shared_memory_status() == {}
    assert _counted(srv, "wire") - before["wire"] == x.nbytes
    assert _counted(srv, "cuda_shm") - before["cuda_shm"] == 2 * x.nbytes
    torch.cuda.synchronize()  # the server's own context (it runs in this process): raises on a sticky error
    assert float((torch.ones(64, device="cuda") * 2).sum().item()) == 128.0
    assert srv.server.state.runner is not None and srv.server.state.runner.device_lost is None


class _CudaBytes:
    """voxserve_input_bytes_total{path="cuda_shm"} over a case: ``expect`` what its requests read."""

    def __init__(self, srv: ServerThread) -> None:
        self.srv, self.start, self.expected = srv, _counted(srv, "cuda_shm"), 0

    def expect(self, nbytes: int) -> None:
        self.expected += nbytes

    def check(self) -> None:
        assert _counted(self.srv, "cuda_shm") - self.start == self.expected


# --- handles that map nothing of the client's -------------------------------------------------------------------

def test_garbage_handles_are_refused(gpu_server, healthy, client):
    counted = _CudaBytes(gpu_server)
    garbage = [os.urandom(HANDLE_BYTES) for _ in range(8)] + [bytes(HANDLE_BYTES), b"\xff" * HANDLE_BYTES]
    for handle in garbage:
        err = _refused(INVALID, lambda h=handle: client.register_cuda_shared_memory("garbage", h, 0, GRANULE))
        assert handle.hex() not in err.message  # a handle is never echoed
        _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status("garbage"))
        _refused(NOT_FOUND, lambda: client.infer_shared_memory(SAMPLE, "garbage"))
    assert client.cuda_shared_memory_status() == {}
    counted.check()
    _assert_still_serving(gpu_server, healthy)


def test_a_live_handle_with_one_byte_flipped(gpu_server, healthy, hostile, client):
    """Each of the 64 bytes of a live handle flipped in turn: refused, or (where the driver ignores that byte, or
    maps another aligned place of the same allocation) memory of the same client, read as the model reads any
    bytes: an answer whose rows are distributions, or INVALID_ARGUMENT; never the device's end. (A flip of the
    handle's offset bytes maps a misaligned address inside the allocation: refused at registration, else the
    kernel's read faults and every client loses the device.)"""
    counted = _CudaBytes(gpu_server)
    x = _x()
    memory = hostile.alloc(x.nbytes, x.tobytes())
    opened, same = [], []
    for position in range(HANDLE_BYTES):
        forged = bytearray(memory.handle)
        forged[position] ^= 0xFF
        code = _code(lambda f=bytes(forged): client.register_cuda_shared_memory("flipped", f, 0, x.nbytes))
        assert code in (INVALID, OK), f"byte {position}: {code}"
        if code == OK:
            opened.append(position)
            try:
                y = client.infer_shared_memory(x.shape, "flipped")
            except InferenceError as exc:
                assert exc.code == INVALID, f"byte {position}: {exc}"
            else:
                counted.expect(x.nbytes)
                assert np.isfinite(y).all() and np.allclose(y.sum(axis=1), 1.0, atol=1e-4), f"byte {position}"
                w, b = reference_weights()
                if relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5:
                    same.append(position)
            client.unregister_cuda_shared_memory("flipped")
        _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status("flipped"))
    print(f"positions whose flip still opened the client's memory: {opened}; at the same place: {same}")
    assert len(opened) < HANDLE_BYTES  # the handle's bytes are checked at all
    # the genuine handle still opens, and reads the client's bytes
    client.register_cuda_shared_memory("genuine", memory.handle, 0, x.nbytes)
    _assert_exact(client.infer_shared_memory(x.shape, "genuine"), x)
    counted.expect(x.nbytes)
    client.unregister_cuda_shared_memory("genuine")
    counted.check()
    _assert_still_serving(gpu_server, healthy)


def test_tensors_that_do_not_start_on_a_whole_element(gpu_server, healthy, hostile, client):
    """An input at an offset that is no multiple of its element's size would fault the kernel's loads: refused
    INVALID_ARGUMENT; the same tensor on a whole element is read exactly."""
    counted = _CudaBytes(gpu_server)
    x = _x()
    memory = hostile.alloc(x.nbytes + 16, bytes(4) + x.tobytes())
    client.register_cuda_shared_memory("misaligned", memory.handle, 0, memory.size)
    for offset in (1, 2, 3, 6):
        err = _refused(INVALID, lambda o=offset: client.infer_shared_memory(x.shape, "misaligned", input_offset=o))
        assert "multiple of 4 bytes" in err.message
    _assert_exact(client.infer_shared_memory(x.shape, "misaligned", input_offset=4), x)
    counted.expect(x.nbytes)
    client.unregister_cuda_shared_memory("misaligned")
    counted.check()
    _assert_still_serving(gpu_server, healthy)


def test_handles_of_the_wrong_length(gpu_server, healthy, hostile, client):
    counted = _CudaBytes(gpu_server)
    x = _x()
    memory = hostile.alloc(x.nbytes, x.tobytes())
    h = memory.handle
    for wrong in (h[:63], h + b"\0", h + h[:1], b"", h * 2, base64.b64encode(h)):
        err = _refused(INVALID, lambda w=wrong: client.register_cuda_shared_memory("length", w, 0, x.nbytes))
        assert str(len(wrong)) in err.message
        _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status("length"))
    client.register_cuda_shared_memory("length", h, 0, x.nbytes)
    _assert_exact(client.infer_shared_memory(x.shape, "length"), x)
    counted.expect(x.nbytes)
    client.unregister_cuda_shared_memory("length")
    counted.check()
    _assert_still_serving(gpu_server, healthy)


def test_a_handle_of_the_servers_own_process(gpu_server, healthy, client):
    """The server runs in this process: memory this process exports is the server's own, which the driver
    refuses to open (cudaErrorDeviceUninitialized)."""
    counted = _CudaBytes(gpu_server)
    handle, free = own_process_handle()
    try:
        _refused(INVALID, lambda: client.register_cuda_shared_memory("own", handle, 0, GRANULE))
        _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status("own"))
    finally:
        free()
    counted.check()
    _assert_still_serving(gpu_server, healthy)


def test_device_ids_out_of_range(gpu_server, healthy, hostile, client):
    counted = _CudaBytes(gpu_server)
    x = _x()
    memory = hostile.alloc(x.nbytes, x.tobytes())
    count = torch.cuda.device_count()
    for device in (-1, count, 2**31, 2**63 - 1, -(2**63)):
        err = _refused(INVALID, lambda d=device: client.register_cuda_shared_memory("device", memory.handle, d,
                                                                                    x.nbytes))
        assert str(device) in err.message
        _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status("device"))
    client.register_cuda_shared_memory("device", memory.handle, 0, x.nbytes)
    assert client.cuda_shared_memory_status("device") == {"device": (0, x.nbytes)}
    _assert_exact(client.infer_shared_memory(x.shape, "device"), x)
    counted.expect(x.nbytes)
    client.unregister_cuda_shared_memory("device")
    counted.check()
    _assert_still_serving(gpu_server, healthy)


# --- sizes --------------------------------------------------------------------------------------------------------

def test_byte_size_beyond_the_allocation(gpu_server, healthy, hostile, client):
    """The allocation's real extent bounds the registration (whatever the client claims), and the region bounds
    every request: the input here ends where the allocation ends."""
    counted = _CudaBytes(gpu_server)
    x = _x()
    memory = hostile.alloc(GRANULE)
    assert memory.extent == memory.size == GRANULE
    at = memory.size - x.nbytes
    hostile.write(memory, at, x.tobytes())
    for claimed in (memory.size + 1, memory.size + GRANULE, 2**63, 2**64 - 1, 0):
        _refused(INVALID, lambda c=claimed: client.register_cuda_shared_memory("sized", memory.handle, 0, c))
        _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status("sized"))
    client.register_cuda_shared_memory("sized", memory.handle, 0, memory.size)  # all of it: fine
    assert client.cuda_shared_memory_status("sized") == {"sized": (0, memory.size)}
    _assert_exact(client.infer_shared_memory(x.shape, "sized", input_offset=at), x)
    counted.expect(x.nbytes)
    # past the region's end, by a little and by a lot: refused before anything is read
    for offset in (at + 4, memory.size, 2**62):
        _refused(INVALID, lambda o=offset: client.infer_shared_memory(x.shape, "sized", input_offset=o))
    # an output past the end: refused before the execution (where the execution writes it, its span is checked
    # with the input's), so nothing is read
    out = x.shape[0] * _cout() * 4
    _refused(INVALID, lambda: client.infer_shared_memory(x.shape, "sized", input_offset=at, output_region="sized",
                                                         output_offset=memory.size - out + 4))
    # an output inside the region: written there
    assert client.infer_shared_memory(x.shape, "sized", input_offset=at, output_region="sized",
                                      output_offset=0) is None
    counted.expect(x.nbytes)
    _assert_exact(np.frombuffer(hostile.read(memory, 0, out), "<f4").reshape(x.shape[0], _cout()).copy(), x)
    client.unregister_cuda_shared_memory("sized")
    counted.check()
    _assert_still_serving(gpu_server, healthy)


# --- memory freed, clients gone -----------------------------------------------------------------------------------

def _whatever_it_maps(client: Client, name: str, handle: bytes, x: np.ndarray, counted: _CudaBytes) -> str:
    """Register ``handle`` and infer from it: refused INVALID_ARGUMENT, or answered with distributions (bytes of the
    exporter's, whatever they are now) or refused INVALID_ARGUMENT; never the device's end. What happened."""
    code = _code(lambda: client.register_cuda_shared_memory(name, handle, 0, x.nbytes))
    assert code in (INVALID, OK), code
    if code == INVALID:
        _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status(name))
        return "refused"
    try:
        y = client.infer_shared_memory(x.shape, name)
    except InferenceError as exc:
        assert exc.code == INVALID, exc
        answer = "opened, request refused"
    else:
        counted.expect(x.nbytes)
        assert np.isfinite(y).all() and np.allclose(y.sum(axis=1), 1.0, atol=1e-4)
        answer = "opened, answered"
    client.unregister_cuda_shared_memory(name)
    return answer


def test_memory_freed_before_registration(gpu_server, healthy, hostile, client):
    """A handle of memory its exporter has freed: on an H200 the driver still opens it. Refused, or read (the
    checking child read the whole range first), never the device's end; also once the exporter has allocated
    again, whose new handle reads its own bytes exactly."""
    counted = _CudaBytes(gpu_server)
    x = _x()
    memory = hostile.alloc(x.nbytes, x.tobytes())
    assert hostile.free(memory) == "CUDA_SUCCESS"
    print("freed, before registration:", _whatever_it_maps(client, "freed", memory.handle, x, counted))
    again = hostile.alloc(x.nbytes, x.tobytes())
    print("freed, after a new allocation:", _whatever_it_maps(client, "freed", memory.handle, x, counted))
    client.register_cuda_shared_memory("freed", again.handle, 0, x.nbytes)  # the new handle opens
    _assert_exact(client.infer_shared_memory(x.shape, "freed"), x)
    counted.expect(x.nbytes)
    client.unregister_cuda_shared_memory("freed")
    counted.check()
    _assert_still_serving(gpu_server, healthy)


def _requests_on_stale_memory(client: Client, name: str, x: np.ndarray, counted: _CudaBytes) -> None:
    """Requests on a region whose memory its client let go of: each answered with the stale bytes' right answer
    (the mapping keeps them) or refused with an error of its own; the server stays."""
    for output_region in (None, name, None, name):
        try:
            y = client.infer_shared_memory(x.shape, name, output_region=output_region, output_offset=x.nbytes)
        except InferenceError as exc:
            assert exc.code in STALE_ERRORS, exc
            if exc.code == grpc.StatusCode.INTERNAL:  # failed after its input was read
                counted.expect(x.nbytes)
            continue
        counted.expect(x.nbytes)
        if output_region is None:
            assert y is not None
            _assert_exact(y, x)
        else:
            assert y is None  # written into the memory the client let go of: nobody can read it back


def test_memory_freed_after_registration(gpu_server, healthy, hostile, client):
    counted = _CudaBytes(gpu_server)
    x = _x()
    out = x.shape[0] * _cout() * 4
    memory = hostile.alloc(x.nbytes + out, x.tobytes())
    client.register_cuda_shared_memory("later", memory.handle, 0, x.nbytes + out)
    _assert_exact(client.infer_shared_memory(x.shape, "later"), x)
    counted.expect(x.nbytes)
    assert hostile.free(memory) == "CUDA_SUCCESS"
    _requests_on_stale_memory(client, "later", x, counted)
    assert client.cuda_shared_memory_status("later") == {"later": (0, x.nbytes + out)}
    client.unregister_cuda_shared_memory("later")
    _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status("later"))
    _refused(NOT_FOUND, lambda: client.infer_shared_memory(x.shape, "later"))
    _until(lambda: gpu_server.server.cuda_shm.draining == 0, "the freed region's mapping closed")
    counted.check()
    _assert_still_serving(gpu_server, healthy)


@pytest.mark.parametrize("ending", ["SIGKILL", "exit"])
def test_the_client_process_dies_while_registered(gpu_server, healthy, hostile, client, ending):
    counted = _CudaBytes(gpu_server)
    x = _x()
    out = x.shape[0] * _cout() * 4
    memory = hostile.alloc(x.nbytes + out, x.tobytes())
    client.register_cuda_shared_memory("orphan", memory.handle, 0, x.nbytes + out)
    _assert_exact(client.infer_shared_memory(x.shape, "orphan"), x)
    counted.expect(x.nbytes)
    if ending == "SIGKILL":
        hostile.kill()
    else:
        hostile.exit()
    assert not hostile.alive
    _requests_on_stale_memory(client, "orphan", x, counted)
    client.unregister_cuda_shared_memory("orphan")
    _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status("orphan"))
    _refused(NOT_FOUND, lambda: client.infer_shared_memory(x.shape, "orphan"))
    _until(lambda: gpu_server.server.cuda_shm.draining == 0, "the dead client's mapping closed")
    counted.check()
    _assert_still_serving(gpu_server, healthy)


# --- unregister while requests read -------------------------------------------------------------------------------

def test_unregister_racing_sixteen_requests(gpu_server, healthy, hostile, client):
    """Sixteen requests and an unregister sent together: each request answered correctly or NOT_FOUND (it came
    after), nothing else; the mapping closes once the last reader is done; the name registers again."""
    counted = _CudaBytes(gpu_server)
    x = _x(16)
    row = x[0].nbytes
    memory = hostile.alloc(x.nbytes, x.tobytes())
    client.register_cuda_shared_memory("race", memory.handle, 0, x.nbytes)

    def one(i: int) -> np.ndarray | InferenceError:
        try:
            return client.infer_shared_memory(SAMPLE, "race", input_offset=i * row)  # type: ignore[return-value]
        except InferenceError as exc:
            return exc

    with ThreadPoolExecutor(17) as pool:
        answers = [pool.submit(one, i) for i in range(16)]
        unregistering = pool.submit(client.unregister_cuda_shared_memory, "race")
        unregistering.result(120)
        results = [a.result(120) for a in answers]
    for i, result in enumerate(results):
        if isinstance(result, InferenceError):
            assert result.code == NOT_FOUND, result
        else:
            _assert_exact(result, x[i:i + 1])
            counted.expect(row)
    _until(lambda: gpu_server.server.cuda_shm.draining == 0, "the unregistered region's mapping closed")
    client.register_cuda_shared_memory("race", memory.handle, 0, x.nbytes)
    _assert_exact(client.infer_shared_memory(x.shape, "race"), x)
    counted.expect(x.nbytes)
    client.unregister_cuda_shared_memory("race")
    counted.check()
    _assert_still_serving(gpu_server, healthy)


# (last: if closing the drained mapping unmapped the re-registered one, the process's context would be gone)
@pytest.mark.parametrize("again", ["another allocation", "the same handle"])
def test_unregister_while_sixteen_requests_read_the_region(gpu_server, healthy, hostile, client, monkeypatch,
                                                           again):
    """Sixteen requests hold the region (their leases taken, the first execution held before the GPU reads, the
    rest queued behind it) when it is unregistered: the name is free at once (NOT_FOUND, registered again at
    once, by another allocation or by the same handle) while the mapping stays until they finish, each with
    float64's answer for the bytes it was sent for; then the mapping closes, and the new registration reads its
    own memory."""
    srv = gpu_server
    registry = srv.server.cuda_shm
    runner = srv.server.state.runner
    assert registry is not None and runner is not None
    counted = _CudaBytes(srv)
    x = _x(16)
    row = x[0].nbytes
    memory = hostile.alloc(x.nbytes, x.tobytes())
    if again == "the same handle":
        later_x, later = x, memory
    else:
        later_x = _x(16)
        later = hostile.alloc(later_x.nbytes, later_x.tobytes())
    client.register_cuda_shared_memory("busy", memory.handle, 0, x.nbytes)

    leased = [0]
    counting = threading.Lock()
    real_lease = registry.lease

    def lease(name, offset, byte_size, what, open_here=True):
        taken = real_lease(name, offset, byte_size, what, open_here)
        if name == "busy":
            with counting:
                leased[0] += 1
        return taken

    go, executing = threading.Event(), threading.Event()

    def held(real):
        def submit_device(*args):  # (on the submit thread: the event loop goes on)
            executing.set()
            if not go.wait(120):
                raise RuntimeError("the test never let the execution go")
            return real(*args)
        return submit_device

    monkeypatch.setattr(registry, "lease", lease)
    for worker in runner.workers:  # the execution of tensors in CUDA memory (the pipeline's native path)
        pipeline = worker.model.gpu_pipeline
        monkeypatch.setattr(pipeline, "_submit_device", held(pipeline._submit_device))
    pool = ThreadPoolExecutor(16)
    try:
        answers = [pool.submit(client.infer_shared_memory, SAMPLE, "busy", input_offset=i * row) for i in range(16)]
        _until(lambda: leased[0] == 16 and executing.is_set(), "16 requests leased the region, one executing")
        assert not any(a.done() for a in answers)
        client.unregister_cuda_shared_memory("busy")  # returns at once: it does not wait for the readers
        assert registry.draining == 1
        assert client.cuda_shared_memory_status() == {}
        _refused(NOT_FOUND, lambda: client.cuda_shared_memory_status("busy"))
        _refused(NOT_FOUND, lambda: client.infer_shared_memory(SAMPLE, "busy"))
        client.register_cuda_shared_memory("busy", later.handle, 0, later_x.nbytes)  # the name is free
        assert client.cuda_shared_memory_status() == {"busy": (0, later_x.nbytes)}
        assert registry.draining == 1 and not any(a.done() for a in answers)
    finally:
        go.set()
        pool.shutdown(wait=True)
    for i, answer in enumerate(answers):
        _assert_exact(answer.result(), x[i:i + 1])
    counted.expect(16 * row)
    _until(lambda: registry.draining == 0, "the unregistered mapping closed after its last reader")
    monkeypatch.undo()
    # the old mapping's close left the new registration's mapping (the same memory, with the same handle) intact
    for _ in range(2):
        _assert_exact(client.infer_shared_memory(later_x.shape, "busy"), later_x)
        counted.expect(later_x.nbytes)
    client.unregister_cuda_shared_memory("busy")
    assert registry.draining == 0
    counted.check()
    _assert_still_serving(srv, healthy)



def test_every_handle_is_read_by_another_process_before_the_server_maps_it(gpu_server, healthy, hostile, client):
    """The server's guard against handles the exporter's memory does not back (server/core/ipccheck.py): a child
    process opens the handle and reads the region's bytes first; a live handle's range is its allocation."""
    checker = gpu_server.server.cuda_shm.devices.checker
    x = _x()
    memory = hostile.alloc(x.nbytes, x.tobytes())
    client.register_cuda_shared_memory("checked", memory.handle, 0, x.nbytes)
    assert checker.started >= 1 and checker._proc is not None and checker._proc.poll() is None
    assert checker.check(memory.handle, 0) == memory.extent
    _assert_exact(client.infer_shared_memory(x.shape, "checked"), x)
    client.unregister_cuda_shared_memory("checked")
    _assert_still_serving(gpu_server, healthy)
