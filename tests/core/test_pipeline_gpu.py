"""The GPU data path: pinned staging, overlapping executions, CUDA-event timings, real out-of-memory recovery,
and several GPUs. Skipped without a CUDA device (run on the device machine: bench/device_check.sh)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible", allow_module_level=True)

from voxserve.client import Client, InferenceError
from voxserve.kernels import reference_float64
from voxserve.server.core.batching import BatchingConfig
from voxserve.server.core.model import Model, relative_error, wire_to_tensor
from voxserve.server.core.pipeline import CudaPipeline
from voxserve.server.core.runner import Runner
from voxserve.server.core.stats import ModelStats
from voxserve.server.core.weights import default_weights
from voxserve.server.metrics import Metrics

from ..conftest import running_server

FP32_TOL = 1e-5
WIRE = {"FP32": np.float32, "FP16": np.float16}


def _model(device: str = "cuda:0", max_batch: int = 128, native: bool = True, weights=None) -> Model:
    """A model on the GPU; native=False: its pipeline enqueues with torch calls instead of the library's one call."""
    model = Model(weights or default_weights(), torch.device(device), "fused-cuda", max_batch)
    assert model.pipeline is not None and model.pipeline.native is not None  # the serving default
    if not native:
        model.pipeline = CudaPipeline(model.device, model.cout, model.compute, model.graphs)
    return model


PATHS = [pytest.param(True, id="native"), pytest.param(False, id="torch")]


def _wire(x: np.ndarray, datatype: str) -> np.ndarray:
    if datatype == "BF16":
        return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return x.astype(WIRE[datatype])


def _ref(arr: np.ndarray, datatype: str, model: Model) -> torch.Tensor:
    return reference_float64(wire_to_tensor(arr, datatype), model.weights.weight, model.weights.bias)


def _run_and_check(runner: Runner, inputs: list[np.ndarray], model: Model) -> None:
    """All inputs through the runner at once; each result within the fp32 bound of float64."""
    async def main():
        try:
            return await asyncio.gather(*(runner.run(x, "FP32") for x in inputs))
        finally:
            await runner.close()

    for x, r in zip(inputs, asyncio.run(main()), strict=True):
        assert relative_error(torch.from_numpy(np.ascontiguousarray(r.output)), _ref(x, "FP32", model)) <= FP32_TOL


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_staged_execution_matches_float64_with_one_host_copy(datatype, native):
    model = _model(native=native)
    rng = np.random.default_rng()
    # Twice the same shapes: the second run of a padded bucket replays a graph (native: the library's own).
    for _ in range(3):
        arrays = [_wire(rng.standard_normal((n, 3, 9, 12, 10), dtype=np.float32), datatype) for n in (1, 3, 2)]
        before = model.pipeline.staged_bytes
        y, times = model.run_arrays(arrays, datatype)
        assert model.pipeline.staged_bytes - before == sum(a.nbytes for a in arrays)  # copy 1, and only that
        ref = _ref(np.concatenate(arrays), datatype, model)
        assert relative_error(torch.from_numpy(y), ref) <= FP32_TOL
        assert times.infer_ns > 0 and times.input_ns > 0 and times.output_ns >= 0
    if native:
        assert model.pipeline.native_executions == 3


def test_native_path_serves_other_model_shapes_and_large_batches():
    """The general kernel (another Cin, Cout, k) and batches beyond the graph sizes, through the library's one
    call: direct launches, graphs, and sources large enough for torch's multi-threaded staging copy."""
    from voxserve.server.core.weights import Weights

    g = torch.Generator().manual_seed(torch.seed())
    weights = Weights(torch.randn((8, 2, 2, 2, 2), generator=g) * 0.3, torch.randn(8, generator=g) * 0.1, "random")
    model = _model(weights=weights)
    rng = np.random.default_rng()
    for n in (1, 1, 1, 5, 5):
        x = rng.standard_normal((n, 2, 6, 7, 9), dtype=np.float32)
        y, _ = model.run_arrays([x], "FP32")
        assert relative_error(torch.from_numpy(y), _ref(x, "FP32", model)) <= FP32_TOL
    big = _model()
    x = rng.standard_normal((96, 3, 16, 32, 32), dtype=np.float32)  # 18.9 MB: past the graph and the memcpy sizes
    for _ in range(2):
        y, times = big.run_arrays([x[:40], x[40:]], "FP32")
        assert relative_error(torch.from_numpy(y), _ref(x, "FP32", big)) <= FP32_TOL
        assert times.input_ns > 0 and times.infer_ns > 0
    assert model.pipeline.native_executions == 5 and big.pipeline.native_executions == 2


