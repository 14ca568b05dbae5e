"""The DeviceMemory contract (server/core/devicemem.py), run against both implementations: the fake (always) and
the kernel library's CUDA IPC (on a GPU; the exporter is a child process, as the driver refuses a handle of the
importing process itself: tests/cuda_exporter.py)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator

import pytest
import torch

from voxserve.server.core.devicemem import HANDLE_BYTES, DeviceMemory, DeviceMemoryError, Mapping
from voxserve.testing.fake_devicemem import FakeDeviceMemory

from ..cuda_exporter import Exporter, NoExporter, own_process_handle

Export = Callable[[bytes], tuple[bytes, int]]  # data -> (handle, offset of the data from the mapped address)


def _read(layer: str, mapping: Mapping, offset: int, n: int) -> bytes:
    if layer == "fake":
        return ctypes.string_at(mapping.address + offset, n)

    class _View:  # the mapped bytes as a CUDA array, for torch to copy back
        @property
        def __cuda_array_interface__(self) -> dict:
            return {"shape": (n,), "typestr": "|u1", "data": (mapping.address + offset, False), "version": 3,
                    "strides": None}

    return bytes(torch.as_tensor(_View(), device=f"cuda:{mapping.opened_on}").cpu().numpy())


@contextlib.contextmanager
def _layer(kind: str) -> Iterator[tuple[DeviceMemory, Export]]:
    if kind == "fake":
        fake = FakeDeviceMemory()
        yield fake, lambda data: (fake.export(data), 0)
        return
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    from voxserve.kernels import cuda as cuda_kernels
    from voxserve.server.core.devicemem import CudaDeviceMemory

    problem = cuda_kernels.load_problem()
    if problem is not None:
        pytest.skip(f"kernel library unavailable: {problem}")
    try:
        exporter = Exporter()
    except NoExporter as exc:
        pytest.skip(f"no exporter process: {exc}")

    def export(data: bytes) -> tuple[bytes, int]:
        return exporter.alloc(len(data), data).handle, 0  # an allocation of its own: the data at its start

    try:
        yield CudaDeviceMemory(), export
    finally:
        exporter.close()


LAYERS = ["fake", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("kind", LAYERS)
def test_an_exported_handle_opens_with_the_allocations_extent_and_its_bytes(kind):
    with _layer(kind) as (layer, export):
        data = os.urandom(3 * 1024 * 1024 + 17)
        handle, offset = export(data)
        assert len(handle) == HANDLE_BYTES
        mapping = layer.open(handle, 0)
        try:
            assert mapping.size >= offset + len(data)  # at least what was exported (an allocation may be rounded up)
            assert mapping.base <= mapping.address and 0 <= mapping.device < layer.device_count()
            assert mapping.opened_on == 0
            assert _read(kind, mapping, offset, len(data)) == data
        finally:
            layer.close(mapping)


@pytest.mark.parametrize("kind", LAYERS)
def test_handles_that_do_not_open_are_errors_with_a_reason_and_leave_the_layer_working(kind):
    with _layer(kind) as (layer, export):
        for garbage in (bytes(HANDLE_BYTES), b"\xff" * HANDLE_BYTES, os.urandom(HANDLE_BYTES)):
            with pytest.raises(DeviceMemoryError) as err:
                layer.open(garbage, 0)
            assert err.value.reason and err.value.cuda_error.startswith("cudaError")
        with pytest.raises(DeviceMemoryError):
            layer.open(os.urandom(HANDLE_BYTES), layer.device_count())  # a device it does not have
        handle, offset = export(b"still works")
        mapping = layer.open(handle, 0)
        assert _read(kind, mapping, offset, 11) == b"still works"
        layer.close(mapping)
        if kind == "cuda":  # the failed opens left no error behind for the next launch to be blamed for
            from voxserve.kernels import fused_forward, reference_float64, reference_weights

            w, b = reference_weights()
            x = torch.randn(2, 3, 6, 6, 6)
            got = fused_forward(x.cuda(), w.cuda(), b.cuda()).cpu().double()
            assert torch.allclose(got, reference_float64(x, w, b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", LAYERS)
def test_a_handle_of_this_process_does_not_open(kind):
    with _layer(kind) as (layer, _):
        if kind == "fake":
            assert isinstance(layer, FakeDeviceMemory)
            handle = layer.export(b"mine", own_process=True)
        else:
            handle, free = own_process_handle()
        try:
            with pytest.raises(DeviceMemoryError) as err:
                layer.open(handle, 0)
            assert err.value.reason
        finally:
            if kind == "cuda":
                free()
