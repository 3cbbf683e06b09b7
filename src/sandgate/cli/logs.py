"""Log setup for every command: one event per line, with structlog.

Code logs through the standard library (`log.info("sandbox.started", extra={...})`); a
structlog `ProcessorFormatter` renders each record with its structured fields and what the
request's context holds (`log_context.py`: request id, tenant, sandbox, instance).
`SANDGATE_LOG_FORMAT=json` (or `--log-format json`) writes one JSON object a line (`time`,
`level`, `logger`, `message` and the fields), for whatever reads the log by machine: the e2e
tests read the worker's account of what it started from it. `text` (the default) is one
plain line an event: time, level, logger, event, then its fields as `key=value`.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
from structlog.typing import EventDict, Processor


def _upper_level(_logger: object, _name: str, event: EventDict) -> EventDict:
    event["level"] = str(event.get("level", "")).upper()  # INFO, WARNING: as before
    return event


def _chain(fmt: str) -> list[Processor]:
    """What every record goes through: the request's context, its level and logger, its
    `extra` fields, the time (`time` in JSON; first on the line in text)."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        _upper_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(
            fmt="iso", utc=True, key="time" if fmt == "json" else "timestamp"
        ),
    ]


def _renderer(fmt: str) -> list[Processor]:
    if fmt == "json":
        return [
            structlog.processors.format_exc_info,
            structlog.processors.EventRenamer("message"),
            structlog.processors.JSONRenderer(default=str),
        ]
    return [structlog.processors.format_exc_info, _console_line]


def _console_line(_logger: object, _name: str, event: EventDict) -> str:
    """`TIME LEVEL LOGGER EVENT key=value...` (values as repr, keys sorted), then the
    traceback if there is one: greppable, one event a line."""
    head = [str(event.pop(k, "")) for k in ("timestamp", "level", "logger", "event")]
    trace = event.pop("exception", None)
    fields = " ".join(f"{k}={v!r}" for k, v in sorted(event.items()))
    line = " ".join([*head, fields] if fields else head)
    return f"{line}\n{trace}" if trace else line


def setup(level: str = "INFO", fmt: str | None = None) -> None:
    """`fmt`: `text` (the default) or `json`; unset, SANDGATE_LOG_FORMAT decides."""
    fmt = fmt or os.environ.get("SANDGATE_LOG_FORMAT") or "text"
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: use text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_chain(fmt),
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *_renderer(fmt),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "websockets", "aiosqlite", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
