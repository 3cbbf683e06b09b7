"""The engine set-up and `Database`, the one object every domain of the SQL store shares.

`open_engines` builds the engines (driver, pool, SQLite pragmas); `Database` holds them and
offers the three ways the domains talk to them: `fetch_one`/`fetch_all` for a one-statement
read, `write` for a one-statement write, `begin` for a transaction. `PerDialect` builds the
few statements whose SQL differs per dialect (the ON CONFLICT inserts) once for each.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

from sqlalchemy import Row, Table, event
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from sandgate.errors import StoreError
from sandgate.store.migrate import async_url
from sandgate.store.ops import store_op

T = TypeVar("T")

DIALECTS: Final = ("sqlite", "postgresql")


def dialect_insert(dialect: str, table: Table) -> sqlite_dialect.Insert | pg.Insert:
    """An INSERT that takes an ON CONFLICT clause, in `dialect`'s own construct."""
    return sqlite_dialect.insert(table) if dialect == "sqlite" else pg.insert(table)


class PerDialect(Generic[T]):
    """Statements built once per dialect by `build(dialect_name)`; `of(db)` picks one set."""

    def __init__(self, build: Callable[[str], T]) -> None:
        self._sqlite: Final = build("sqlite")
        self._postgresql: Final = build("postgresql")

    def of(self, db: Database) -> T:
        return self._sqlite if db.sqlite else self._postgresql


