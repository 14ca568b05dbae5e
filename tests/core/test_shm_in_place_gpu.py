"""System shared memory DMA'd straight from the client's pages on a GPU: no private host copy, float64's answers,
a segment truncated while registered and mid-request (INVALID_ARGUMENT or the client's own stale bytes, never a
crash: a CPU read of the truncated mapping would be a SIGBUS of the whole test process), an unregister while a
request reads the region, batches mixing in-place and wire inputs. Skipped without a CUDA device (run on the device
machine: bench/device_check.sh)."""

from __future__ import annotations

import gc
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible", allow_module_level=True)

from voxserve.client import Client, InferenceError
from voxserve.datatypes import from_wire, to_wire
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.hostmem import CudaPageLocker
from voxserve.server.core.model import Model, relative_error
from voxserve.server.core.pipeline import CudaPipeline
from voxserve.server.core.weights import default_weights
from voxserve.server.protocol.shm import SharedMemoryRegistry
from voxserve.testing.fake_hostmem import FakePageLocker

from ..conftest import running_server
from ..protocol.test_shm_in_place import _segment

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-5
W, B = reference_weights()
SHAPE = (8, 3, 16, 32, 32)




def _ref(x: np.ndarray) -> torch.Tensor:
    return reference_float64(torch.from_numpy(x), W, B)


