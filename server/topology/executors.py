"""The one factory that chooses a process's executor from its role: the model in process (standalone, one of
--replicas) or the engines of a front end (--frontends). The in-process executor, and torch with it, is
imported only when chosen, so a front end never loads torch."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.batching import BatchingConfig
from ..core.executor import Opened
from ..core.stats import ModelStats
from ..metrics import Metrics
from ..settings import Settings
from .ipc import Arena
from .remote import RemoteRunner
from .roles import FRONTEND, Role

if TYPE_CHECKING:
    from ..core.weights import Weights

log = logging.getLogger("voxserve")


def read_weights(settings: Settings, role: Role, metrics: Metrics) -> Weights | None:
    """The weights this process serves (core.weights.Weights), None for a front end (its engines read them).
    Raises WeightsError for a file that cannot serve the model."""
    if role.kind == FRONTEND:
        return None
    from ..core.inprocess import load_weights

    return load_weights(settings, metrics)


async def open_executor(settings: Settings, role: Role, weights: Weights | None, stats: ModelStats, metrics: Metrics,
                        lost: Callable[[str], None]) -> Opened:
    """Build the models (warmed up) or connect to the engines; ``lost(reason)`` is called, on any thread, when a
    device fails beyond repair."""
    batching = BatchingConfig.from_settings(settings)
    if role.kind == FRONTEND:
        arena = Arena(settings.frontend_arena_bytes)
        remote = await RemoteRunner.connect(list(role.engines), arena, role.name, batching, lost)
        hello = remote.links[0].hello
        # Shared-memory inputs land in the arena: the engine reads them there, no second copy.
        return Opened(remote, int(hello["cin"]), int(hello["cout"]), int(hello["k"]), ",".join(remote.devices),
                      remote.kernel, arena.allocate_now)
    from ..core.inprocess import build_models
    from ..core.runner import Runner

    assert weights is not None  # read by read_weights for every role but a front end
    models = await asyncio.to_thread(build_models, settings, weights, metrics)
    model = models[0]
    allocate = locker = None
    if all(m.pipeline is not None for m in models):
        # Shared-memory inputs are DMA'd from the client's segment, page-locked where it lies (server/protocol/shm.py);
        # where that is refused, they are copied into pinned memory, which the GPU also reads in place.
        from ..core.hostmem import CudaPageLocker
        from ..core.pipeline import pinned_buffer

        allocate = pinned_buffer
        try:
            locker = CudaPageLocker()
        except OSError as exc:  # no CUDA runtime of torch's to call: copied, as where a page-lock is refused
            log.warning("shared-memory inputs are copied before the GPU reads them: %s", exc)
    return Opened(Runner(models, stats, metrics, batching, lost), model.cin, model.cout, model.k,
                  ",".join(str(m.device) for m in models), model.kernel, allocate, locker)
