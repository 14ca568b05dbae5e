"""The CPU path's memory stays within a few chunk caps for any sample size, and its tiles stay exact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from voxserve.kernels import fused_forward, ops, reference_float64
from voxserve.server.core.model import relative_error

from ..conftest import REPO


def _weights(rng: torch.Generator, cout: int, cin: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(cout, cin, k, k, k, generator=rng) * 0.3, torch.randn(cout, generator=rng) * 0.1


def _cap_for(cout: int, voxels: int) -> int:
    # The cap at which a tile holds `voxels` output voxels (a tile is a third of the cap, when the cap is
    # below ops._CPU_TILE_BYTES as here).
    return 3 * cout * 4 * voxels


def _reference_calls(monkeypatch, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> list[tuple[int, ...]]:
    # The input shape of every call the CPU path makes to the reference.
    calls: list[tuple[int, ...]] = []
    real = ops.reference

    def spy(part, weight, bias):
        calls.append(tuple(part.shape))
        return real(part, weight, bias)

    monkeypatch.setattr(ops, "reference", spy)
    fused_forward(x, w, b)
    return calls


def _check_calls(calls: list[tuple[int, ...]], shape: tuple[int, ...], cout: int, k: int, budget: int) -> None:
    # Two or more tiles a call keep torch's CPU conv3d off vol2col, whose buffer is Cin*k^3/Cout times the
    # output; no call's conv output passes the budget, whatever the sample's size; the tiles cover the output.
    out_voxels = 0
    for n, _, d, h, width in calls:
        conv_bytes = n * cout * (d - k + 1) * (h - k + 1) * (width - k + 1) * 4
        assert n >= 2 and conv_bytes <= budget, (calls, budget)
        out_voxels += conv_bytes // (cout * 4)
    assert out_voxels == shape[0] * (shape[2] - k + 1) * (shape[3] - k + 1) * (shape[4] - k + 1)


# (shape, cout, k, tile voxels): out = shape[2:] - k + 1; the tile size picks slabs of whole output planes,
# rows of a plane or runs of one row, with odd sizes so the pieces come in two lengths.
TILED_CASES = [
    ((1, 3, 9, 6, 7), 16, 3, 4 * 5),           # out 7x4x5: slabs of 1 plane
    ((2, 3, 12, 7, 6), 16, 3, 3 * 5 * 4),      # out 10x5x4: slabs of up to 3 planes (3,3,2,2)
    ((3, 2, 11, 5, 9), 11, 1, 2 * 5 * 9),      # k=1, out 11x5x9: slabs of 2 planes, 3 samples
    ((2, 3, 13, 9, 8), 7, 5, 2 * 5 * 4),       # k=5, out 9x5x4: slabs of 2 planes
    ((1, 3, 4, 13, 10), 16, 3, 3 * 8),         # out 2x11x8: rows of up to 3 along H
    ((2, 1, 3, 4, 23), 5, 3, 6),               # out 1x2x21: runs of 6 along W
    ((1, 4, 7, 7, 7), 16, 5, 1),               # k=5, out 3x3x3: one voxel per tile
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("shape", "cout", "k", "voxels"), TILED_CASES)
def test_tiled_samples_match_float64(rng, monkeypatch, shape, cout, k, voxels, dtype):
    w, b = _weights(rng, cout, shape[1], k)
    x = torch.randn(shape, generator=rng).to(dtype)
    monkeypatch.setattr(ops, "_CPU_CHUNK_BYTES", _cap_for(cout, voxels))
    out = fused_forward(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (shape[0], cout)
    assert relative_error(out, reference_float64(x, w, b)) <= ops.ERROR_BOUNDS["fp32"]


def test_tiled_non_contiguous_sample_matches_float64(rng, monkeypatch):
    w, b = _weights(rng, 16, 3, 3)
    x = torch.randn(2, 11, 9, 3, 10, generator=rng).to(torch.float16).permute(0, 3, 1, 2, 4)  # (2, 3, 11, 9, 10)
    assert not x.is_contiguous()
    monkeypatch.setattr(ops, "_CPU_CHUNK_BYTES", _cap_for(16, 2 * 7 * 8))
    assert relative_error(fused_forward(x, w, b), reference_float64(x, w, b)) <= ops.ERROR_BOUNDS["fp32"]


@pytest.mark.parametrize(("shape", "cout", "k", "voxels"), TILED_CASES)
def test_every_reference_call_fits_the_cap_with_two_samples_or_more(rng, monkeypatch, shape, cout, k, voxels):
    cap = _cap_for(cout, voxels)
    monkeypatch.setattr(ops, "_CPU_CHUNK_BYTES", cap)
    w, b = _weights(rng, cout, shape[1], k)
    calls = _reference_calls(monkeypatch, torch.randn(shape, generator=rng, dtype=torch.float16), w, b)
    _check_calls(calls, shape, cout, k, cap)


def test_a_sample_near_the_cap_goes_in_batches_of_tiles(rng, monkeypatch):
    # At the shipped sizes: 6 MiB of float16 whose conv output (16 x 58 x 58 x 288 floats, 59 MiB) fitted the
    # old chunk whole, as one sample, and so went through vol2col (~370 MiB above the baseline).
    shape = (1, 3, 60, 60, 290)
    w, b = _weights(rng, 16, 3, 3)
    x = torch.randn(shape, generator=rng, dtype=torch.float16)
    _check_calls(_reference_calls(monkeypatch, x, w, b), shape, 16, 3, ops._CPU_CHUNK_BYTES)


_CHILD = """
import json, resource, torch
from voxserve.kernels import fused_forward, ops, reference_weights

def status_bytes(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

w, b = reference_weights()
fused_forward(torch.randn(2, 3, 8, 8, 8), w, b)  # libraries and thread pools in place before the baseline
x = torch.empty(SHAPE, dtype=torch.float16).normal_()
try:  # the peak from here on (start-up may have peaked higher, loading libraries)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
before = status_bytes("VmRSS")
fused_forward(x, w, b)
peak = status_bytes("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "peak": peak, "cap": ops._CPU_CHUNK_BYTES}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads VmRSS from /proc and ru_maxrss in KiB")
@pytest.mark.parametrize("shape", [(1, 3, 160, 160, 160), (1, 3, 60, 60, 290)])
def test_one_large_sample_stays_within_a_few_caps(shape):
    # float16. 160^3 is 23 MiB whose conv output is 242 MiB: computed whole, it and the activation after it
    # (plus the float32 input) took ~530 MiB above the baseline. 60x60x290 is 6 MiB whose conv output fitted
    # the cap but went through vol2col as a lone sample: ~375 MiB.
    child = subprocess.run([sys.executable, "-c", _CHILD.replace("SHAPE", repr(shape))], cwd=REPO,
                           capture_output=True, text=True, timeout=300, check=True)
    figures = json.loads(child.stdout.strip().splitlines()[-1])
    input_float32 = 4 * shape[1] * shape[2] * shape[3] * shape[4]
    bound = input_float32 + 3 * figures["cap"]
    rise = figures["peak"] - figures["before"]
    assert rise <= bound, f"peak RSS rose {rise / 2**20:.0f} MiB for one sample; bound {bound / 2**20:.0f} MiB"
