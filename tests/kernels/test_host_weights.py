"""The host copies of the weights that the specialised kernels take by value (kernels/cuda.py, _HostWeights): kept
per weight tensor and version, least recently used out, on CPU tensors (the cache does not depend on the device)."""

from __future__ import annotations

import logging

import torch

from voxserve.kernels.cuda import _HostWeights


def _pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, 3, 3, 3, 3, generator=gen), torch.randn(16, generator=gen)


def test_a_model_per_gpu_of_a_large_host_keeps_its_copy():
    # One process serving eight GPUs (--devices) holds eight weight pairs: each call after the first takes its copy
    # from the cache (the same tensors), none is copied again (a copy from a GPU waits for it).
    cache = _HostWeights()
    pairs = [_pair(i) for i in range(8)]
    first = [cache.get(w, b) for w, b in pairs]
    for _ in range(3):
        for (w, b), (w_host, b_host) in zip(pairs, first, strict=True):
            again = cache.get(w, b)
            assert again[0] is w_host and again[1] is b_host


def test_least_recently_used_goes_first():
    cache = _HostWeights(capacity=2)
    a, b, c = _pair(1), _pair(2), _pair(3)
    copy_a, copy_b = cache.get(*a), cache.get(*b)
    assert cache.get(*a)[0] is copy_a[0]  # a is now the most recently used
    cache.get(*c)  # evicts b
    assert cache.get(*a)[0] is copy_a[0]
    assert cache.get(*b)[0] is not copy_b[0]


def test_an_in_place_update_is_a_new_copy():
    cache = _HostWeights()
    w, b = _pair(4)
    before = cache.get(w, b)[0].clone()
    with torch.no_grad():
        w.mul_(-2.0)
    after = cache.get(w, b)[0]
    assert torch.equal(after, w) and torch.equal(after, before * -2.0)


def test_inference_mode_weights_are_copied_every_call_with_one_warning(caplog):
    cache = _HostWeights()
    with torch.inference_mode():
        w, b = _pair(5)
    with caplog.at_level(logging.WARNING, logger="voxserve.kernels.cuda"):
        copies = [cache.get(w, b)[0] for _ in range(3)]
    assert all(torch.equal(c, w) for c in copies)
    assert copies[0] is not copies[1]  # not kept: an in-place change could not be seen
    warnings = [r for r in caplog.records if "inference_mode" in r.getMessage()]
    assert len(warnings) == 1
