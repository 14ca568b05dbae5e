"""CUDA shared memory on a GPU: a client process exports its device memory (CUDA IPC), the server reads the input
where it lies and writes the output into the client's memory; float64's answers, for one request and for
requests batched together. Skipped without a CUDA device."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from voxserve.client import Client
from voxserve.datatypes import from_wire, to_wire
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.model import relative_error

from ..cuda_exporter import Exporter, NoExporter

pytestmark = pytest.mark.gpu


@pytest.fixture
def exporter():
    """The client's process (tests/cuda_exporter.py): its device memory, exported by CUDA IPC."""
    try:
        process = Exporter()
    except NoExporter as exc:
        pytest.skip(f"no exporter process: {exc}")
    with process:
        yield process


@contextlib.contextmanager
def _unregistering(client: Client):
    """Every CUDA region unregistered at the end, whatever happened (the next test registers the same names)."""
    try:
        yield
    finally:
        client.unregister_cuda_shared_memory()


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_a_request_reads_and_writes_the_clients_device_memory(gpu_server, exporter, datatype):
    w, b = reference_weights()
    x = np.random.default_rng().standard_normal((3, 3, 16, 32, 32), dtype=np.float32)
    wire = to_wire(x, datatype)
    exact = torch.from_numpy(from_wire(wire, datatype, x.shape).copy())
    out_bytes = 3 * 16 * 4
    memory = exporter.alloc(len(wire) + out_bytes, wire)
    with Client(gpu_server.url) as client, _unregistering(client):
        client.register_cuda_shared_memory("io", memory.handle, 0, len(wire) + out_bytes)
        assert client.cuda_shared_memory_status() == {"io": (0, len(wire) + out_bytes)}
        assert client.infer_shared_memory(x.shape, "io", datatype=datatype, output_region="io",
                                          output_offset=len(wire)) is None
        y = np.frombuffer(exporter.read(memory, len(wire), out_bytes), "<f4").reshape(3, 16).copy()
        assert relative_error(torch.from_numpy(y), reference_float64(exact, w, b)) <= 1e-5
        np.testing.assert_allclose(y, client.infer(exact.numpy(), datatype=datatype), rtol=1e-6, atol=1e-7)
        client.unregister_cuda_shared_memory("io")
        assert client.cuda_shared_memory_status() == {}


def test_requests_on_one_region_batch_together(gpu_server, exporter):
    """Sixteen batch-1 requests at once, each at its own offset of one client allocation: gathered on the device
    into executions of several, each row float64's."""
    w, b = reference_weights()
    x = np.random.default_rng().standard_normal((16, 3, 16, 32, 32), dtype=np.float32)
    row = x[0].nbytes
    memory = exporter.alloc(x.nbytes, x.tobytes())
    with Client(gpu_server.url) as client, _unregistering(client):
        client.register_cuda_shared_memory("many", memory.handle, 0, x.nbytes)
        with ThreadPoolExecutor(16) as pool:
            ys = list(pool.map(lambda i: client.infer_shared_memory((1, 3, 16, 32, 32), "many",
                                                                    input_offset=i * row), range(16)))
        client.unregister_cuda_shared_memory()
    y = np.concatenate(ys)
    assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5


def _pipeline(server):
    return server.server.state.runner.model.gpu_pipeline


@contextlib.contextmanager
def _no_host_writes(server):
    """Fails if any output reaches a CUDA region from the host (the registry's write, a copy from the host)."""
    registry = server.server.cuda_shm
    writes = []
    write = registry.write
    registry.write = lambda *args, **kwargs: (writes.append(args[0]), write(*args, **kwargs))[1]
    try:
        yield
    finally:
        registry.write = write
    assert writes == [], f"outputs written from the host into {writes}"


@pytest.mark.parametrize("samples, output_at", [(100, "after"), (100, "over the input"), (160, "after")])
def test_the_execution_writes_the_output_into_the_clients_memory_on_the_device(gpu_server, exporter, samples,
                                                                              output_at):
    """No host copy either way: the input read where it lies (100 samples: in place by the kernel, which writes the
    output straight into the region; 160, more than a batch: in two executions, each writing its own rows), the
    output never written from the host, not even where it overlaps the input it is computed from."""
    w, b = reference_weights()
    x = np.random.default_rng().standard_normal((samples, 3, 16, 32, 32), dtype=np.float32)
    out_bytes = samples * 16 * 4
    out_offset = x.nbytes if output_at == "after" else 0
    memory = exporter.alloc(x.nbytes + out_bytes, x.tobytes())
    pipeline = _pipeline(gpu_server)
    staged, device_in, device_out = pipeline.staged_bytes, pipeline.device_bytes, pipeline.device_output_bytes
    with Client(gpu_server.url) as client, _unregistering(client), _no_host_writes(gpu_server):
        client.register_cuda_shared_memory("io", memory.handle, 0, x.nbytes + out_bytes)
        assert client.infer_shared_memory(x.shape, "io", output_region="io", output_offset=out_offset) is None
        y = np.frombuffer(exporter.read(memory, out_offset, out_bytes), "<f4").reshape(samples, 16).copy()
    assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
    assert pipeline.staged_bytes == staged  # nothing of the input on the host
    assert pipeline.device_bytes - device_in == x.nbytes and pipeline.device_output_bytes - device_out == out_bytes


def test_batched_requests_each_get_their_rows_in_their_own_output(gpu_server, exporter):
    """Forty-eight batch-1 requests at once over one allocation, gathered on the device into executions of several
    (graphs among them): those naming an output span in the region find their row there, written on the device; the
    others (every third) get theirs in the response. Every row float64's."""
    w, b = reference_weights()
    n = 48
    x = np.random.default_rng().standard_normal((n, 3, 16, 32, 32), dtype=np.float32)
    row, out_row = x[0].nbytes, 16 * 4
    memory = exporter.alloc(x.nbytes + n * out_row, x.tobytes())
    exact = reference_float64(torch.from_numpy(x), w, b)

    def one(i: int):
        if i % 3 == 2:
            return client.infer_shared_memory((1, 3, 16, 32, 32), "many", input_offset=i * row)
        return client.infer_shared_memory((1, 3, 16, 32, 32), "many", input_offset=i * row, output_region="many",
                                          output_offset=x.nbytes + i * out_row)

    with Client(gpu_server.url) as client, _unregistering(client), _no_host_writes(gpu_server):
        client.register_cuda_shared_memory("many", memory.handle, 0, x.nbytes + n * out_row)
        for _ in range(2):  # the second round replays the graphs the first one captured
            with ThreadPoolExecutor(n) as pool:
                answers = list(pool.map(one, range(n)))
            written = np.frombuffer(exporter.read(memory, x.nbytes, n * out_row), "<f4").reshape(n, 16)
            y = np.concatenate([a if a is not None else written[i : i + 1] for i, a in enumerate(answers)])
            assert [a is None for a in answers] == [i % 3 != 2 for i in range(n)]
            assert relative_error(torch.from_numpy(y.copy()), exact) <= 1e-5
            exporter.write(memory, x.nbytes, bytes(n * out_row))  # (so that the next round's rows are its own)
