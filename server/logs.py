"""The server's logging, set up once per process from --log-level and --log-format (every process of a topology
alike): text lines for people, or one JSON object per line for log shippers (Loki, ELK, Cloud Logging)."""

from __future__ import annotations

import datetime
import json
import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")
# Context a record may carry (logging's ``extra=``), written as fields of its JSON object when present.
CONTEXT_FIELDS = ("request_id", "model", "peer")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, process id, the context fields
    a record carries, and the exception's traceback as ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for field in CONTEXT_FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure(level: str, log_format: str = "text") -> None:
    """Log records at ``level`` and above to stderr, one line each, as text or JSON (a no-op once the root
    logger has handlers)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(level.upper())
