"""The fused CUDA kernel against a float64 reference: many random shapes, dtypes, layouts, graphs.

Runs on a machine with a CUDA GPU and nvcc; skipped (with the reason) elsewhere.
"""

from __future__ import annotations

import random

import pytest
import torch

from voxserve.kernels import ERROR_BOUNDS, fused_forward, reference_float64
from voxserve.kernels import build as kernel_build
from voxserve.kernels import cuda as cuda_kernels
from voxserve.kernels.graphs import GraphCache
from voxserve.server.core.model import relative_error

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible", allow_module_level=True)
_problem = cuda_kernels.load_problem()
if _problem is not None:
    pytest.skip(f"fused kernel unavailable: {_problem}", allow_module_level=True)

DEV = torch.device("cuda")
FP32_TOL = 1e-5


def _weights(gen, cout, cin, k, scale=0.3):
    w = (torch.randn(cout, cin, k, k, k, generator=gen) * scale).to(DEV)
    b = (torch.randn(cout, generator=gen) * 0.1).to(DEV)
    return w, b


def _poison_allocator(nbytes: int = 64 * 1024 * 1024) -> None:
    """Leave NaNs in the caching allocator's free blocks, so unwritten outputs show up as NaN."""
    junk = torch.full((nbytes // 4,), float("nan"), device=DEV)
    del junk


def _random_case(rng: random.Random, gen: torch.Generator):
    cin = rng.choice([1, 2, 3, 3, 3, 4, 7])
    cout = rng.choice([1, 2, 5, 16, 16, 16, 17, 32, 64])
    k = rng.choice([1, 2, 3, 3, 3, 5, 7])
    if rng.random() < 0.4:
        cin, cout, k = 3, 16, 3  # the specialised path gets its share
    n = rng.choice([1, 1, 2, 3, 5, 8, 33])
    d, h, w = (rng.randint(k, k + rng.choice([0, 1, 4, 13, 30])) for _ in range(3))
    dtype = rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    layout = rng.choice(["contiguous", "contiguous", "permuted", "sliced", "offset"])
    return (n, cin, d, h, w), cout, k, dtype, layout


def _make_input(shape, dtype, layout, gen):
    n, cin, d, h, w = shape
    if layout == "permuted":  # channels-last-like strides
        return torch.randn(n, d, h, w, cin, generator=gen).to(DEV, dtype).permute(0, 4, 1, 2, 3)
    if layout == "sliced":  # every other W element of a wider tensor
        return torch.randn(n, cin, d, h, 2 * w, generator=gen).to(DEV, dtype)[..., ::2]
    if layout == "offset":  # storage offset breaks 16-byte alignment
        flat = torch.randn(n * cin * d * h * w + 1, generator=gen).to(DEV, dtype)
        return flat[1:].view(n, cin, d, h, w)
    return torch.randn(shape, generator=gen).to(DEV, dtype)


def test_sixty_random_shapes_match_float64(rng):
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    pyrng = random.Random(seed)
    print(f"case seed {seed}")
    for i in range(60):
        shape, cout, k, dtype, layout = _random_case(pyrng, rng)
        w, b = _weights(rng, cout, shape[1], k)
        x = _make_input(shape, dtype, layout, rng)
        _poison_allocator()
        out = fused_forward(x, w, b)
        torch.cuda.synchronize()
        err = relative_error(out, reference_float64(x, w, b))
        assert out.shape == (shape[0], cout) and out.dtype == torch.float32
        assert err <= FP32_TOL, f"case {i}: {shape} cout={cout} k={k} {dtype} {layout}: error {err:.3e}"


@pytest.mark.parametrize("variant", [0, *cuda_kernels.VARIANTS])
@pytest.mark.parametrize("shape", [(128, 3, 16, 32, 32), (1, 3, 16, 32, 32), (8, 3, 16, 32, 32), (2, 3, 32, 64, 64),
                                   (3, 3, 3, 3, 3), (2, 3, 5, 40, 72), (1, 3, 9, 67, 5), (1, 3, 60, 12, 8),
                                   (5, 3, 4, 4, 4)])
def test_reference_configuration_all_variants(rng, shape, variant):
    w, b = _weights(rng, 16, 3, 3, scale=1.0 / 27**0.5)
    x = torch.randn(shape, generator=rng).to(DEV)
    _poison_allocator()
    out = cuda_kernels.forward(x, w, b, variant=variant)
    assert relative_error(out, reference_float64(x, w, b)) <= FP32_TOL


@pytest.mark.parametrize("shape", [(128, 3, 16, 32, 32), (1, 3, 16, 32, 32), (2, 3, 32, 64, 64), (2, 3, 5, 40, 72),
                                   (3, 3, 3, 3, 3)])
def test_tf32_mode_within_its_stated_bound(rng, shape):
    bound = ERROR_BOUNDS["tf32"]
    for scale in (1.0 / 27**0.5, 1.0):  # unit-variance logits, and logits ~5x larger
        w, b = _weights(rng, 16, 3, 3, scale=scale)
        x = torch.randn(shape, generator=rng).to(DEV)
        ref = reference_float64(x, w, b)
        tf32 = fused_forward(x, w, b, "tf32")
        err = relative_error(tf32, ref)
        print(f"{shape} scale {scale:.2f}: tf32 relative error {err:.2e}")
        assert err <= bound
        if shape[4] % 4 == 0:  # contiguous float32 rows of whole 16-byte pieces: the tensor-core kernel's input
            # The mode really multiplies in TF32 there (results differ from the float32 path).
            assert not torch.equal(tf32, fused_forward(x, w, b))
    # Inputs the tensor-core kernel does not take (here: not W-contiguous) stay float32 in tf32 mode.
    xs = torch.randn(shape, generator=rng).to(DEV).transpose(3, 4)
    assert relative_error(fused_forward(xs, w, b, "tf32"), reference_float64(xs, w, b)) <= FP32_TOL


@pytest.mark.parametrize("shape", [(128, 3, 16, 32, 32), (1, 3, 16, 32, 32), (32, 3, 32, 64, 64), (2, 3, 5, 203, 72)])
def test_tensor_core_plans_cover_the_output(shape):
    x = torch.empty(shape, device=DEV)
    # The warpgroup kernel is the default where the library has sm_90a code for a compute-capability-9.0 GPU,
    # except for calls of at most 16 K output voxels (the mma.sync kernel starts faster).
    hopper = torch.cuda.get_device_capability() == (9, 0) and "9.0a" in kernel_build.default_archs()
    small = shape[0] * (shape[2] - 2) * (shape[3] - 2) * (shape[4] - 2) <= 16384
    default = "warpgroup" if hopper and not small else "tensor-core"
    for variant, kernel in ((0, default), (3, "tensor-core"), (5, "warpgroup" if hopper else "tensor-core")):
        for precision, terms in (("fp32", 3), ("tf32", 1)):
            p = cuda_kernels.plan(x, variant=variant, precision=precision)
            _, _, d, h, w = shape
            assert p["kernel"] == kernel and p["terms"] == terms
            if kernel == "tensor-core":
                assert p["rows"] <= 18 and p["rows"] % (p["threads"] // 32) == 0
            else:  # warpgroups of 128 threads, a pair of rows at a time, the same count for each
                groups = p["threads"] // 128
                assert groups in (1, 2) and p["rows"] <= 30 and p["rows"] % (2 * groups) == 0
            assert p["tiles_h"] * p["rows"] >= h - 2 > (p["tiles_h"] - 1) * p["rows"]
            assert p["tiles_w"] * 32 >= w - 2 and 1 <= p["chunks"] <= d - 2
    assert cuda_kernels.plan(x.transpose(3, 4))["kernel"] == "tile"  # not W-contiguous


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 3, 16, 32, 32), (1, 3, 16, 32, 32), (3, 3, 7, 37, 40), (2, 3, 5, 64, 72),
                                   (1, 3, 3, 3, 8)])
