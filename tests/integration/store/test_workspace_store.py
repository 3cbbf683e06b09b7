"""Workspaces in the store, and their lock, on SQLite and PostgreSQL.

The lock's contract: one holder at a time per workspace across store handles (two engines,
as two instances have), a fence that grows with each holder, and on PostgreSQL a holder whose
connection dies loses the lock at once and says so on its next check."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg  # type: ignore[import-untyped]
import pytest

from sandgate.core.workspaces import lock_key, new_workspace_id
from sandgate.errors import ConflictError
from sandgate.store.base import WorkspaceRecord
from sandgate.store.sql import SqlStore, open_store
from sandgate.store.workspace_lock import WorkspaceLocks

pytestmark = pytest.mark.anyio

NOW = datetime(2026, 12, 2, tzinfo=UTC)


def record(tenant: str, name: str) -> WorkspaceRecord:
    return WorkspaceRecord(
        id=new_workspace_id(),
        tenant_id=tenant,
        name=name,
        quota_mb=64,
        state="creating",
        worker="w1",
        fence=0,
        head=None,
        created_at=NOW,
        updated_at=NOW,
    )


async def test_rows_are_per_tenant(store: SqlStore) -> None:
    a = record("alpha", "proj")
    assert await store.insert_workspace(a)
    assert not await store.insert_workspace(record("alpha", "proj"))  # the name is taken
    assert await store.insert_workspace(record("beta", "proj"))  # another tenant's is fine
    assert (await store.get_workspace("alpha", "proj")) == a
    assert await store.get_workspace("beta", "nope") is None
    assert [w.name for w in await store.list_workspaces("alpha")] == ["proj"]
    assert await store.set_workspace_state(a.id, "ready", from_states=("creating",), now=NOW)
    assert not await store.set_workspace_state(a.id, "ready", from_states=("creating",), now=NOW)
    # moving it is a compare-and-swap on the worker it was on
    assert await store.move_workspace(a.id, "w2", expected="w1", now=NOW)
    assert not await store.move_workspace(a.id, "w3", expected="w1", now=NOW)
    await store.set_workspace_head(a.id, "ab" * 20, NOW)
    got = await store.get_workspace_by_id(a.id)
    assert got is not None and got.worker == "w2" and got.head == "ab" * 20
    assert [await store.next_workspace_fence(a.id) for _ in range(3)] == [1, 2, 3]
    assert await store.next_workspace_fence("ws-" + "0" * 20) is None
    assert await store.delete_workspace(a.id)
    assert await store.get_workspace("alpha", "proj") is None


async def test_one_holder_at_a_time_across_two_handles(store_url: str) -> None:
    one, two = await open_store(store_url), await open_store(store_url)
    try:
        ws = record("alpha", "locked")
        await one.insert_workspace(ws)
        # SQLite serves one instance: its lock is in-process, so both "instances" share one
        locks_one = WorkspaceLocks(store_url, one.next_workspace_fence)
        locks_two = (
            locks_one
            if one.dialect == "sqlite"
            else WorkspaceLocks(store_url, two.next_workspace_fence)
        )
        inside = 0
        most = 0
        fences: list[int] = []

        async def hold(locks: WorkspaceLocks) -> None:
            nonlocal inside, most
            async with locks.hold(ws.id) as lease:
                inside += 1
                most = max(most, inside)
                await lease.check()
                fences.append(lease.fence)
                await asyncio.sleep(0.01)
                inside -= 1

        await asyncio.gather(*(hold(locks_one if i % 2 else locks_two) for i in range(20)))
        assert most == 1
        assert sorted(fences) == list(range(1, 21)) and fences == sorted(fences)
    finally:
        await one.aclose()
        await two.aclose()


async def test_a_holder_whose_connection_dies_loses_the_lock(store_url: str) -> None:
    if not store_url.startswith("postgresql"):
        pytest.skip("the advisory lock is PostgreSQL's")
    store = await open_store(store_url)
    try:
        ws = record("alpha", "dropped")
        await store.insert_workspace(ws)
        locks = WorkspaceLocks(store_url, store.next_workspace_fence)
        admin = await asyncpg.connect(store_url)
        try:
            async with locks.hold(ws.id) as first:
                # the holder's session is killed (its instance died, its connection dropped)
                key = lock_key(ws.id) & 0xFFFFFFFFFFFFFFFF  # the lock's two 32-bit halves
                killed = await admin.fetchval(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks "
                    "WHERE locktype = 'advisory' AND granted "
                    "AND classid::bigint = $1 AND objid::bigint = $2",
                    key >> 32,
                    key & 0xFFFFFFFF,
                )
                assert killed is True
                # another holder gets it at once, with a higher fence
                second = await asyncio.wait_for(_hold_once(locks, ws.id), 10)
                assert second > first.fence
                with pytest.raises(ConflictError) as lost:
                    await first.check()
                assert lost.value.code == "workspace_lock_lost"
        finally:
            await admin.close()
    finally:
        await store.aclose()


async def _hold_once(locks: WorkspaceLocks, ws_id: str) -> int:
    async with locks.hold(ws_id) as lease:
        return lease.fence
