"""Alembic environment for the sandgate store.

Normally driven by `sandgate.store.migrate`, which opens an async engine and hands a
(sync-facing) connection in through `config.attributes["connection"]`. Run by the
`alembic` command instead, it reads `sqlalchemy.url` from the config, maps it to the
async driver and connects itself.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from sandgate.store.migrate import async_url
from sandgate.store.schema import metadata as target_metadata

config = context.config


def _configure_and_run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds tables when needed.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    url = config.get_main_option("sqlalchemy.url")
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async_migrations(url: str) -> None:
    engine = create_async_engine(async_url(url), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_configure_and_run)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no connection and no sqlalchemy.url given to the migrations")
    asyncio.run(_run_async_migrations(url))


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