def test_16_bit_inputs_on_the_tensor_cores(rng, shape, dtype):
    """Float16/bfloat16 rows of whole 16-byte pieces go to the warpgroup kernel (on Hopper; their values are
    exact in TF32, so x times the split weights keeps float32 accuracy); other 16-bit inputs to the tile kernel."""
    hopper = torch.cuda.get_device_capability() == (9, 0) and "9.0a" in kernel_build.default_archs()
    w, b = _weights(rng, 16, 3, 3, scale=1.0 / 27**0.5)
    x = torch.randn(shape, generator=rng).to(DEV, dtype)
    assert cuda_kernels.plan(x)["kernel"] == ("warpgroup" if hopper else "tile")
    ref = reference_float64(x, w, b)
    _poison_allocator()
    for precision in ("fp32", "tf32"):
        out = fused_forward(x, w, b, precision)
        assert relative_error(out, ref) <= (FP32_TOL if precision == "fp32" else ERROR_BOUNDS["tf32"])
    assert torch.equal(fused_forward(x, w, b), fused_forward(x, w, b))  # deterministic
    misaligned = torch.randn(x.numel() + 1, generator=rng).to(DEV, dtype)[1:].view(shape)
    assert cuda_kernels.plan(misaligned)["kernel"] == "tile"
    assert relative_error(fused_forward(misaligned, w, b), reference_float64(misaligned, w, b)) <= FP32_TOL


