"""Start-up objects out of the garbage collector's way."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive (modules, torch, weights, what warm-up left: some 180k
    objects in a server process) to the collector's permanent generation. Its full collections then scan
    only what serving allocates. Without this each one scanned them all and held the event loop, and every
    request waiting on it, for ~140 ms on a 2-core box (bench/probes/gc_pauses.py)."""
    gc.collect()
    gc.freeze()
