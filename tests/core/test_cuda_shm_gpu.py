"""CUDA shared memory on a GPU: a client process exports its device memory (CUDA IPC), the server reads the input
where it lies and writes the output into the client's memory; float64's answers, for one request and for
requests batched together. Skipped without a CUDA device."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from voxserve.client import Client
from voxserve.datatypes import from_wire, to_wire
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.model import relative_error

from ..conftest import running_server

pytestmark = pytest.mark.gpu

# The client: device memory of the size it reads (hex of its input on its first line), filled with the input;
# prints the raw CUDA IPC handle (torch's sharing: a version byte, 'c', then the 64-byte handle) and the offset
# of the data in the allocation; then, for each 'read OFFSET COUNT' line, prints those bytes of its memory.
_CLIENT = """
import sys, torch
size, data = sys.stdin.readline().split()
memory = torch.zeros(int(size), dtype=torch.uint8, device="cuda")
memory[:len(data) // 2] = torch.frombuffer(bytearray(bytes.fromhex(data)), dtype=torch.uint8).cuda()
torch.cuda.synchronize()
shared = memory.untyped_storage()._share_cuda_()
blob = shared[1]
if len(blob) > 64 and blob[1:2] != b"c":
    print("skip: torch shares this allocation in its own format", flush=True)
    sys.exit(0)
print((blob[2:66] if len(blob) > 64 else blob).hex(), shared[3], flush=True)
for line in sys.stdin:
    _, offset, count = line.split()
    torch.cuda.synchronize()
    print(bytes(memory[int(offset):int(offset) + int(count)].cpu().numpy()).hex(), flush=True)
"""


class ClientMemory:
    def __init__(self, size: int, data: bytes) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={"PYTORCH_CUDA_ALLOC_CONF": "", **_env()})
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{size} {data.hex()}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        if not line or line[0] == "skip:":
            self.close()
            pytest.skip(" ".join(line) or "the client process failed")
        self.handle, self.offset = bytes.fromhex(line[0]), int(line[1])

    def read(self, offset: int, count: int) -> bytes:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"read {self.offset + offset} {count}\n")
        self.proc.stdin.flush()
        return bytes.fromhex(self.proc.stdout.readline().strip())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}


@contextlib.contextmanager
def _unregistering(client: Client):
    """Every CUDA region unregistered at the end, whatever happened (the next test registers the same names)."""
    try:
        yield
    finally:
        client.unregister_cuda_shared_memory()


@pytest.fixture(scope="module")
def gpu_server():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with running_server(device="cuda") as srv:
        assert srv.wait_ready(), srv.server.load_error
        if srv.server.cuda_shm is None:
            pytest.fail("a server on CUDA with the kernel library offers CUDA shared memory")
        yield srv


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_a_request_reads_and_writes_the_clients_device_memory(gpu_server, datatype):
    w, b = reference_weights()
    x = np.random.default_rng().standard_normal((3, 3, 16, 32, 32), dtype=np.float32)
    wire = to_wire(x, datatype)
    exact = torch.from_numpy(from_wire(wire, datatype, x.shape).copy())
    out_bytes = 3 * 16 * 4
    memory = ClientMemory(len(wire) + out_bytes, wire)
    try:
        with Client(gpu_server.url) as client, _unregistering(client):
            client.register_cuda_shared_memory("io", memory.handle, 0, len(wire) + out_bytes)
            assert client.cuda_shared_memory_status() == {"io": (0, len(wire) + out_bytes)}
            assert client.infer_shared_memory(x.shape, "io", datatype=datatype, output_region="io",
                                              output_offset=len(wire)) is None
            y = np.frombuffer(memory.read(len(wire), out_bytes), "<f4").reshape(3, 16).copy()
            assert relative_error(torch.from_numpy(y), reference_float64(exact, w, b)) <= 1e-5
            np.testing.assert_allclose(y, client.infer(exact.numpy(), datatype=datatype), rtol=1e-6, atol=1e-7)
            client.unregister_cuda_shared_memory("io")
            assert client.cuda_shared_memory_status() == {}
    finally:
        memory.close()


def test_requests_on_one_region_batch_together(gpu_server):
    """Sixteen batch-1 requests at once, each at its own offset of one client allocation: gathered on the device
    into executions of several, each row float64's."""
    w, b = reference_weights()
    x = np.random.default_rng().standard_normal((16, 3, 16, 32, 32), dtype=np.float32)
    row = x[0].nbytes
    memory = ClientMemory(x.nbytes, x.tobytes())
    try:
        with Client(gpu_server.url) as client, _unregistering(client):
            client.register_cuda_shared_memory("many", memory.handle, 0, x.nbytes)
            with ThreadPoolExecutor(16) as pool:
                ys = list(pool.map(lambda i: client.infer_shared_memory((1, 3, 16, 32, 32), "many",
                                                                        input_offset=i * row), range(16)))
            client.unregister_cuda_shared_memory()
        y = np.concatenate(ys)
        assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= 1e-5
    finally:
        memory.close()
