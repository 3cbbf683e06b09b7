"""`store_op`: the one place driver failures become `StoreError`."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable, Coroutine
from typing import Any, Final, ParamSpec, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from sandgate.errors import StoreError

P = ParamSpec("P")
R = TypeVar("R")

DRIVER_ERRORS: Final = (
    SQLAlchemyError,
    OSError,  # includes ConnectionError: asyncpg raises these raw while connecting
    TimeoutError,
    sqlite3.Error,
)


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
            raise StoreError(f"the store failed ({op})") from exc

    return wrapper
