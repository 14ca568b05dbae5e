"""The pipeline's host side of a batch (no GPU needed): inputs in a DMA-only range (a client's segment, page-locked
where it lies) are never read on the host, alone or batched with inputs that are staged. The DMA-only input here
lies in memory mapped PROT_NONE: any host read of it would fault."""

from __future__ import annotations

import ctypes
import mmap
import queue
import threading

import numpy as np
import pytest
import torch

from voxserve.server.core import hostmem, pipeline
from voxserve.server.core.pipeline import CudaPipeline

SAMPLE = (3, 4, 8, 8)


class _HostSlot:
    """A slot's host side only: its staging (the device side is not touched before submit's DMA)."""

    def __init__(self) -> None:
        self.host = torch.empty(0, dtype=torch.uint8)

    def reserve(self, nbytes: int, out_floats: int) -> None:
        if self.host.numel() < nbytes:
            self.host = torch.zeros(nbytes, dtype=torch.uint8)


def _host_side() -> CudaPipeline:
    p = object.__new__(CudaPipeline)  # no CUDA streams: only _begin, _stage and _count run
    p.graphs, p.cout, p._lock = None, 16, threading.Lock()
    p.staged_bytes = p.direct_bytes = 0
    p._free = queue.Queue()
    p._free.put(_HostSlot())
    return p


@pytest.fixture
def unreadable(monkeypatch):
    """(2, *SAMPLE) float32 samples in memory no one may read, registered page-locked and DMA-only."""
    monkeypatch.setattr(pipeline, "_LOCKED", ())
    monkeypatch.setattr(pipeline, "_DMA_ONLY", ())
    nbytes = 2 * int(np.prod(SAMPLE)) * 4  # mapped PROT_NONE (0) below
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    base = hostmem._libc.mmap(None, length, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    pipeline.register_page_locked(base, length, dma_only=True)
    try:
        yield np.frombuffer((ctypes.c_char * nbytes).from_address(base), np.float32).reshape(2, *SAMPLE)
    finally:
        pipeline.unregister_page_locked(base, length)
        hostmem._libc.munmap(base, length)


def test_a_batch_of_dma_only_inputs_is_gathered_in_place(unreadable):
    p = _host_side()
    batch = p._begin([unreadable[:1], unreadable[1:]], True, None)
    assert batch is not None and batch.staged == [False, False]
    assert batch.direct is not None and batch.direct.tolist() == [
        [unreadable.ctypes.data, unreadable[0].nbytes], [unreadable[1:].ctypes.data, unreadable[0].nbytes]]


def test_batched_with_pageable_inputs_only_those_are_staged(unreadable):
    p = _host_side()
    other = np.random.default_rng().standard_normal((3, *SAMPLE), dtype=np.float32)
    arrays = [unreadable[:1], other, unreadable[1:]]
    batch = p._begin(arrays, True, None)
    assert batch is not None and batch.staged == [False, True, False]
    staging = batch.slot.host
    row = unreadable[0].nbytes
    assert batch.direct is not None and batch.direct.tolist() == [
        [unreadable.ctypes.data, row], [staging.data_ptr() + row, other.nbytes],
        [unreadable[1:].ctypes.data, row]]
    p._stage(batch.slot, arrays, batch.staged)  # would fault if it read the DMA-only inputs
    assert staging[row : row + other.nbytes].numpy().tobytes() == other.tobytes()
    p._count(arrays, batch.staged)
    assert p.staged_bytes == other.nbytes and p.direct_bytes == 2 * row
    # A host-copy limit counts the staged bytes only.
    p._free.put(batch.slot)
    assert p._begin(arrays, True, other.nbytes - 1) is None
    assert p._begin(arrays, True, other.nbytes) is not None


def test_a_non_contiguous_view_of_a_dma_only_input_is_refused_not_copied(unreadable):
    p = _host_side()
    with pytest.raises(RuntimeError, match="DMA-only"):
        p._begin([unreadable[:, ::2]], True, None)
    p.native = object()  # the native path makes inputs contiguous first: not these
    with pytest.raises(RuntimeError, match="DMA-only"):
        p._submit_native([unreadable[:, ::2]], "FP32", True, False, None)
