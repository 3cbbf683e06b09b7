"""What the `sandgate` commands share: the --db and --log-level options, the event loop
runner, and preparing a database before use."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import typer

DbOpt = Annotated[
    str, typer.Option("--db", envvar="SANDGATE_DB", help="sqlite:///path or postgresql://...")
]
LogOpt = Annotated[str, typer.Option("--log-level", envvar="SANDGATE_LOG_LEVEL")]


def _runner() -> asyncio.Runner:
    import uvloop

    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def _worker_runner() -> asyncio.Runner:
    """The worker's loop: asyncio's own, not uvloop. uvloop spawns through libuv, which forks:
    the kernel copies the worker's page tables for every sandbox start and helper process, a
    cost that grows with the worker's memory, so with the sandboxes it holds (57 ms a spawn
    at 1 GiB resident, against 1 ms for CPython's vfork; docs/benchmarks.md). Children are
    reaped through pidfds (Python 3.12's default), not a thread each."""
    if sys.version_info < (3, 12):
        asyncio.set_child_watcher(asyncio.PidfdChildWatcher())
    return asyncio.Runner()


async def _prepare_db(db: str) -> None:
    """SQLite belongs to one instance, which migrates it; PostgreSQL must be migrated first."""
    from sandgate.store import migrate

    if migrate.async_url(db).drivername.startswith("sqlite"):
        await migrate.upgrade(db)
        return
    current, head = await migrate.check_current(db)
    if current is not None and current not in migrate.known_revisions():
        raise typer.BadParameter(
            f"database schema is at {current}, newer than this sandgate knows (it needs "
            f"{head}): run the sandgate release that migrated it",
            param_hint="--db",
        )
    if current != head:
        raise typer.BadParameter(
            f"database schema is at {current or 'nothing'}, this sandgate needs {head}: "
            f"run `sandgate migrate --db {db}` first",
            param_hint="--db",
        )