def test_large_activations_do_not_overflow(rng):
    w, b = _weights(rng, 16, 3, 3, scale=30.0)  # logits in the hundreds: softmax must subtract the max
    x = torch.randn(2, 3, 8, 9, 10, generator=rng).to(DEV)
    out = fused_forward(x, w, b)
    assert torch.isfinite(out).all()
    assert relative_error(out, reference_float64(x, w, b)) <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_converted_on_load(rng, dtype):
    w, b = _weights(rng, 16, 3, 3)
    x = torch.randn(4, 3, 16, 32, 32, generator=rng).to(DEV, dtype)
    # The inputs are exact in fp32; the kernel computes in fp32, so the fp32 bound holds.
    assert relative_error(fused_forward(x, w, b), reference_float64(x, w, b)) <= FP32_TOL


@pytest.mark.parametrize("shape,cout,k", [((128, 3, 16, 32, 32), 16, 3), ((5, 4, 9, 10, 11), 20, 3)])
def test_deterministic_bits(rng, shape, cout, k):
    w, b = _weights(rng, cout, shape[1], k)
    x = torch.randn(shape, generator=rng).to(DEV)
    first = fused_forward(x, w, b)
    for _ in range(3):
        assert torch.equal(fused_forward(x, w, b), first)


def test_weights_updated_in_place_are_seen(rng):
    w, b = _weights(rng, 16, 3, 3)
    x = torch.randn(2, 3, 6, 6, 6, generator=rng).to(DEV)
    fused_forward(x, w, b)
    with torch.no_grad():
        w.mul_(-1.5)
        b.add_(0.3)
    assert relative_error(fused_forward(x, w, b), reference_float64(x, w, b)) <= FP32_TOL


def test_wide_cout_falls_back_to_reference(rng):
    w, b = _weights(rng, 80, 2, 3)
    x = torch.randn(2, 2, 5, 5, 5, generator=rng).to(DEV)
    assert relative_error(fused_forward(x, w, b), reference_float64(x, w, b)) <= FP32_TOL


def test_eager_calls_skip_the_dispatcher_with_the_same_bits(rng, monkeypatch):
    from voxserve.kernels import ops

    calls = []
    kernel = ops._cuda_kernel
    monkeypatch.setattr(ops, "_cuda_kernel", lambda *a: calls.append(1) or kernel(*a))
    for cout, cin, k, shape in ((16, 3, 3, (3, 3, 16, 32, 32)), (5, 2, 2, (2, 2, 6, 7, 8))):
        w, b = _weights(rng, cout, cin, k)
        x = torch.randn(shape, generator=rng).to(DEV)
        direct = fused_forward(x, w, b)
        assert torch.equal(direct, torch.ops.voxserve.fused_forward(x, w, b, "fp32"))
        assert relative_error(direct, reference_float64(x, w, b)) <= FP32_TOL
        # A layout seen before takes the remembered launch arguments: the same bits again.
        assert torch.equal(fused_forward(x, w, b), direct)
    assert len(calls) == 4
    w.requires_grad_(True)  # autograd: through the dispatcher, as before
    fused_forward(x, w, b)
    assert len(calls) == 4


def test_eager_path_refuses_what_the_op_refuses_after_a_good_call(rng):
    # The eager launch checks a layout's arguments once: a call that differs from a good one in any checked
    # property (shape, dtype, device, precision) is a new layout, checked again, and refused as the op refuses it.
    w, b = _weights(rng, 16, 3, 3)
    x = torch.randn(2, 3, 6, 7, 8, generator=rng).to(DEV)
    good = fused_forward(x, w, b)
    bad_calls = [
        ((x, w, b[:8]), "bias must be"),
        ((x, w, b.to(torch.float64)), "must be float32"),
        ((x, w.to(torch.float16), b), "must be float32"),
        ((x[:, :2], w, b), "channels"),
        ((x.to(torch.int32), w, b), "float32, float16 or bfloat16"),
        ((x[:, :, :2], w, b), "smaller than the kernel size"),
        ((x, w.cpu(), b), "x's device"),
        ((x, w, b.cpu()), "x's device"),
    ]
    for args, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            fused_forward(*args)
        with pytest.raises(ValueError, match=message):
            cuda_kernels.forward(*args)
    with pytest.raises(ValueError, match="precision"):
        fused_forward(x, w, b, "fp16")
    with pytest.raises(ValueError, match="precision"):
        torch.ops.voxserve.fused_forward(x, w, b, "fp16")
    torch.cuda.synchronize()  # nothing refused was launched: no error is pending on the context
    assert torch.equal(fused_forward(x, w, b), good)


