"""py-spy sampling of a running process, as stacks: shared by the profiling probes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path


def record(pid: int, seconds: float, rate: int = 200, threads: bool = False) -> list[tuple[list[str], int]]:
    """Sample ``pid`` for ``seconds`` (py-spy record, raw): each distinct stack (outermost frame first; with
    ``threads`` the first frame names the thread) and how many samples it got."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        subprocess.run([py_spy, "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", str(rate), "-f",
                        "raw", "-o", out.name, "--nonblocking", *(["--threads"] if threads else [])],
                       check=True, capture_output=True)
        stacks = []
        for line in Path(out.name).read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if stack and n.isdigit():
                stacks.append((stack.split(";"), int(n)))
    return stacks


def by_self(stacks: list[tuple[list[str], int]]) -> Counter:
    """Samples per innermost frame (where the time is spent)."""
    shares: Counter = Counter()
    for frames, n in stacks:
        shares[frames[-1] if frames else "(no Python frame)"] += n
    return shares


def by_total(stacks: list[tuple[list[str], int]], keep=lambda frame: True) -> Counter:
    """Samples per frame anywhere on the stack (each frame counted once per stack), for frames ``keep`` takes."""
    shares: Counter = Counter()
    for frames, n in stacks:
        for frame in set(frames):
            if keep(frame):
                shares[frame] += n
    return shares