def test_native_graphs_stay_bounded_whatever_shapes_recur():
    model = _model()
    pipeline = model.pipeline
    pipeline._max_graphs = 2
    rng = np.random.default_rng()
    for d in (5, 6, 7, 8) * 3:  # four shapes, each recurring: more than a slot keeps
        x = rng.standard_normal((1, 3, d, 9, 12), dtype=np.float32)
        y, _ = model.run_arrays([x], "FP32")
        assert relative_error(torch.from_numpy(y), _ref(x, "FP32", model)) <= FP32_TOL
    counts = [len(slot.graphs) for slot in pipeline._free.queue]
    assert max(counts) <= 2 and sum(counts) >= 1, counts


def test_a_model_the_fused_kernel_cannot_run_keeps_the_torch_path():
    from voxserve.server.core.weights import Weights

    weights = Weights(torch.randn((72, 3, 3, 3, 3)) * 0.1, torch.zeros(72), "random")  # Cout 72: not fused
    model = Model(weights, torch.device("cuda:0"), "fused-cuda", 8)
    assert model.pipeline is not None and model.pipeline.native is None
    x = np.random.default_rng().standard_normal((2, 3, 5, 6, 7), dtype=np.float32)
    y, _ = model.run_arrays([x], "FP32")
    assert relative_error(torch.from_numpy(y), _ref(x, "FP32", model)) <= FP32_TOL


@pytest.mark.parametrize("native", PATHS)
def test_pinned_request_buffer_goes_to_the_gpu_without_a_host_copy(native):
    from voxserve.server.core.pipeline import pinned_buffer

    model = _model(native=native)
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 3, 16, 32, 32), dtype=np.float32)
    pinned = np.frombuffer(pinned_buffer(x.nbytes), dtype=np.float32).reshape(x.shape)  # as a shm read lands
    pinned[...] = x
    staged, direct = model.pipeline.staged_bytes, model.pipeline.direct_bytes
    y, _ = model.run_arrays([pinned], "FP32")
    assert model.pipeline.staged_bytes == staged and model.pipeline.direct_bytes - direct == x.nbytes
    assert relative_error(torch.from_numpy(y), _ref(x, "FP32", model)) <= FP32_TOL
    # Merged with another request it is staged like any other (one copy into the batch).
    y2, _ = model.run_arrays([pinned, x[:1]], "FP32")
    assert model.pipeline.staged_bytes - staged == x.nbytes + x[:1].nbytes
    assert relative_error(torch.from_numpy(y2), _ref(np.concatenate([x, x[:1]]), "FP32", model)) <= FP32_TOL
    # A batch of pinned requests (a front end's page-locked arena) goes over as one DMA each, no host copy.
    other = np.frombuffer(pinned_buffer(x[:3].nbytes), dtype=np.float32).reshape(x[:3].shape)
    other[...] = x[1:] * 2
    staged, direct = model.pipeline.staged_bytes, model.pipeline.direct_bytes
    y3, _ = model.run_arrays([pinned, other], "FP32")
    assert model.pipeline.staged_bytes == staged and model.pipeline.direct_bytes - direct == x.nbytes + other.nbytes
    assert relative_error(torch.from_numpy(y3), _ref(np.concatenate([x, other]), "FP32", model)) <= FP32_TOL