def _two_launch(x, w, b, **kw):
    return cuda_kernels.forward(x, w, b, one_launch=False, **kw)


@pytest.mark.parametrize("variant", [0, *cuda_kernels.VARIANTS])
def test_one_launch_gives_the_two_launch_bits(rng, variant):
    # Eager calls run one kernel whose last block of each sample writes the means; with a workspace a second
    # kernel does. The same partials added in the same order: the same bits, for every kernel and layout.
    cases = [((128, 3, 16, 32, 32), 16, 3, torch.float32, "contiguous"), ((1, 3, 16, 32, 32), 16, 3, torch.float32,
             "contiguous"), ((3, 3, 7, 37, 40), 16, 3, torch.float16, "contiguous"),
             ((2, 3, 5, 64, 72), 16, 3, torch.bfloat16, "contiguous"), ((2, 3, 9, 10, 11), 16, 3, torch.float32,
             "permuted"), ((5, 2, 6, 7, 8), 5, 2, torch.float32, "sliced"), ((33, 4, 5, 6, 9), 40, 3, torch.float16,
             "offset"), ((1, 1, 1, 1, 1), 1, 1, torch.float32, "contiguous")]
    for shape, cout, k, dtype, layout in cases:
        w, b = _weights(rng, cout, shape[1], k)
        x = _make_input(shape, dtype, layout, rng)
        for precision in ("fp32", "tf32"):
            _poison_allocator()
            one = cuda_kernels.forward(x, w, b, variant=variant, precision=precision)
            two = _two_launch(x, w, b, variant=variant, precision=precision)
            assert torch.equal(one, two), (shape, cout, k, dtype, layout, precision)
        assert relative_error(one, reference_float64(x, w, b)) <= ERROR_BOUNDS["tf32"]


def test_one_launch_scratch_grows_and_shrinks_on_one_stream(rng):
    # One stream's scratch serves every call on it in turn: growing (more samples, more blocks) and back, each
    # call's counters left at zero for the next. A counter left behind would skip or repeat a sample's means.
    w, b = _weights(rng, 16, 3, 3)
    shapes = [(1, 3, 16, 32, 32), (128, 3, 16, 32, 32), (2, 3, 5, 6, 7), (300, 3, 6, 6, 6), (1, 3, 16, 32, 32),
              (7, 3, 40, 41, 42), (1, 3, 3, 3, 3), (128, 3, 16, 32, 32)]
    inputs = [torch.randn(s, generator=rng).to(DEV) for s in shapes]
    expected = [_two_launch(x, w, b) for x in inputs]
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            for _ in range(2):
                _poison_allocator()
                got = [cuda_kernels.forward(x, w, b) for x in inputs]  # enqueued back to back
                for shape, g, e in zip(shapes, got, expected, strict=True):
                    assert torch.equal(g, e), shape
        stream.synchronize()
    assert relative_error(expected[1], reference_float64(inputs[1], w, b)) <= FP32_TOL


