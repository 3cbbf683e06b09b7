"""Store fixtures: the same contract suite runs on SQLite and on PostgreSQL.

SQLite: one migrated file per session, copied for every test.
PostgreSQL (only with --pg-dsn): one migrated template database per session
(`sandgate_test_template`), cloned with CREATE DATABASE ... TEMPLATE for every test and
dropped after it. Admin statements go through asyncpg directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import asyncpg  # type: ignore[import-untyped]
import pytest
from sqlalchemy import make_url

from sandgate.store.migrate import upgrade
from sandgate.store.sql import SqlStore, open_store

TEMPLATE_DB = f"sandgate_test_template_{uuid.uuid4().hex[:8]}"  # one per session

T = TypeVar("T")


def run_in_fresh_loop(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion on its own loop in its own thread.

    Session fixtures are synchronous; a thread keeps their event loop apart from the one
    anyio's pytest plugin runs the tests on.
    """

    async def main() -> T:
        return await fn()

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, main()).result()


def _with_database(dsn: str, database: str) -> str:
    return (
        make_url(dsn)
        .set(drivername="postgresql", database=database)
        .render_as_string(hide_password=False)
    )


async def admin_execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(_with_database(dsn, make_url(dsn).database or "postgres"))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    run_in_fresh_loop(lambda: upgrade(f"sqlite:///{path}"))
    return path


@pytest.fixture(scope="session")
def pg_template(pg_dsn: str) -> Iterator[str]:
    """Admin DSN of a server holding a migrated `sandgate_test_template` database."""
    drop = f'DROP DATABASE IF EXISTS "{TEMPLATE_DB}" WITH (FORCE)'
    run_in_fresh_loop(lambda: admin_execute(pg_dsn, drop, f'CREATE DATABASE "{TEMPLATE_DB}"'))
    try:
        run_in_fresh_loop(lambda: upgrade(_with_database(pg_dsn, TEMPLATE_DB)))
        yield pg_dsn
    finally:
        run_in_fresh_loop(lambda: admin_execute(pg_dsn, drop))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of a freshly migrated, empty database of the parametrised backend."""
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        db = tmp_path / "store.db"
        shutil.copyfile(template, db)
        yield f"sqlite:///{db}"
        return
    admin_dsn: str = request.getfixturevalue("pg_template")
    name = f"sandgate_test_{uuid.uuid4().hex[:12]}"
    run_in_fresh_loop(
        lambda: admin_execute(admin_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE_DB}"')
    )
    try:
        yield _with_database(admin_dsn, name)
    finally:
        run_in_fresh_loop(
            lambda: admin_execute(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        )


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[SqlStore]:
    s = await open_store(store_url)
    try:
        yield s
    finally:
        await s.aclose()
