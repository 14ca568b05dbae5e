"""The server's logging, set up once per process from --log-level (every process of a topology alike)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str) -> None:
    """Log records at ``level`` and above to stderr, one line each (a no-op once the root logger has handlers)."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