def test_page_locked_spans_are_gathered_onto_the_device_in_order():
    from voxserve.kernels import cuda as fused_cuda

    host = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).pin_memory()
    base = host.data_ptr()
    # Out of order, back to back (coalesced into one copy) and apart, of odd sizes.
    pieces = [(4096, 1000), (5096, 24), (0, 333), (40000, 7), (40007, 20000)]
    spans = np.array([(base + start, n) for start, n in pieces], dtype=np.int64)
    dst = torch.zeros(30000, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    fused_cuda.copy_spans(dst, spans, stream)
    stream.synchronize()
    expected = torch.cat([host[start : start + n] for start, n in pieces])
    assert torch.equal(dst[: expected.numel()].cpu(), expected)
    assert int(dst[expected.numel() :].count_nonzero()) == 0
    with pytest.raises(ValueError, match="more than"):
        fused_cuda.copy_spans(dst[:100], spans, stream)


def test_shared_memory_inputs_are_read_into_pinned_memory():
    import os

    from voxserve.client.shm import SharedMemoryBuffer

    with running_server(device="cuda") as srv:
        assert srv.wait_ready(), srv.server.load_error
        model = srv.server.state.runner.model
        rng = np.random.default_rng()
        x = rng.standard_normal((8, 3, 16, 32, 32), dtype=np.float32)
        with Client(srv.url) as c, SharedMemoryBuffer(f"vox_pin_{os.getpid()}", x.nbytes) as buf:
            buf.write(x)
            c.register_system_shared_memory("in", buf.key, x.nbytes)
            direct = model.pipeline.direct_bytes
            y = c.infer_shared_memory(x.shape, "in")
            assert model.pipeline.direct_bytes - direct == x.nbytes
            c.unregister_system_shared_memory()
        assert relative_error(torch.from_numpy(y), _ref(x, "FP32", model)) <= FP32_TOL


@pytest.mark.parametrize(("enqueue_on_loop", "native"), [(False, True), (True, True), (True, False)])
def test_concurrent_batches_overlap_and_stay_correct(enqueue_on_loop, native):
    model = _model(max_batch=16, native=native)
    metrics = Metrics("voxnet", gpu_metrics=False)
    runner = Runner(model, ModelStats(), metrics, BatchingConfig(True, 0.0, 4096), enqueue_on_loop=enqueue_on_loop)
    inflight_seen = []
    real_submit = model.pipeline.submit
    lock = threading.Lock()

    def submit(arrays, datatype, *args, **kwargs):
        with lock:
            inflight_seen.append(runner.workers[0].inflight)
            if len(inflight_seen) == 1:
                # The first execution waits on the device (~20 ms of spinning ahead of it on the compute stream): an
                # H200 finishes a small batch before the torch path has staged the next, so without the hold
                # the executions would overlap or not by the GPU's speed, not by what the runner does.
                with torch.cuda.stream(model.pipeline.compute_stream):
                    torch.cuda._sleep(40_000_000)
        return real_submit(arrays, datatype, *args, **kwargs)

    model.pipeline.submit = submit
    rng = np.random.default_rng()
    shapes = [(n, 3, d, 32, 32) for n in (1, 5, 16, 40) for d in (3, 16)]  # large ones pipeline
    inputs = [rng.standard_normal(s, dtype=np.float32) for s in shapes for _ in range(6)]

    _run_and_check(runner, inputs, model)
    assert max(inflight_seen) >= 2, inflight_seen  # the next execution was staged while one ran
    compute = metrics.registry.get_sample_value("voxserve_compute_duration_seconds_sum", {"model": "voxnet"})
    assert compute is not None and compute > 0  # CUDA-event device time


def test_real_out_of_memory_is_refused_and_recovered():
    with running_server(device="cuda") as srv:
        assert srv.wait_ready(), srv.server.load_error
        x_big = np.random.default_rng().standard_normal((128, 3, 16, 32, 32), dtype=np.float32)  # 25 MB
        x_small = x_big[:1].copy()
        with Client(srv.url, timeout_s=60) as c:
            assert c.infer(x_small).shape == (1, 16)
            model = srv.server.state.runner.model
            model.pipeline.reset()
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (4 << 20)) / total)
            try:
                with pytest.raises(InferenceError) as err:
                    c.infer(x_big)
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0)
            assert err.value.code.name == "RESOURCE_EXHAUSTED" and "ran out of memory" in err.value.message
            y = c.infer(x_big)  # recovered: the same request now succeeds
            ref = reference_float64(torch.from_numpy(x_big), model.weights.weight, model.weights.bias)
            assert relative_error(torch.from_numpy(y), ref) <= FP32_TOL
            assert c.is_ready()
        failures = srv.server.metrics.registry.get_sample_value(
            "voxserve_execution_failures_total", {"model": "voxnet", "reason": "out_of_memory"})
        assert failures == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_share_the_work():
    models = [_model(f"cuda:{i}", max_batch=32) for i in range(2)]
    runner = Runner(models, ModelStats(), Metrics("voxnet", gpu_metrics=False), BatchingConfig(True, 0.0, 4096))
    used = []
    for m in models:
        real = m.pipeline.submit

        def submit(arrays, datatype, *args, real=real, device=m.device, **kwargs):
            used.append(str(device))
            return real(arrays, datatype, *args, **kwargs)

        m.pipeline.submit = submit
    rng = np.random.default_rng()
    inputs = [rng.standard_normal((32, 3, 16, 32, 32), dtype=np.float32) for _ in range(24)]

    _run_and_check(runner, inputs, models[0])
    assert {"cuda:0", "cuda:1"} <= set(used), used


