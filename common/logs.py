"""Process logging: plain text for a terminal, one JSON object per line for
collectors (``--log-format json``). A ``request_id`` passed in ``extra`` (the
id the gateway gave the request, carried to the worker in ``QueuedRequest``)
becomes a top-level field, so one request can be followed across processes."""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra fields, "exc"}`` per record (ts: Unix seconds)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON; non-serializable extras become strings."""
        entry = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
                 "msg": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Install one stderr handler on the root logger.

    Args:
        level: a logging level name.
        fmt: "text" (human-readable) or "json" (one object per line).

    Raises:
        ValueError: for an unknown ``fmt``.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the demo
