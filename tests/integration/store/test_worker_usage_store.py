"""A worker's usage row, kept by the database's triggers, on SQLite and PostgreSQL.

The reference each check compares with is computed here, from the sandboxes the store
lists, by `core.placement.usage`: what the create path summed before the row existed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import create_async_engine

from sandgate.core import placement
from sandgate.errors import CapacityConflictError
from sandgate.store.base import SandboxName, SandboxState, Worker, WorkerName, WorkerUsage
from sandgate.store.migrate import MIGRATIONS_DIR, async_url, upgrade
from sandgate.store.schema import sandboxes, worker_usage
from sandgate.store.sql import SqlStore, open_store
from sandgate.store.sql.rows import LIVE_STATES

from .conftest import _with_database, admin_execute, run_in_fresh_loop
from .test_store_contract import T0, job, sandbox

pytestmark = pytest.mark.anyio

WORKERS = [WorkerName(f"w{i}") for i in range(3)]
LIVE = LIVE_STATES


async def expected(store: SqlStore, worker: WorkerName) -> WorkerUsage:
    held = await store.list_worker_sandboxes(worker, LIVE)
    return WorkerUsage(len(held), placement.usage(sb.resources for sb in held))


async def assert_exact(store: SqlStore) -> None:
    for worker in WORKERS:
        want = await expected(store, worker)
        assert await store.worker_usage(worker) == want, worker
        assert await store.count_live_sandboxes(worker) == want.sandboxes


def granted(rng: random.Random) -> dict[str, Any]:
    """What a sandbox was granted, odd values included: a fractional one counts its integer
    part, one that is not a number or is missing counts 0 (as placement.usage counts)."""
    return rng.choice(
        [
            {"memory_mb": rng.randrange(16, 4096), "cpus": 1, "disk_mb": rng.randrange(1, 9000)},
            {"memory_mb": rng.randrange(16, 4096), "cpus": 0.5},
            {"memory_mb": 100.75, "disk_mb": 2048.5},
            {"memory_mb": "512", "disk_mb": None},
            {},
        ]
    )


async def test_usage_follows_every_change_to_a_sandbox(store: SqlStore) -> None:
    """Creates on a worker or on none, starts (on the worker placed or another), moves of
    a pending sandbox, every end state, and the retention sweep: after each, each worker's
    row is what its live sandboxes sum to."""
    rng = random.Random(17)
    for worker in WORKERS:
        await store.upsert_worker(Worker(worker, 64, {}, connected=True, last_seen_at=T0))
    made: list[SandboxName] = []
    for step in range(160):
        action = rng.choice(["create", "create", "start", "assign", "end", "end", "sweep"])
        name = rng.choice(made) if made else None
        now = T0 + timedelta(seconds=step)
        if action == "create" or name is None:
            sb = replace(
                sandbox(f"s{step}", worker=rng.choice([*WORKERS, None])),
                resources=granted(rng),
                state=rng.choice(["pending", "pending", "running"]),
            )
            await store.insert_sandbox(sb, job(sb.name), None)
            made.append(sb.name)
        elif action == "start":
            await store.mark_running(name, rng.choice(WORKERS), now, now + timedelta(hours=1))
        elif action == "assign":
            await store.assign_worker(name, rng.choice(WORKERS), now)
        elif action == "end":
            state: SandboxState = rng.choice(["stopped", "error", "deleted"])
            await store.set_sandbox_state(
                name, state, from_states=rng.choice([LIVE, ("running",), ("stopped",)]), now=now
            )
        else:
            await store.sweep_sandboxes(now, limit=5)
        await assert_exact(store)
    totals = [await store.worker_usage(w) for w in WORKERS]
    assert sum(u.sandboxes for u in totals) > 0  # the walk left some live to count


async def test_creates_and_ends_on_two_handles_leave_usage_exact(store_url: str) -> None:
    """Two handles (two instances) create on one worker with its budget checked and end
    sandboxes at the same time: the row stays exact, and the budget is never passed."""
    a, b = await open_store(store_url), await open_store(store_url)
    worker = WORKERS[0]
    budget = {"memory_mb": 3000, "disk_mb": 1_000_000}
    try:
        await a.upsert_worker(Worker(worker, 1000, {}, connected=True, last_seen_at=T0))

        async def churn(s: SqlStore, who: str) -> None:
            for i in range(25):
                sb = replace(
                    sandbox(f"{who}-{i}", worker=worker),
                    resources={"memory_mb": 200, "disk_mb": 10},
                )
                try:
                    await s.insert_sandbox(
                        sb, job(sb.name), None, worker_capacity=1000, worker_budget=budget
                    )
                except CapacityConflictError:
                    continue
                assert (await s.worker_usage(worker)).granted["memory_mb"] <= 3000
                if i % 2:
                    await s.set_sandbox_state(
                        sb.name, "deleted", from_states=LIVE, now=T0 + timedelta(seconds=i)
                    )

        await asyncio.gather(churn(a, "a"), churn(b, "b"), churn(a, "c"), churn(b, "d"))
        want = await expected(a, worker)
        assert await b.worker_usage(worker) == want
        assert 0 < want.granted["memory_mb"] <= 3000
    finally:
        await a.aclose()
        await b.aclose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database nothing has migrated yet."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    admin: str = request.getfixturevalue("pg_dsn")
    name = f"sandgate_test_{uuid.uuid4().hex[:12]}"
    run_in_fresh_loop(lambda: admin_execute(admin, f'CREATE DATABASE "{name}"'))
    try:
        yield _with_database(admin, name)
    finally:
        run_in_fresh_loop(lambda: admin_execute(admin, f'DROP DATABASE "{name}" WITH (FORCE)'))


async def test_the_migration_counts_the_sandboxes_already_there(empty_url: str) -> None:
    """Sandboxes written by the release before the table (revision 0006) are in each
    worker's row once 0007 has run, and the triggers go on from there."""
    await upgrade(empty_url, "0006")
    rng = random.Random(7)
    rows = []
    for i in range(40):
        sb = replace(
            sandbox(f"old-{i}", worker=rng.choice([*WORKERS, None])),
            resources=granted(rng),
            state=rng.choice(["pending", "running", "stopped", "deleted"]),
        )
        rows.append(
            {
                **{c: getattr(sb, c) for c in ("name", "tenant_id", "state", "template")},
                **{c: getattr(sb, c) for c in ("timeout", "metadata", "env", "network")},
                "resources": sb.resources,
                "worker": sb.worker,
                "created_at": T0,
                "updated_at": T0,
            }
        )
    engine = create_async_engine(async_url(empty_url))
    try:
        async with engine.begin() as conn:
            await conn.execute(insert(sandboxes), rows)
    finally:
        await engine.dispose()
    await upgrade(empty_url)
    store = await open_store(empty_url)
    try:
        await assert_exact(store)
        assert sum([(await store.worker_usage(w)).sandboxes for w in WORKERS]) > 0
        await store.set_sandbox_state(
            SandboxName("old-0"), "deleted", from_states=LIVE, now=T0 + timedelta(seconds=1)
        )
        await assert_exact(store)
    finally:
        await store.aclose()


def test_the_triggers_count_what_the_code_counts() -> None:
    """The triggers were written for the live states and budgeted resources of revision
    0007. When the code's change, this fails: a migration must re-create the triggers (and
    re-count the rows) for the new ones."""
    spec = importlib.util.spec_from_file_location(
        "m0007", MIGRATIONS_DIR / "versions" / "0007_worker_usage.py"
    )
    assert spec is not None and spec.loader is not None
    migration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migration)
    assert migration.LIVE == "(" + ", ".join(f"'{s}'" for s in LIVE_STATES) + ")"
    assert migration.BUDGETED == placement.BUDGETED
    assert tuple(c.name for c in worker_usage.c) == ("worker", "live", *placement.BUDGETED)