def _eventually(condition, timeout_s: float = 10.0) -> bool:
    """Whether ``condition()`` holds within ``timeout_s``: a server thread lets go of a request's tensor (and its
    lease on the mapping) just after its answer is sent."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return bool(condition())


def _close(y: np.ndarray, x: np.ndarray) -> bool:
    return relative_error(torch.from_numpy(y), _ref(x)) <= FP32_TOL


@pytest.fixture(scope="module")
def gpu_server():
    with running_server(device="cuda") as srv:
        assert srv.wait_ready(), srv.server.load_error
        assert isinstance(srv.server.shm.locker, CudaPageLocker), "a GPU server reads system shm in place"
        assert not srv.server.shm.locker.refusal, srv.server.shm.locker.refusal
        yield srv


def _counts(srv) -> tuple[int, int, int, int]:
    registry, pipeline = srv.server.shm, srv.server.state.runner.model.pipeline
    return registry.copies, registry.in_place_reads, pipeline.staged_bytes, pipeline.direct_bytes


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_inputs_go_from_the_clients_segment_to_the_gpu_with_no_private_copy(gpu_server, datatype):
    x = np.random.default_rng().standard_normal(SHAPE, dtype=np.float32)
    wire = to_wire(x, datatype)
    exact = from_wire(wire, datatype, SHAPE).copy()  # the values the server sees, in float32 exactly
    with _segment(bytes(100) + wire) as (key, _), Client(gpu_server.url) as c:
        c.register_system_shared_memory("in", key, len(wire), offset=100)  # not on a page boundary
        copies, in_place, staged, direct = _counts(gpu_server)
        y = c.infer_shared_memory(SHAPE, "in", datatype=datatype)
        y2 = c.infer_shared_memory(SHAPE, "in", datatype=datatype)
        copies2, in_place2, staged2, direct2 = _counts(gpu_server)
        assert copies2 == copies and in_place2 - in_place == 2  # 0 private copies
        assert staged2 == staged and direct2 - direct == 2 * len(wire)  # and no staging copy either
        assert gpu_server.server.shm.pinned_bytes == 100 + len(wire)  # from the page the region starts in
        c.unregister_system_shared_memory("in")
    assert _close(y, exact) and _close(y2, exact)
    assert _eventually(lambda: gpu_server.server.shm.pinned_bytes == 0 and gpu_server.server.shm.draining == 0)


def test_batched_with_wire_requests_only_the_wire_inputs_are_staged(gpu_server):
    """Batch-1 requests from one segment and over the wire at once: batches mix them; the segment's are DMA'd in
    place (never copied on the host), the wire ones staged, whatever the batches turn out to be."""
    x = np.random.default_rng().standard_normal((16, *SHAPE[1:]), dtype=np.float32)
    row = x[0].nbytes
    with _segment(x[:8].tobytes()) as (key, _), Client(gpu_server.url) as c:
        c.register_system_shared_memory("rows", key, 8 * row)
        copies, _, staged, direct = _counts(gpu_server)

        def one(i: int) -> np.ndarray:
            if i < 8:
                return c.infer_shared_memory((1, *SHAPE[1:]), "rows", input_offset=i * row)
            return c.infer(x[i : i + 1])

        with ThreadPoolExecutor(16) as pool:
            ys = list(pool.map(one, range(16)))
        copies2, _, staged2, direct2 = _counts(gpu_server)
        c.unregister_system_shared_memory()
    assert _close(np.concatenate(ys), x)
    assert copies2 == copies and staged2 - staged == 8 * row and direct2 - direct == 8 * row


def test_a_segment_truncated_while_registered_is_refused_and_other_clients_are_served(gpu_server):
    x = np.random.default_rng().standard_normal(SHAPE, dtype=np.float32)
    with _segment(x.tobytes()) as (key, path), _segment(x.tobytes()) as (other, _), Client(gpu_server.url) as c:
        c.register_system_shared_memory("in", key, x.nbytes)
        c.register_system_shared_memory("other", other, x.nbytes)
        assert _close(c.infer_shared_memory(SHAPE, "in"), x)  # mapped and page-locked now
        os.truncate(path, 0)
        with pytest.raises(InferenceError) as err:
            c.infer_shared_memory(SHAPE, "in")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "now smaller" in err.value.message
        assert _close(c.infer_shared_memory(SHAPE, "other"), x)
        assert _close(c.infer(x), x)
        x2 = -x
        with open(path, "r+b") as f:  # grown back and written again: the same file, served again
            f.write(x2.tobytes())
        y = c.infer_shared_memory(SHAPE, "in")
        assert _close(y, x2) or _close(y, x)  # the client's new bytes or its stale ones (the pages locked first)
        c.unregister_system_shared_memory()


def test_a_segment_truncated_mid_request_gives_stale_bytes_or_invalid_argument_never_a_crash(gpu_server):
    x = np.random.default_rng().standard_normal(SHAPE, dtype=np.float32)
    with _segment(x.tobytes()) as (key, path), Client(gpu_server.url) as c:
        c.register_system_shared_memory("in", key, x.nbytes)
        assert _close(c.infer_shared_memory(SHAPE, "in"), x)
        start = threading.Barrier(9)

        def one(_: int):
            start.wait()
            try:
                return c.infer_shared_memory(SHAPE, "in")
            except InferenceError as exc:
                return exc

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(8)]
            start.wait()
            os.truncate(path, 0)  # while those requests are decoded, queued or DMA'd
            results = [f.result() for f in futures]
        for r in results:
            if isinstance(r, InferenceError):
                assert r.code == grpc.StatusCode.INVALID_ARGUMENT, (r.code, r.message)
            else:
                assert _close(r, x)  # the client's own bytes, as they were
        assert _close(c.infer(x), x)  # the server is alive and serves
        c.unregister_system_shared_memory()


def test_unregister_while_requests_read_the_region_is_deferred(gpu_server):
    x = np.random.default_rng().standard_normal(SHAPE, dtype=np.float32)
    registry = gpu_server.server.shm
    with _segment(x.tobytes()) as (key, _), Client(gpu_server.url) as c:
        c.register_system_shared_memory("in", key, x.nbytes)
        start = threading.Barrier(9)

        def one(_: int):
            start.wait()
            try:
                return c.infer_shared_memory(SHAPE, "in")
            except InferenceError as exc:
                return exc

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(8)]
            start.wait()
            c.unregister_system_shared_memory("in")
            results = [f.result() for f in futures]
        for r in results:
            if isinstance(r, InferenceError):
                assert r.code == grpc.StatusCode.NOT_FOUND, (r.code, r.message)
            else:
                assert _close(r, x)
        assert _eventually(lambda: registry.draining == 0 and registry.pinned_bytes == 0)
        assert _close(c.infer(x), x)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_the_pipeline_only_dmas_a_view_whose_segment_was_truncated(native):
    """The registry's view straight into the pipeline (both enqueue paths): alone and batched with a pageable
    array; its segment truncated before the DMA (a CPU read would fault: the process would die here); unregistered
    while the execution is in flight, unlocked only once it has finished."""
    model = Model(default_weights(), torch.device("cuda:0"), "fused-cuda", 64)
    assert model.pipeline is not None
    if not native:
        model.pipeline = CudaPipeline(model.device, model.cout, model.compute, model.graphs)
    pipeline = model.pipeline
    registry = SharedMemoryRegistry(locker=CudaPageLocker())
    x = np.random.default_rng().standard_normal(SHAPE, dtype=np.float32)
    other = np.random.default_rng().standard_normal((2, *SHAPE[1:]), dtype=np.float32)
    try:
        with _segment(x.tobytes()) as (key, path):
            registry.register("in", key, 0, x.nbytes)
            view = np.frombuffer(registry.read("in", 0, x.nbytes, "input 'x'"), np.float32).reshape(SHAPE)
            assert registry.copies == 0
            os.truncate(path, 0)
            staged, direct = pipeline.staged_bytes, pipeline.direct_bytes
            y, _ = model.run_arrays([view], "FP32")
            assert _close(y, x)  # the pages locked at registration: the client's own stale bytes
            y2, _ = model.run_arrays([view[:3], other, view[3:]], "FP32")
            assert _close(y2, np.concatenate([x[:3], other, x[3:]]))
            assert pipeline.staged_bytes - staged == other.nbytes  # the pageable one only
            assert pipeline.direct_bytes - direct == 2 * x.nbytes
            pending = pipeline.submit([view], "FP32")
            assert pending is not None
            registry.unregister("in")
            del view
            gc.collect()
            assert registry.draining == 1  # the execution still holds the view
            y3 = pipeline.wait(pending)[0]
            del pending
            gc.collect()
            assert registry.draining == 0 and registry.pinned_bytes == 0
            assert _close(y3, x)
    finally:
        registry.close()


def test_a_refused_page_lock_copies_into_pinned_memory(gpu_server):
    registry = gpu_server.server.shm
    real = registry.locker
    refusing = FakePageLocker()
    refusing.refuse = True
    registry.locker = refusing
    x = np.random.default_rng().standard_normal(SHAPE, dtype=np.float32)
    try:
        with _segment(x.tobytes()) as (key, _), Client(gpu_server.url) as c:
            c.register_system_shared_memory("in", key, x.nbytes)
            copies, in_place, staged, direct = _counts(gpu_server)
            assert _close(c.infer_shared_memory(SHAPE, "in"), x)
            copies2, in_place2, staged2, direct2 = _counts(gpu_server)
            assert copies2 - copies == 1 and in_place2 == in_place
            assert staged2 == staged and direct2 - direct == x.nbytes  # the copy lands in pinned memory
            c.unregister_system_shared_memory()
    finally:
        registry.locker = real
