"""What the protocol layer may ask of whatever executes its requests: the contract between the two rooms.

Two implementations: ``core.runner.Runner`` (the model in this process, one worker per device) and
``topology.remote.RemoteRunner`` (a front end's link to the engines of --frontends);
``topology.executors.open_executor`` chooses between them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .batching import BatchingConfig, BatchResult
from .devicemem import DeviceArray, RegionTensor
from .errors import ServingError
from .hostmem import PageLocker


class Executor(Protocol):
    batching: BatchingConfig
    device_lost: str | None  # why the device failed beyond repair; None while it works

    def admit(self) -> None:
        """Refuse (QueueFull) before the request is decoded when there is no room for it."""

    def run(self, array: np.ndarray | DeviceArray | RegionTensor, datatype: str,
            timeout_s: float | None) -> Awaitable[BatchResult]:
        """(N, Cin, D, H, W) of a wire datatype -> (N, Cout) float32, batched with others; raises ServingError,
        QueueFull or DeadlineExceeded. A tensor in a client's CUDA memory only where the server offers CUDA shared
        memory: in the model's process a DeviceArray (its address), in a front end a RegionTensor (its region)."""

    def lost_error(self) -> ServingError:
        """The error for requests while ``device_lost`` is set."""

    async def close(self) -> None:
        """Finish or fail what is queued and free the devices."""


@dataclass(frozen=True)
class Opened:
    """An executor ready to serve, and what the server says of it."""

    executor: Executor
    cin: int
    cout: int
    k: int
    devices: str  # comma-separated
    kernel: str
    # Where shared-memory inputs are best copied to (pinned or arena memory), None for private memory.
    allocate: Callable[[int], memoryview] | None = None
    # What page-locks clients' segments for the GPU to read inputs in place (a GPU server), None: they are copied.
    page_locker: PageLocker | None = None
