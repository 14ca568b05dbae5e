"""The commit a benchmark's report names.

A device machine runs a copy of the working tree whose git metadata may be older than the tree itself, so its
callers pass the commit measured (``--commit``, or ``COMMIT=...`` to bench/device_*.sh, which pass it on).
"""

from __future__ import annotations

import os
import subprocess


def commit(given: str | None = None) -> str:
    """``given`` (a script's --commit), else $VOXSERVE_COMMIT, else this checkout's HEAD as git names it, with
    "+changes" when the tracked files differ from it, and "(git's HEAD)" said so a reader knows where it came from."""
    if given:
        return given
    if os.environ.get("VOXSERVE_COMMIT"):
        return os.environ["VOXSERVE_COMMIT"]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no")
    return f"{head}{'+changes' if changed else ''} (git's HEAD)"
