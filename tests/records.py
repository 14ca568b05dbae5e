"""Shared region records (server/protocol/shm.py, cudashm.py) as a coarse file clock leaves them."""

from __future__ import annotations

import os
import types


def as_in_one_tick(monkeypatch, path: str, old: os.stat_result) -> None:
    """From now on os.stat reports the record at ``path`` with ``old``'s inode, mtime and size: a record removed and
    written anew within one tick of the file system's clock, its freed inode reused, looks so."""
    real_stat = os.stat

    def stat(where, *args, **kwargs):
        info = real_stat(where, *args, **kwargs)
        if os.fspath(where) != path:
            return info
        return types.SimpleNamespace(st_ino=old.st_ino, st_mtime_ns=old.st_mtime_ns, st_size=old.st_size)

    monkeypatch.setattr(os, "stat", stat)