@pytest.mark.parametrize("native", PATHS)
def test_small_batches_share_padded_graphs(native):
    from voxserve.server.core.pipeline import GRAPH_BUCKETS

    model = _model(native=native)
    rng = np.random.default_rng()
    for n in (1, 3, 5, 6, 7, 3, 5, 6, 7, 12, 13, 12, 13, 2, 2):
        x = rng.standard_normal((n, 3, 16, 32, 32), dtype=np.float32)
        y, _ = model.run_arrays([x], "FP32")
        assert y.shape == (n, 16)
        assert relative_error(torch.from_numpy(y), _ref(x, "FP32", model)) <= FP32_TOL
    if native:  # graphs per slot, keyed by (padded shape, datatype)
        keys = {key for slot in model.pipeline._free.queue for key in slot.graphs}
        shapes = {shape[0] for shape, _ in keys}
    else:
        keys = set(model.graphs._graphs)
        shapes = {key[0][0] for key in keys}
    assert shapes and shapes <= set(GRAPH_BUCKETS) and len(keys) <= 4, shapes  # buckets 2, 4, 8, 16 at most


@pytest.mark.parametrize("native", PATHS)
def test_completion_watcher_ends_executions_in_order_without_a_waiting_thread(native):
    from voxserve.server.core.pipeline import CompletionWatcher

    model = _model(native=native)
    pipeline = model.pipeline
    rng = np.random.default_rng()
    xs = [rng.standard_normal((n, 3, 16, 32, 32), dtype=np.float32) for n in (1, 7, 2)]

    async def go():
        watcher = CompletionWatcher(pipeline, asyncio.get_running_loop())
        try:
            threads = {t.ident for t in threading.enumerate()}
            pending = [pipeline.submit([x], "FP32", notify=True) for x in xs]
            await asyncio.wait_for(asyncio.gather(*(watcher.done(p) for p in pending)), 30)
            # The loop was woken; no thread was started to wait on the GPU (one left over from an earlier test
            # may have ended meanwhile).
            assert {t.ident for t in threading.enumerate()} <= threads
            outputs = [pipeline.finish(p)[0] for p in pending]
            # Finished, and its wake-up read, before it was handed to the watcher: done at once, not at the poll.
            early = pipeline.submit([xs[1]], "FP32", notify=True)
            early.events[-1].synchronize()
            await asyncio.sleep(0.01)  # the loop reads the wake-up while nothing is registered
            assert watcher.done(early).done()
            outputs.append(pipeline.finish(early)[0])
            # No host-function wake-up (notify=False): the watcher's poll still ends the execution.
            quiet = pipeline.submit([xs[0]], "FP32")
            await asyncio.wait_for(watcher.done(quiet), 30)
            outputs.append(pipeline.finish(quiet)[0])
        finally:
            watcher.close()
        return outputs

    outputs = asyncio.run(go())
    for x, y in zip([*xs, xs[1], xs[0]], outputs, strict=True):
        assert relative_error(torch.from_numpy(y), _ref(x, "FP32", model)) <= FP32_TOL
    assert pipeline._free.qsize() == pipeline.depth  # every slot came back
