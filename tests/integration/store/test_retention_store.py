"""Retention sweepers (sandgate.store.sql_retention), on SQLite and PostgreSQL alike, and the
recovery tick that runs them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import pytest
from sqlalchemy import func, select

from sandgate.control.create import CreatePipeline
from sandgate.control.recovery import Recovery
from sandgate.core.breaker import BreakerPolicy
from sandgate.store.base import (
    JobId,
    SandboxName,
    SandboxState,
    SchedulingTimeout,
    TenantId,
)
from sandgate.store.schema import admission_tickets, instances, scheduling_timeouts
from sandgate.store.sql import SqlStore
from tests.integration.store.test_store_contract import T0, idem, job, sandbox

pytestmark = pytest.mark.anyio

HOUR = timedelta(hours=1)


async def count(store: SqlStore, table: Any) -> int:
    async with store.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(table))).scalar_one())


async def ended(store: SqlStore, name: str, state: SandboxState, at: Any, key: str) -> None:
    """A sandbox with its create job and idempotency record, that ended `at`."""
    await store.insert_sandbox(sandbox(name, state="running"), job(name), idem("t1", key, name))
    await store.set_sandbox_state(
        SandboxName(name), state, from_states=("running",), error=None, now=at
    )


async def test_sweep_deletes_ended_sandboxes_with_their_jobs_and_keys(store: SqlStore) -> None:
    await store.insert_sandbox(
        sandbox("live", state="running"), job("live"), idem("t1", "k", "live")
    )
    await ended(store, "old-deleted", "deleted", T0, "k1")
    await ended(store, "old-stopped", "stopped", T0, "k2")
    await ended(store, "old-error", "error", T0 + timedelta(minutes=1), "k3")
    await ended(store, "new-deleted", "deleted", T0 + 2 * HOUR, "k4")

    assert await store.sweep_sandboxes(T0 + HOUR, 2) == 2  # at most `limit`, oldest first
    assert await store.sweep_sandboxes(T0 + HOUR, 100) == 1
    assert await store.sweep_sandboxes(T0 + HOUR, 100) == 0
    for name, key in (("old-deleted", "k1"), ("old-stopped", "k2"), ("old-error", "k3")):
        assert await store.get_sandbox(SandboxName(name)) is None
        assert await store.get_job(JobId(f"job-{name}")) is None
        assert await store.find_idempotency(TenantId("t1"), key) is None
    # live ones, and ended ones within the retention, keep everything
    for name, key in (("live", "k"), ("new-deleted", "k4")):
        assert await store.get_sandbox(SandboxName(name)) is not None
        assert await store.get_job(JobId(f"job-{name}")) is not None
        assert await store.find_idempotency(TenantId("t1"), key) is not None
    # the key is free again: the same key makes a new sandbox
    await store.insert_sandbox(sandbox("again"), job("again"), idem("t1", "k1", "again"))


async def test_sweep_deletes_stale_tunnel_owners(store: SqlStore) -> None:
    await store.claim_tunnel("w-old", "http://dead", T0)
    await store.claim_tunnel("w-new", "http://live", T0 + 2 * HOUR)
    assert await store.sweep_tunnel_owners(T0 + HOUR, 100) == 1
    assert await store.tunnel_owner("w-old") is None
    assert await store.tunnel_owner("w-new") == ("http://live", T0 + 2 * HOUR)
    assert await store.sweep_tunnel_owners(T0 + HOUR, 100) == 0


async def test_sweep_deletes_dead_instances(store: SqlStore) -> None:
    await store.heartbeat_instance("http://dead", T0)
    await store.heartbeat_instance("http://live", T0 + 2 * HOUR)
    assert await store.sweep_instances(T0 + HOUR, 100) == 1
    async with store.engine.connect() as conn:
        left = (await conn.execute(select(instances.c.node_url))).scalars().all()
    assert left == ["http://live"]
    assert await store.sweep_instances(T0 + HOUR, 100) == 0


async def test_sweep_deletes_expired_queue_tickets(store: SqlStore) -> None:
    t = TenantId("t1")
    soon = await store.enqueue_create(t, "http://a", T0, T0 + timedelta(minutes=1), 10)
    later = await store.enqueue_create(t, "http://a", T0, T0 + HOUR, 10)
    assert soon is not None and later is not None
    assert await store.sweep_admission_tickets(T0 + timedelta(minutes=10), 100) == 1
    assert await count(store, admission_tickets) == 1
    assert await store.queue_position(later, T0 + timedelta(minutes=10)) == 0
    assert await store.sweep_admission_tickets(T0 + timedelta(minutes=10), 100) == 0


async def test_sweep_keeps_the_newest_scheduling_timeouts(store: SqlStore) -> None:
    policy = BreakerPolicy(threshold=100, window=3600.0, open_for=60.0, trial_lease=40.0)
    for i in range(5):
        event = SchedulingTimeout(
            at=T0 + timedelta(seconds=i),
            sandbox_name=SandboxName(f"s{i}"),
            tenant_id=TenantId("t1"),
            node_url="http://a",
            reason="not ready",
        )
        await store.record_scheduling_timeout(event, policy)
    assert await store.sweep_scheduling_timeouts(5, 100) == 0  # at the cap: nothing to do
    assert await store.sweep_scheduling_timeouts(2, 100) == 3
    kept = await store.list_scheduling_timeouts(T0 - HOUR, 100)
    assert [t.sandbox_name for t in kept] == ["s4", "s3"]
    assert await count(store, scheduling_timeouts) == 2
    assert await store.sweep_scheduling_timeouts(2, 100) == 0


async def test_recovery_tick_runs_the_sweepers(store: SqlStore) -> None:
    """Rows long past their retention (T0 is in 2025) are gone after one tick."""
    await ended(store, "gone", "deleted", T0, "k1")
    await store.claim_tunnel("w-old", "http://dead", T0)
    await store.heartbeat_instance("http://dead", T0)
    await store.enqueue_create(TenantId("t1"), "http://dead", T0, T0 + HOUR, 10)
    recovery = Recovery(
        cast(CreatePipeline, object()),  # no pending create jobs: nothing is delivered
        store,
        node_url="http://me",
        after=45.0,
        interval=5.0,
    )
    assert await recovery.tick() == 0
    assert await store.get_sandbox(SandboxName("gone")) is None
    assert await store.find_idempotency(TenantId("t1"), "k1") is None
    assert await store.tunnel_owner("w-old") is None
    assert await count(store, admission_tickets) == 0
    async with store.engine.connect() as conn:
        left = (await conn.execute(select(instances.c.node_url))).scalars().all()
    assert left == ["http://me"]  # its own heartbeat, just renewed
