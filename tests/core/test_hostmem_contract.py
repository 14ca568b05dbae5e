"""The PageLocker contract (server/core/hostmem.py), run against both implementations: the fake (always) and
cudaHostRegister (on a GPU), on real read-only mappings of a /dev/shm segment (map_segment)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from voxserve.server.core import pipeline
from voxserve.server.core.hostmem import HostMemoryError, PageLocker, map_segment, unmap_segment
from voxserve.testing.fake_hostmem import FakePageLocker

LAYERS = [pytest.param("fake", id="fake"),
          pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
              not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _locker(kind: str) -> PageLocker:
    if kind == "fake":
        return FakePageLocker()
    from voxserve.server.core.hostmem import CudaPageLocker

    locker = CudaPageLocker()
    if locker.refusal:
        pytest.skip(locker.refusal)
    return locker


@contextlib.contextmanager
def _segment(data: bytes) -> Iterator[int]:
    path = f"/dev/shm/vox_hm_{uuid.uuid4().hex[:10]}"
    with open(path, "wb") as f:
        f.write(data)
    fd = os.open(path, os.O_RDWR)
    try:
        yield fd
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_mapping_is_the_segments_bytes_from_any_offset():
    data = np.random.default_rng().integers(0, 256, 3 * 4096, dtype=np.uint8).tobytes()
    with _segment(data) as fd:
        for offset, nbytes in ((0, 4096), (100, 5000), (4096, 8192)):
            m = map_segment(fd, offset, nbytes)
            assert m.base % 4096 == 0 and m.base <= m.address < m.base + m.length
            assert m.address - m.base == offset % 4096 and m.length == offset % 4096 + nbytes and m.read_only
            assert ctypes.string_at(m.address, nbytes) == data[offset : offset + nbytes]
            unmap_segment(m)


@pytest.mark.parametrize("kind", LAYERS)
def test_lock_and_unlock_a_read_only_mapping(kind, monkeypatch):
    monkeypatch.setattr(pipeline, "_LOCKED", ())
    monkeypatch.setattr(pipeline, "_DMA_ONLY", ())
    locker = _locker(kind)
    with _segment(bytes(range(256)) * 64) as fd:
        m = map_segment(fd, 100, 10000)
        try:
            try:
                locker.lock(m.base, m.length, read_only=True)
            except HostMemoryError:  # a device without read-only registration: the registry maps writable then
                unmap_segment(m)
                m = map_segment(fd, 100, 10000, read_only=False)
                locker.lock(m.base, m.length, read_only=False)
            if kind == "cuda":  # told to the pipeline: DMA'd in place, never read on the host
                assert pipeline._registered(m.address, 10000) and pipeline.touches_dma_only(m.address, 1)
                dst = torch.empty(10000, dtype=torch.uint8, device="cuda")
                from voxserve.kernels import cuda as fused_cuda

                stream = torch.cuda.Stream()
                fused_cuda.copy_spans(dst, np.array([[m.address, 10000]], dtype=np.int64), stream)
                stream.synchronize()
                assert bytes(dst.cpu().numpy()) == (bytes(range(256)) * 64)[100:10100]
            with pytest.raises(HostMemoryError):
                locker.lock(m.base, m.length, read_only=m.read_only)  # locked already
            locker.unlock(m.base, m.length)
            assert not pipeline._registered(m.address, 1)
            with pytest.raises(HostMemoryError):
                locker.unlock(m.base, m.length)  # not locked any more
        finally:
            unmap_segment(m)
