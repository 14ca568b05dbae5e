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