class Database:
    """One SQLAlchemy async engine (SQLite or PostgreSQL), shared by the store's domains."""

    def __init__(self, engine: AsyncEngine, counters: AsyncEngine | None = None) -> None:
        self.engine: Final = engine
        self.dialect: Final[str] = engine.dialect.name
        if self.dialect not in DIALECTS:
            raise ValueError(f"unsupported database dialect {self.dialect!r}")
        self.sqlite: Final = self.dialect == "sqlite"
        # One-statement reads and writes need no explicit transaction: a single statement
        # is atomic on its own. On PostgreSQL, AUTOCOMMIT saves the BEGIN and the
        # COMMIT/ROLLBACK round trips around it (asyncpg's adapter otherwise opens a
        # transaction before every first statement). pysqlite manages SQLite's implicit
        # transactions itself: it starts one before a write, never before a SELECT.
        self.auto: Final = (
            engine if self.sqlite else engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        # Rate-limit counters: on PostgreSQL their own small pool, in autocommit with
        # synchronous_commit=off (see open_engines); elsewhere the main engine.
        self._counter_engine = counters
        self.counters: Final = self.auto if counters is None else counters
        # statements sent to the database by this process (exported on /metrics)
        self.statements = 0
        # what each statement's time goes to (api/metrics.py sets a histogram's observe)
        self.observe_statement: Callable[[float], None] | None = None
        for each in (engine, counters):
            if each is not None:
                event.listen(each.sync_engine, "before_cursor_execute", self._count_statement)
                event.listen(each.sync_engine, "after_cursor_execute", self._time_statement)

    def _count_statement(self, conn: Any, *_args: Any) -> None:
        self.statements += 1
        conn.info["sandgate_sent"] = time.perf_counter()

    def _time_statement(self, conn: Any, *_args: Any) -> None:
        sent = conn.info.pop("sandgate_sent", None)
        if sent is not None and self.observe_statement is not None:
            self.observe_statement(time.perf_counter() - sent)

    def begin(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A transaction: committed when the block ends, rolled back if it raises."""
        return self.engine.begin()

    def connect(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for reads (autocommit on PostgreSQL)."""
        return self.auto.connect()

    def single(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for one statement: autocommit on PG, a short txn on SQLite."""
        return self.engine.begin() if self.sqlite else self.auto.connect()

    async def fetch_one(self, stmt: Any, params: Mapping[str, Any]) -> Row[Any] | None:
        async with self.auto.connect() as conn:
            result = await conn.execute(stmt, params)
            return result.first()

    async def fetch_all(self, stmt: Any, params: Mapping[str, Any]) -> list[Row[Any]]:
        async with self.auto.connect() as conn:
            result = await conn.execute(stmt, params)
            return list(result.all())

    async def write(self, stmt: Any, params: Mapping[str, Any]) -> int:
        async with self.single() as conn:
            result = await conn.execute(stmt, params)
            return result.rowcount

    @store_op
    async def aclose(self) -> None:
        if self._counter_engine is not None:
            await self._counter_engine.dispose()
        await self.engine.dispose()


# --------------------------------------------------------------------------- set-up


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _sqlite_on_connect(dbapi_connection: Any, _connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA busy_timeout=5000")
        # WAL is a property of the file and sticks once set (`migrate.upgrade` sets it).
        # Switching needs an exclusive lock that fails at once, without waiting, while
        # other connections are open, so only switch when the file is not in WAL yet.
        cursor.execute("PRAGMA journal_mode")
        row = cursor.fetchone()
        if row is None or str(row[0]).lower() != "wal":
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _skip_idle_sqlite_rollbacks(engine: AsyncEngine) -> None:
    """Save one aiosqlite thread round trip on every read.

    SQLAlchemy rolls back every connection it releases. After a plain SELECT, pysqlite
    has no transaction open (it only begins one before a write), so that ROLLBACK is a
    no-op that still costs a hop to the connection's thread. aiosqlite reports
    `in_transaction` without a hop; skip the call when there is nothing to roll back.
    """
    dialect = engine.sync_engine.dialect
    original = dialect.do_rollback

    def do_rollback(dbapi_connection: Any) -> None:
        driver = getattr(dbapi_connection, "driver_connection", None)
        if driver is not None and getattr(driver, "in_transaction", True) is False:
            return
        original(dbapi_connection)

    setattr(dialect, "do_rollback", do_rollback)  # noqa: B010 - per-engine override


def _existing_sqlite_file(database: str) -> Path | None:
    path = Path(os.path.expanduser(database))
    return path if path.is_file() else None


def open_engines(url: str) -> tuple[AsyncEngine, AsyncEngine | None]:
    """The engines for the database at `url` (opened, not migrated), for `Database`: the main
    one and, on PostgreSQL, the rate counters' own. See `migrate.async_url` for URL forms."""
    target = async_url(url)
    if target.get_backend_name() == "sqlite":
        db_file = _existing_sqlite_file(target.database or "")
        if db_file is None:
            # Never create an empty database by opening it: that is `migrate`'s job.
            raise StoreError(
                f"no SQLite database at {target.database!r}; run `sandgate migrate` first"
            )
        # aiosqlite: one thread per connection. WAL lets readers run beside the writer;
        # writers queue on busy_timeout. (In-memory SQLite is refused by async_url.)
        engine = create_async_engine(
            target,
            pool_size=5,
            max_overflow=10,
            pool_timeout=30,
            json_serializer=_dumps,
        )
        event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
        _skip_idle_sqlite_rollbacks(engine)
        return engine, None
    engine = create_async_engine(
        target,
        pool_size=10,
        max_overflow=10,
        pool_timeout=30,
        pool_recycle=1800,
        json_serializer=_dumps,
    )
    # Token buckets are written on every request of a rate-limited tenant. Their commits
    # need not wait for the WAL flush (about half a millisecond here): a PostgreSQL crash
    # can forget the last few hundred milliseconds of takes (a tenant gets that much
    # extra once), and never corrupts anything. Nothing else is written through it.
    counters = create_async_engine(
        target,
        pool_size=4,
        max_overflow=16,
        pool_timeout=30,
        pool_recycle=1800,
        connect_args={"server_settings": {"synchronous_commit": "off"}},
    ).execution_options(isolation_level="AUTOCOMMIT")
    return engine, counters
