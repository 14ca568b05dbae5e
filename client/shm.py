"""POSIX shared-memory buffers for the protocol's system shared-memory extension (client side)."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np


class SharedMemoryBuffer:
    """A named segment under /dev/shm that this process creates and removes; numpy views onto it.

        with SharedMemoryBuffer("vox_in", x.nbytes) as buf:
            buf.write(x)
            client.register_system_shared_memory("in", buf.key, buf.size)
    """

    def __init__(self, name: str, size: int) -> None:
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.key = "/" + self._shm.name
        self.size = size

    @property
    def _buf(self) -> memoryview:
        buf = self._shm.buf
        if buf is None:
            raise ValueError(f"shared-memory segment {self.key} is closed")
        return buf

    def write(self, array: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(array)
        self._buf[offset : offset + data.nbytes] = data.view(np.uint8).reshape(-1).data

    def read(self, dtype, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        count = int(np.prod(shape))
        return np.frombuffer(self._buf, dtype=dtype, count=count, offset=offset).reshape(shape).copy()

    def close(self) -> None:
        self._shm.close()
        self._shm.unlink()

    def __enter__(self) -> SharedMemoryBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
