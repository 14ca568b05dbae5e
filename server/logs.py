"""The server's logging, set up once per process from --log-level and --log-format (every process of a topology
alike): text lines for people, or one JSON object per line for log shippers (Loki, ELK, Cloud Logging); and the
access log (``--access-log``): one record per inference request, for either transport::

    access_log = AccessLog(settings.access_log_sample_rate) if settings.access_log else None
    ...  # where a request ends:
    if access_log is not None:
        access_log.record(transport="http", method="infer", code="OK", model="voxnet", peer="127.0.0.1:50112",
                          request_id="r-1", duration_ms=1.9, input_bytes=24576, samples=2, http_status=200)
"""

from __future__ import annotations

import datetime
import json
import logging
import random
from collections.abc import Callable

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")
# Context a record may carry (logging's ``extra=``), written as fields of its JSON object when present.
CONTEXT_FIELDS = ("request_id", "model", "peer", "method", "transport", "code", "http_status", "duration_ms",
                  "input_bytes", "samples")
ACCESS_LOGGER = "voxserve.access"
# Client-given text (a request id, a model name) as the access log writes it: at most this long, one line.
MAX_LOGGED_CHARS = 256


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


def printable(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """``text`` as a log may carry it when a client chose it: one line (control characters escaped, so no record
    can be forged with a newline) of at most ``limit`` characters."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return text if text.isprintable() else repr(text)[1:-1]


class AccessLog:
    """One INFO record per request on the logger ``voxserve.access``, written whatever --log-level says (the
    logger has its own level). ``sample_rate``: the share of successful requests (code OK) that are logged,
    drawn at random per request; failed ones are always logged, being rarer and the ones looked for. ``draw``
    (a seam for tests): the random number in [0, 1) a request is sampled by."""

    def __init__(self, sample_rate: float = 1.0, draw: Callable[[], float] = random.random,
                 logger: logging.Logger | None = None) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"--access-log-sample-rate={sample_rate!r}: must be in (0, 1]")
        self.sample_rate = sample_rate
        self.draw = draw
        self._log = logger or logging.getLogger(ACCESS_LOGGER)
        self._log.setLevel(logging.INFO)

    def record(self, *, transport: str, method: str, code: str, duration_ms: float, model: str | None = None,
               peer: str | None = None, request_id: str | None = None, input_bytes: int = 0, samples: int = 0,
               http_status: int | None = None) -> None:
        """Log one request that ended with the protocol's status ``code`` (OK, INVALID_ARGUMENT, ...; over HTTP
        also its ``http_status``) after ``duration_ms``. ``model`` and ``request_id``, where a client chose them,
        are written through :func:`printable`."""
        if code == "OK" and self.sample_rate < 1 and self.draw() >= self.sample_rate:
            return
        if model is not None:
            model = printable(model)
        if request_id is not None:
            request_id = printable(request_id)
        status = code if http_status is None else f"{http_status} {code}"
        self._log.info("%s %s %s %.3f ms model=%s samples=%d input_bytes=%d peer=%s id=%s", transport, method,
                       status, duration_ms, model or "-", samples, input_bytes, peer or "-", request_id or "-",
                       extra={"transport": transport, "method": method, "code": code, "http_status": http_status,
                              "duration_ms": round(duration_ms, 3), "model": model, "peer": peer,
                              "request_id": request_id, "input_bytes": input_bytes, "samples": samples})