def test_one_launch_on_many_streams_and_threads(rng):
    # More streams than the library keeps scratch for (the rest take a workspace), used at once from several
    # threads, two of which share a stream: every result is the two-launch one.
    import threading

    w, b = _weights(rng, 16, 3, 3)
    shapes = [(1, 3, 16, 32, 32), (16, 3, 16, 32, 32), (3, 3, 9, 10, 12)]
    inputs = [torch.randn(s, generator=rng).to(DEV) for s in shapes]
    expected = [_two_launch(x, w, b) for x in inputs]
    streams = [torch.cuda.Stream() for _ in range(32)] + [torch.cuda.Stream(priority=-1) for _ in range(40)]
    assert len({s.cuda_stream for s in streams}) > 64 - 1  # with the default stream, beyond the library's 64
    failures = []
    torch.cuda.synchronize()

    def work(mine):
        try:
            for _ in range(3):
                for stream in mine:
                    with torch.cuda.stream(stream):
                        got = [cuda_kernels.forward(x, w, b) for x in inputs]
                    stream.synchronize()
                    failures.extend(s for s, g, e in zip(shapes, got, expected, strict=True) if not torch.equal(g, e))
        except Exception as exc:  # reported below
            failures.append(repr(exc))

    threads = [threading.Thread(target=work, args=([*streams[i::4], streams[0]],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_opcheck_cuda(rng):
    for cout, cin, k in ((16, 3, 3), (5, 2, 2)):
        w, b = _weights(rng, cout, cin, k)
        x = torch.randn(2, cin, 6, 7, 8, generator=rng).to(DEV)
        for args in ((x, w, b), (x, w, b, "tf32")):
            torch.library.opcheck(torch.ops.voxserve.fused_forward.default, args,
                                  test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_cuda_graph_cache_matches_eager_bits(rng):
    w, b = _weights(rng, 16, 3, 3)
    cache, cache_tf32 = GraphCache(w, b, min_uses=1), GraphCache(w, b, min_uses=1, precision="tf32")
    for shape in ((1, 3, 16, 32, 32), (3, 3, 5, 9, 17)):
        x = torch.randn(shape, generator=rng).to(DEV)
        eager = fused_forward(x, w, b)
        assert cache.lookup(x) is None
        cache.note(x)
        entry = cache.lookup(x)
        assert entry is not None
        for _ in range(2):
            x2 = torch.randn(shape, generator=rng)
            entry.stage(x2)
            out = entry.replay().clone()
            assert torch.equal(out, fused_forward(x2.to(DEV), w, b))
            assert relative_error(out, reference_float64(x2, w, b)) <= FP32_TOL
        entry.stage(x)
        assert torch.equal(entry.replay(), eager)
        cache_tf32.note(x)  # the graph runs the mode it was made for
        assert torch.equal(cache_tf32.lookup(x).replay(), fused_forward(x, w, b, "tf32"))
    assert len(cache) == 2


def test_server_serves_the_fused_kernel(rng):
    import numpy as np

    from voxserve.client import Client

    from ..conftest import running_server

    with running_server(device="cuda") as srv:
        assert srv.wait_ready(), srv.server.load_error
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10).read()
        for name in ("voxserve_gpu_utilization_ratio", "voxserve_gpu_memory_used_bytes",
                     "voxserve_gpu_memory_total_bytes"):
            assert f'{name}{{gpu="0"}}'.encode() in text, name
        assert b'kernel="fused-cuda"' in text
        with Client(srv.url) as c:
            assert c.model_config().parameters["kernel"].string_value == "fused-cuda"
            w, b = srv.server.state.runner.model.weights.weight, srv.server.state.runner.model.weights.bias
            for shape in ((2, 3, 16, 32, 32), (1, 3, 3, 3, 3), (3, 3, 5, 9, 17), (1, 3, 16, 32, 32)):
                for _ in range(3):  # the repeats go through the CUDA-graph path
                    x = torch.randn(shape, generator=rng).numpy()
                    y = c.infer(x)
                    ref = reference_float64(torch.from_numpy(x), w, b)
                    assert relative_error(torch.from_numpy(y), ref) <= FP32_TOL
                    y16 = c.infer(x.astype(np.float16), datatype="FP16")
                    ref16 = reference_float64(torch.from_numpy(x.astype(np.float16)), w, b)
                    assert relative_error(torch.from_numpy(y16), ref16) <= FP32_TOL


def test_server_in_tf32_mode(rng):
    from voxserve.client import Client

    from ..conftest import running_server

    with running_server(device="cuda", precision="tf32") as srv:
        assert srv.wait_ready(), srv.server.load_error
        with Client(srv.url) as c:
            assert c.model_config().parameters["kernel"].string_value == "fused-cuda+tf32"
            w, b = srv.server.state.runner.model.weights.weight, srv.server.state.runner.model.weights.bias
            for shape in ((4, 3, 16, 32, 32), (1, 3, 16, 32, 32)):
                x = torch.randn(shape, generator=rng).numpy()
                ref = reference_float64(torch.from_numpy(x), w, b)
                assert relative_error(torch.from_numpy(c.infer(x)), ref) <= ERROR_BOUNDS["tf32"]


def test_under_torch_compile(rng):
    w, b = _weights(rng, 16, 3, 3)
    x = torch.randn(2, 3, 8, 8, 8, generator=rng).to(DEV)
    compiled = torch.compile(lambda t: fused_forward(t, w, b) * 2.0, fullgraph=True)
    assert torch.allclose(compiled(x), fused_forward(x, w, b) * 2.0, rtol=0, atol=0)
