"""Log setup for every command: one line per event, with its structured fields."""

from __future__ import annotations

import logging
import sys

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class _Fields(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        if extra:
            line += " " + " ".join(f"{k}={v!r}" for k, v in sorted(extra.items()))
        return line


def setup(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Fields("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "websockets", "aiosqlite", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
