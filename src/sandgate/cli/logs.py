"""Log setup for every command: one line per event, with its structured fields.

`SANDGATE_LOG_FORMAT=json` writes each record as one JSON object instead (`time`, `level`,
`logger`, `message` and the record's structured fields), for whatever reads the log by
machine: the e2e tests read the worker's account of what it started from it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class _Fields(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = _extra(record)
        if extra:
            line += " " + " ".join(f"{k}={v!r}" for k, v in sorted(extra.items()))
        return line


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            **_extra(record),
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "INFO", fmt: str | None = None) -> None:
    """`fmt`: `text` (the default) or `json`; unset, SANDGATE_LOG_FORMAT decides."""
    fmt = fmt or os.environ.get("SANDGATE_LOG_FORMAT") or "text"
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: use text or json")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_Json())
    else:
        handler.setFormatter(_Fields("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "websockets", "aiosqlite", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
