"""Fixtures of the GPU tests of CUDA shared memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ..conftest import ServerThread, running_server


@pytest.fixture(scope="module")
def gpu_server() -> Iterator[ServerThread]:
    """A ready in-process server on CUDA that offers CUDA shared memory (one per test module; a module may define
    its own); skipped without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with running_server(device="cuda") as srv:
        assert srv.wait_ready(), srv.server.load_error
        if srv.server.cuda_shm is None:
            pytest.fail("a server on CUDA with the kernel library offers CUDA shared memory")
        yield srv
