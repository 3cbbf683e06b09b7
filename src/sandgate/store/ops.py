"""`store_op`: the one place driver failures become `StoreError`.

The error carries the driver's cause ("database or disk is full"), worded so that no value of
the failed statement can be in it: it is shown to the client that made the request. The log
line `store.failed` carries the driver's own message (never the SQL or its parameters).
"""

from __future__ import annotations

import functools
import logging
import re
import sqlite3
from collections.abc import Callable, Coroutine
from typing import Any, Final, ParamSpec, TypeVar

from sqlalchemy.exc import SQLAlchemyError, StatementError

from sandgate.errors import StoreError

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger(__name__)

DRIVER_ERRORS: Final = (
    SQLAlchemyError,
    OSError,  # includes ConnectionError: asyncpg raises these raw while connecting
    TimeoutError,
    sqlite3.Error,
)

_MAX_CAUSE = 300  # characters of a driver message kept


def _words(name: str) -> str:
    """DiskFullError -> "disk full"."""
    name = name.removesuffix("Error") or name
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name).lower()


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:_MAX_CAUSE]


def cause_of(exc: BaseException) -> tuple[str, str]:
    """(shown, logged): the driver's cause of a failure, for the client and for the log.

    SQLAlchemy's own text is never used for a statement error: it carries the SQL and its
    parameters. SQLite's messages are fixed texts (at most naming a table or column);
    PostgreSQL's may quote a value, so the client gets only its condition and SQLSTATE.
    """
    orig: BaseException = exc
    if isinstance(exc, StatementError) and exc.orig is not None:
        orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None)
    message = _first_line(str(orig))
    if isinstance(sqlstate, str):  # asyncpg, through SQLAlchemy's adapter
        driver = orig.__cause__ if orig.__cause__ is not None else orig
        shown = f"{_words(type(driver).__name__)} (SQLSTATE {sqlstate})"
        return shown, f"{message} (SQLSTATE {sqlstate})"
    if isinstance(orig, sqlite3.Error):
        return message or _words(type(orig).__name__), message
    if isinstance(orig, OSError) and orig.strerror:
        return orig.strerror, message or orig.strerror
    if isinstance(orig, TimeoutError):
        return "timed out", message or "timed out"
    if orig is exc and isinstance(exc, SQLAlchemyError):  # pool and connection errors
        return message or _words(type(exc).__name__), message
    return _words(type(orig).__name__), message or type(orig).__name__


def store_op(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn driver failures into StoreError; StoreError subclasses pass through."""
    op = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except StoreError:
            raise
        except DRIVER_ERRORS as exc:
            shown, logged = cause_of(exc)
            log.warning(
                "store.failed", extra={"op": op, "error": type(exc).__name__, "cause": logged}
            )
            raise StoreError(f"the store failed ({op}): {shown}") from exc

    return wrapper
