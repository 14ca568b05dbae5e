"""The reference and the default weights match the model definition in shared/reference."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from voxserve.kernels import fused_forward, reference, reference_float64, reference_weights
from voxserve.server.core.model import relative_error

from ..conftest import SHARED_REFERENCE


def _shared_module():
    if not SHARED_REFERENCE.exists():
        pytest.skip(f"{SHARED_REFERENCE} is not beside this checkout")
    spec = importlib.util.spec_from_file_location("shared_reference_model", SHARED_REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args", [(), (3, 16, 3, 0), (4, 8, 5, 7), (1, 1, 1, 3), (2, 64, 7, 123)])
def test_default_weights_bit_identical_to_shared_reference(args):
    ours = reference_weights(*args)
    theirs = _shared_module().reference_weights(*args)
    assert torch.equal(ours[0], theirs[0]) and ours[0].dtype == theirs[0].dtype
    assert torch.equal(ours[1], theirs[1]) and ours[1].dtype == theirs[1].dtype


def test_reference_function_matches_shared_reference(rng):
    shared = _shared_module()
    w, b = reference_weights()
    x = torch.randn(2, 3, 6, 7, 9, generator=rng, dtype=torch.float64)
    assert torch.equal(reference(x, w.double(), b.double()), shared.reference(x, w.double(), b.double()))


@pytest.mark.parametrize(
    ("shape", "cout", "k", "dtype", "tol"),
    [
        ((2, 3, 16, 32, 32), 16, 3, torch.float32, 1e-5),
        ((1, 3, 3, 3, 3), 16, 3, torch.float32, 1e-5),
        ((3, 3, 5, 9, 17), 16, 3, torch.float32, 1e-5),
        ((2, 5, 7, 8, 9), 11, 5, torch.float32, 1e-5),
        ((4, 1, 1, 2, 3), 2, 1, torch.float32, 1e-5),
        ((2, 3, 9, 9, 9), 16, 3, torch.float16, 1e-5),
        ((2, 3, 9, 9, 9), 16, 3, torch.bfloat16, 1e-5),
    ],
)
def test_cpu_op_matches_float64(rng, shape, cout, k, dtype, tol):
    # fp16/bf16 inputs are exact in fp32, so the bound is the fp32 one against
    # a float64 reference computed on the same (rounded) input values.
    cin = shape[1]
    w = torch.randn(cout, cin, k, k, k, generator=rng) * 0.3
    b = torch.randn(cout, generator=rng) * 0.1
    x = torch.randn(shape, generator=rng).to(dtype)
    out = fused_forward(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (shape[0], cout)
    assert relative_error(out, reference_float64(x, w, b)) <= tol


def test_cpu_op_handles_non_contiguous_and_chunking(rng, monkeypatch):
    from voxserve.kernels import ops

    # Chunks of whole samples while a sample's conv output (16 x 7 x 6 x 8 floats) is a third of the cap or
    # less: here 3 and 2 samples (tests/core/test_cpu_memory.py covers the tiles of larger samples).
    monkeypatch.setattr(ops, "_CPU_CHUNK_BYTES", 3 * 16 * 7 * 6 * 8 * 4)
    w, b = reference_weights()
    x = torch.randn(5, 9, 8, 3, 10, generator=rng).permute(0, 3, 1, 2, 4)  # (5, 3, 9, 8, 10), strided
    assert not x.is_contiguous()
    assert relative_error(fused_forward(x, w, b), reference_float64(x, w, b)) <= 1e-5


def test_op_rejects_bad_arguments():
    w, b = reference_weights()
    with pytest.raises(ValueError, match="channels"):
        fused_forward(torch.zeros(1, 4, 5, 5, 5), w, b)
    with pytest.raises(ValueError, match="smaller than the kernel"):
        fused_forward(torch.zeros(1, 3, 2, 5, 5), w, b)
    with pytest.raises(ValueError, match="5-D"):
        fused_forward(torch.zeros(3, 5, 5, 5), w, b)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fused_forward(torch.zeros(1, 3, 5, 5, 5, dtype=torch.float64), w, b)
    with pytest.raises(ValueError, match="precision must be one of fp32, tf32; got 'fp16'"):
        fused_forward(torch.zeros(1, 3, 5, 5, 5), w, b, "fp16")


def test_opcheck_cpu(rng):
    w, b = reference_weights()
    x = torch.randn(2, 3, 5, 6, 7, generator=rng)
    for args in ((x, w, b), (x, w, b, "tf32")):
        torch.library.opcheck(torch.ops.voxserve.fused_forward.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
