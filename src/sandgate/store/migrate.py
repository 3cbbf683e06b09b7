"""Schema migrations, run programmatically (no alembic.ini).

`sandgate migrate` calls `upgrade(url)` once before new instances start; servers call
`check_current(url)` to refuse to run on a database that is behind the code. Migrations
only add (DESIGN.md), so instances running the previous release keep working after an
upgrade.

URLs are accepted as users write them and mapped to the async drivers sandgate ships:

    sqlite:///relative/path.db, sqlite:////abs/path.db      -> sqlite+aiosqlite://...
    postgresql://..., postgres://..., postgresql+asyncpg://  -> postgresql+asyncpg://...
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import URL, Connection, Engine, event, make_url, pool, text
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import create_async_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# Held (transaction-scoped) while migrating PostgreSQL, so that two `sandgate migrate`
# runs started at once apply each revision exactly once. Arbitrary, fixed 63-bit key.
_PG_MIGRATION_LOCK = 0x5A6E_D6A7_E000_0001

_SQLITE_DRIVERS = frozenset({"sqlite", "sqlite+aiosqlite", "sqlite+pysqlite"})
_PG_DRIVERS = frozenset({"postgres", "postgresql", "postgres+asyncpg", "postgresql+asyncpg"})


def async_url(url: str | URL) -> URL:
    """Map a user-supplied database URL to the async driver sandgate uses.

    Raises ValueError for anything that is not SQLite or PostgreSQL, and for in-memory
    SQLite (every pooled connection would see a different, empty database).
    """
    try:
        parsed = make_url(url) if isinstance(url, str) else url
    except ArgumentError as exc:
        raise ValueError(f"not a database URL: {exc}") from None
    driver = parsed.drivername.lower()
    if driver in _SQLITE_DRIVERS:
        if parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory":
            raise ValueError("in-memory SQLite is not supported; give a file: sqlite:///path.db")
        return parsed.set(drivername="sqlite+aiosqlite")
    if driver in _PG_DRIVERS:
        parsed = parsed.set(drivername="postgresql+asyncpg")
        # libpq spells it sslmode; asyncpg takes the same modes as `ssl`.
        if "sslmode" in parsed.query and "ssl" not in parsed.query:
            mode = parsed.query["sslmode"]
            parsed = parsed.difference_update_query(["sslmode"]).update_query_dict({"ssl": mode})
        return parsed
    raise ValueError(
        f"unsupported database URL scheme {parsed.drivername!r}: "
        "use sqlite:///path.db or postgresql://user@host/db"
    )


def alembic_config() -> Config:
    """An Alembic Config built in code, pointing at the packaged migrations."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest revision the code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def known_revisions() -> frozenset[str]:
    """Every revision this code has a migration for."""
    script = ScriptDirectory.from_config(alembic_config())
    return frozenset(rev.revision for rev in script.walk_revisions())


def _upgrade_sync(connection: Connection, cfg: Config, revision: str) -> None:
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, revision)


def _current_sync(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def _sqlite_transactional_ddl(engine: Engine) -> None:
    """Make DDL transactional on SQLite (SQLAlchemy's documented pysqlite recipe).

    pysqlite's own transaction handling never puts DDL inside a transaction; take over
    and emit BEGIN ourselves, so CREATE TABLE ... and the alembic_version row commit
    or roll back together.
    """

    @event.listens_for(engine, "connect")
    def _no_implicit_transactions(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _sqlite_file(url: URL) -> Path | None:
    if url.get_backend_name() != "sqlite" or not url.database:
        return None
    return Path(os.path.expanduser(url.database))


async def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at `url` to the newest revision (or to `revision`, which tests of a
    migration's own work use). Safe to run repeatedly."""
    target = async_url(url)
    db_file = _sqlite_file(target)
    if db_file is not None:
        db_file.parent.mkdir(parents=True, exist_ok=True)
    cfg = alembic_config()
    engine = create_async_engine(target, poolclass=pool.NullPool)
    try:
        if db_file is not None:
            # WAL sticks to the file; set it here, while nothing else has the file open.
            async with engine.connect() as conn:
                await conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            _sqlite_transactional_ddl(engine.sync_engine)
        # One transaction for the whole upgrade: a failing migration leaves nothing
        # half-applied. PostgreSQL: an advisory lock makes concurrent runs queue up.
        # SQLite: BEGIN IMMEDIATE does the same.
        async with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                await conn.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK}
                )
            await conn.run_sync(_upgrade_sync, cfg, revision)
    finally:
        await engine.dispose()


async def check_current(url: str) -> tuple[str | None, str]:
    """(revision the database is at, or None if never migrated; revision the code wants)."""
    target = async_url(url)
    head = head_revision()
    db_file = _sqlite_file(target)
    if db_file is not None and not db_file.exists():
        return None, head  # do not create an empty file just by looking
    engine = create_async_engine(target, poolclass=pool.NullPool)
    try:
        async with engine.connect() as conn:
            current = await conn.run_sync(_current_sync)
    finally:
        await engine.dispose()
    return current, head


__all__ = (
    "MIGRATIONS_DIR",
    "alembic_config",
    "async_url",
    "check_current",
    "head_revision",
    "known_revisions",
    "upgrade",
)
