"""The client's CUDA shared memory on a GPU, against a server in another process (CUDA IPC refuses a handle exported
by the process that opens it): this test process is the client. A buffer of voxserve.client's own (cudaMalloc), a
torch tensor inside a larger caching-allocator block (registered by its allocation, referenced at its offset), and
tritonclient's cuda_shared_memory utilities unchanged (in a process of their own); float64's answers each time.
Skipped without a CUDA device or without cuda-bindings (voxserve[cuda])."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from voxserve.cli import main
from voxserve.client import Client, CudaBuffer, CudaUnavailable, cuda
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.model import relative_error
from voxserve.testing.load import ServerProcess

pytestmark = pytest.mark.gpu
SHAPE = (3, 16, 32, 32)
COUT = 16


@pytest.fixture(scope="module")
def gpu_server():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        cuda.require_device(0)
    except CudaUnavailable as exc:  # cuda-bindings not installed (voxserve[cuda])
        pytest.skip(str(exc))
    with ServerProcess(["--device", "cuda"], ready_timeout_s=600) as srv:
        with Client(srv.url) as c:
            if "cuda_shared_memory" not in c.server_metadata().extensions:
                pytest.fail("a server on CUDA offers the cuda_shared_memory extension")
        yield srv


@pytest.fixture
def client(gpu_server):
    with Client(gpu_server.url) as c:
        yield c
        c.unregister_cuda_shared_memory()


def _float64(x: torch.Tensor) -> torch.Tensor:
    w, b = reference_weights()
    return reference_float64(x.detach().to("cpu", torch.float32), w, b)


def test_a_buffer_of_our_own(client):
    x = np.random.default_rng().standard_normal((5, *SHAPE), dtype=np.float32)
    out_at = x.nbytes + 256
    with CudaBuffer(out_at + 5 * COUT * 4) as buf:
        buf.write(x)
        np.testing.assert_array_equal(buf.read(np.float32, x.shape), x)
        client.register_cuda_region("own", buf.region)
        assert client.cuda_shared_memory_status() == {"own": (0, buf.byte_size)}
        assert client.infer_shared_memory(x.shape, "own", output_region="own", output_offset=out_at) is None
        y = buf.read(np.float32, (5, COUT), offset=out_at)
        client.unregister_cuda_shared_memory("own")
    assert relative_error(torch.from_numpy(y), _float64(torch.from_numpy(x))) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_torch_tensor_inside_a_caching_allocator_block(client, dtype):
    """The input a view at a non-zero offset of a larger torch allocation: the whole allocation is registered
    (cuMemGetAddressRange's base and size), the input referenced at its offset; the output a tensor of its own,
    written in place by the server."""
    if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
        pytest.skip("torch's expandable segments (cuMemCreate) cannot be exported by CUDA IPC")
    n = 4
    count = n * int(np.prod(SHAPE))
    block = torch.zeros(count + 4096, dtype=dtype, device="cuda")
    x = block[1000:1000 + count].view(n, *SHAPE)
    x.copy_(torch.randn((n, *SHAPE), device="cuda"))
    y = torch.full((n, COUT), float("nan"), device="cuda")
    ref_x = client.register_cuda_array("x", x)
    region, _ = cuda.locate(x, "x")
    assert ref_x.offset == x.data_ptr() - region.base > 0 and region.byte_size >= block.numel() * block.element_size()
    assert ref_x.datatype == {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16"}[dtype]
    y_region, ref_y = cuda.locate(y, "x")
    if y_region.base != region.base:  # another allocation: a region of its own
        ref_y = client.register_cuda_array("y", y)
    assert client.infer_cuda(ref_x, ref_y) is None  # (it synchronizes the device first: x's copy is done)
    assert relative_error(y.cpu(), _float64(x)) <= 1e-5
    np.testing.assert_allclose(client.infer_cuda(ref_x), y.cpu().numpy(), rtol=1e-6, atol=1e-7)


_TRITONCLIENT = r"""
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.cuda_shared_memory as cudashm

url, workdir = sys.argv[1], Path(sys.argv[2])
x = np.load(workdir / "x.npy")
out_bytes = x.shape[0] * 16 * 4
client = grpcclient.InferenceServerClient(url)
inp_handle = cudashm.create_shared_memory_region("tc_in", x.nbytes, 0)
out_handle = cudashm.create_shared_memory_region("tc_out", out_bytes, 0)
cudashm.set_shared_memory_region(inp_handle, [x])
client.register_cuda_shared_memory("tc_in", cudashm.get_raw_handle(inp_handle), 0, x.nbytes)
client.register_cuda_shared_memory("tc_out", cudashm.get_raw_handle(out_handle), 0, out_bytes)
status = client.get_cuda_shared_memory_status(as_json=True)
inp = grpcclient.InferInput("input", list(x.shape), "FP32")
inp.set_shared_memory("tc_in", x.nbytes)
out = grpcclient.InferRequestedOutput("output")
out.set_shared_memory("tc_out", out_bytes)
client.infer("voxnet", [inp], outputs=[out])
np.save(workdir / "y.npy", cudashm.get_contents_as_numpy(out_handle, np.float32, [x.shape[0], 16]))
client.unregister_cuda_shared_memory()
cudashm.destroy_shared_memory_region(inp_handle)
cudashm.destroy_shared_memory_region(out_handle)
import json
print(json.dumps(status))
"""


def test_tritonclients_cuda_shared_memory_utilities_unchanged(gpu_server, tmp_path):
    """tritonclient's create / set / get_raw_handle / register path, in a process of its own (tritonclient's
    protobuf files stay out of this one's), against our server."""
    if importlib.util.find_spec("tritonclient") is None:
        pytest.skip("tritonclient is not installed")
    x = np.random.default_rng().standard_normal((3, *SHAPE), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run([sys.executable, "-c", _TRITONCLIENT, gpu_server.url, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["name"]: int(r["byte_size"]) for r in status["regions"].values()} == {
        "tc_in": x.nbytes, "tc_out": 3 * COUT * 4}
    y = np.load(tmp_path / "y.npy")
    assert relative_error(torch.from_numpy(y), _float64(torch.from_numpy(x))) <= 1e-5
    with Client(gpu_server.url) as c:
        assert c.cuda_shared_memory_status() == {}


def test_bench_over_cuda_shared_memory(gpu_server, capsys):
    rc = main(["bench", "--url", gpu_server.url, "--batch", "8", "--concurrency", "1,4", "--requests", "16",
               "--cuda-shared-memory", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["cuda_shared_memory"] is True
    for level in report["levels"]:
        assert level["requests"] == 16 and level["errors"] == 0, level["first_error"]
    with Client(gpu_server.url) as c:
        assert c.cuda_shared_memory_status() == {}

