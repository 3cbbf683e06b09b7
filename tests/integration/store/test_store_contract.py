"""The Store contract, run against SQLite and PostgreSQL alike."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, true

from sandgate.core.breaker import BreakerPolicy
from sandgate.errors import IdempotencyConflictError, StoreError
from sandgate.store.base import (
    ORPHANED_EXEC_JOB,
    ApiKey,
    ExecJob,
    ExecJobId,
    ExecResult,
    IdempotencyRecord,
    Job,
    JobId,
    Sandbox,
    SandboxFilter,
    SandboxName,
    SandboxState,
    SchedulingTimeout,
    Store,
    TenantId,
    Worker,
    WorkerName,
)
from sandgate.store.migrate import check_current, head_revision, upgrade
from sandgate.store.schema import instances, sandboxes
from sandgate.store.sql import SqlStore, open_store

pytestmark = pytest.mark.anyio

T0 = datetime(2025, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)


def sandbox(
    name: str,
    tenant: str = "t1",
    *,
    state: SandboxState = "pending",
    metadata: dict[str, str] | None = None,
    worker: str | None = None,
    expires_at: datetime | None = None,
    at: datetime = T0,
) -> Sandbox:
    return Sandbox(
        name=SandboxName(name),
        tenant_id=TenantId(tenant),
        state=state,
        template="base",
        timeout=300.0,
        metadata=metadata if metadata is not None else {},
        env={"A": "1"},
        network=False,
        resources={"memory_mb": 512, "cpus": 1.5, "pids": 128},
        created_at=at,
        updated_at=at,
        worker=None if worker is None else WorkerName(worker),
        expires_at=expires_at,
    )


def job(name: str, job_id: str | None = None) -> Job:
    return Job(
        id=JobId(job_id or f"job-{name}"),
        kind="create",
        sandbox_name=SandboxName(name),
        state="pending",
        request={"op": "create", "name": name, "nested": {"list": [1, 2, 3]}},
        attempt=0,
        created_at=T0,
        updated_at=T0,
    )


def idem(tenant: str, digest: str, name: str, fingerprint: str = "f" * 64) -> IdempotencyRecord:
    return IdempotencyRecord(
        tenant_id=TenantId(tenant),
        digest=digest,
        fingerprint=fingerprint,
        sandbox_name=SandboxName(name),
        created_at=T0,
    )


async def create(store: SqlStore, sb: Sandbox, digest: str | None = None) -> None:
    record = None if digest is None else idem(sb.tenant_id, digest, sb.name)
    await store.insert_sandbox(sb, job(sb.name), record)


def names(items: list[Sandbox]) -> list[str]:
    return [s.name for s in items]


def assert_utc(value: datetime | None) -> None:
    assert value is not None
    assert value.tzinfo is not None
    assert value.utcoffset() == timedelta(0)


async def test_sql_store_satisfies_protocol(store: SqlStore) -> None:
    as_protocol: Store = store  # checked by mypy; at runtime just make sure it is open
    assert await as_protocol.get_sandbox(SandboxName("nothing")) is None


async def test_database_is_at_head(store_url: str) -> None:
    assert await check_current(store_url) == (head_revision(), head_revision())
    await upgrade(store_url)  # idempotent
    assert await check_current(store_url) == (head_revision(), head_revision())


# ------------------------------------------------------------------ tenants and keys


async def test_tenants_and_keys_round_trip(store: SqlStore) -> None:
    acme = await store.ensure_tenant("acme")
    assert await store.ensure_tenant("acme") == acme
    other = await store.ensure_tenant("other")
    assert other.id != acme.id
    assert await store.get_tenant(acme.id) == acme
    assert await store.get_tenant(TenantId("missing")) is None
    assert_utc(acme.created_at)

    tenant_key = ApiKey(
        key_hash="a" * 64, kind="tenant", tenant_id=acme.id, created_at=T0, label="ci"
    )
    worker_key = ApiKey(key_hash="b" * 64, kind="worker", tenant_id=None, created_at=T0)
    await store.add_api_key(tenant_key)
    await store.add_api_key(worker_key)
    assert await store.find_api_key("a" * 64) == tenant_key
    assert await store.find_api_key("b" * 64) == worker_key
    assert await store.find_api_key("c" * 64) is None

    with pytest.raises(StoreError):
        await store.add_api_key(tenant_key)  # same hash twice
    with pytest.raises(StoreError):
        await store.add_api_key(replace(tenant_key, key_hash="d" * 64, tenant_id=TenantId("x")))
    assert await store.find_api_key("d" * 64) is None


async def test_concurrent_ensure_tenant_yields_one_tenant(store_url: str) -> None:
    a, b = await open_store(store_url), await open_store(store_url)
    try:
        got = await asyncio.gather(*(s.ensure_tenant("race") for s in (a, b) * 5))
    finally:
        await a.aclose()
        await b.aclose()
    assert len({t.id for t in got}) == 1


# ------------------------------------------------------------ create and idempotency


async def test_insert_sandbox_writes_sandbox_job_and_idempotency(store: SqlStore) -> None:
    sb = sandbox("sb-1", metadata={"idem": "d1", "idem_owner": "t1"})
    await create(store, sb, digest="d1")

    assert await store.get_sandbox(sb.name) == sb
    assert await store.get_tenant_sandbox(TenantId("t1"), sb.name) == sb
    assert await store.get_job(JobId("job-sb-1")) == job("sb-1")
    assert await store.find_idempotency(TenantId("t1"), "d1") == idem("t1", "d1", "sb-1")
    assert await store.find_idempotency(TenantId("t1"), "d2") is None
    assert await store.find_idempotency(TenantId("t2"), "d1") is None


async def test_insert_without_idempotency(store: SqlStore) -> None:
    await create(store, sandbox("sb-plain"))
    assert await store.get_sandbox(SandboxName("sb-plain")) is not None
    assert await store.get_job(JobId("job-sb-plain")) is not None


async def test_duplicate_digest_conflicts_and_writes_nothing(store: SqlStore) -> None:
    await create(store, sandbox("first"), digest="same")
    with pytest.raises(IdempotencyConflictError):
        await create(store, sandbox("second"), digest="same")
    assert await store.get_sandbox(SandboxName("second")) is None
    assert await store.get_job(JobId("job-second")) is None
    assert (await store.find_idempotency(TenantId("t1"), "same")) == idem("t1", "same", "first")


async def test_same_digest_under_another_tenant_is_fine(store: SqlStore) -> None:
    await create(store, sandbox("mine", "t1"), digest="shared")
    await create(store, sandbox("theirs", "t2"), digest="shared")
    first = await store.find_idempotency(TenantId("t1"), "shared")
    second = await store.find_idempotency(TenantId("t2"), "shared")
    assert first is not None and first.sandbox_name == "mine"
    assert second is not None and second.sandbox_name == "theirs"


async def test_failed_insert_rolls_back_everything(store: SqlStore) -> None:
    await create(store, sandbox("taken"))
    # Same sandbox name again under a fresh digest: the sandbox insert fails after the
    # idempotency row was written in the same transaction; neither may remain.
    with pytest.raises(StoreError) as info:
        await store.insert_sandbox(
            sandbox("taken"), job("taken", "job-2"), idem("t1", "fresh", "taken")
        )
    assert not isinstance(info.value, IdempotencyConflictError)
    assert await store.find_idempotency(TenantId("t1"), "fresh") is None
    assert await store.get_job(JobId("job-2")) is None


async def test_mismatched_records_are_refused(store: SqlStore) -> None:
    with pytest.raises(StoreError):
        await store.insert_sandbox(sandbox("a"), job("b"), None)
    with pytest.raises(StoreError):
        await store.insert_sandbox(sandbox("a", "t1"), job("a"), idem("t2", "d", "a"))
    assert await store.get_sandbox(SandboxName("a")) is None


async def test_fifty_concurrent_creates_with_one_digest_have_one_winner(store_url: str) -> None:
    # Two store instances on one database, as two API instances would be.
    stores = [await open_store(store_url), await open_store(store_url)]
    try:

        async def attempt(i: int) -> str:
            s = stores[i % 2]
            try:
                await create(s, sandbox(f"race-{i:02d}"), digest="one-key")
            except IdempotencyConflictError:
                return "conflict"
            return "created"

        outcomes = await asyncio.gather(*(attempt(i) for i in range(50)))
        assert outcomes.count("created") == 1
        assert outcomes.count("conflict") == 49

        record = await stores[0].find_idempotency(TenantId("t1"), "one-key")
        assert record is not None
        winner = record.sandbox_name
        assert outcomes[int(winner.removeprefix("race-"))] == "created"
        listed = await stores[1].list_sandboxes(TenantId("t1"), SandboxFilter(limit=100))
        assert names(listed) == [winner]
        for i in range(50):
            name = f"race-{i:02d}"
            has_job = await stores[0].get_job(JobId(f"job-{name}")) is not None
            assert has_job == (name == winner)
    finally:
        for s in stores:
            await s.aclose()


# ------------------------------------------------------------------------- reads


async def test_get_tenant_sandbox_is_tenant_scoped(store: SqlStore) -> None:
    await create(store, sandbox("owned", "t1"))
    assert await store.get_tenant_sandbox(TenantId("t1"), SandboxName("owned")) is not None
    assert await store.get_tenant_sandbox(TenantId("t2"), SandboxName("owned")) is None
    assert await store.get_tenant_sandbox(TenantId("t1"), SandboxName("nope")) is None


async def test_list_by_state_excludes_deleted_by_default(store: SqlStore) -> None:
    states: list[SandboxState] = ["pending", "running", "stopped", "error", "deleted"]
    for st in states:
        await create(store, sandbox(f"s-{st}", state=st))
    t1 = TenantId("t1")
    assert names(await store.list_sandboxes(t1, SandboxFilter())) == [
        "s-error",
        "s-pending",
        "s-running",
        "s-stopped",
    ]
    only_running = await store.list_sandboxes(t1, SandboxFilter(states=("running",)))
    assert names(only_running) == ["s-running"]
    deleted = await store.list_sandboxes(t1, SandboxFilter(states=("deleted", "error")))
    assert names(deleted) == ["s-deleted", "s-error"]
    assert await store.list_sandboxes(t1, SandboxFilter(limit=0)) == []


async def test_list_is_tenant_isolated(store: SqlStore) -> None:
    await create(store, sandbox("a-1", "t1", metadata={"k": "v"}))
    await create(store, sandbox("a-2", "t2", metadata={"k": "v"}))
    await create(store, sandbox("a-3", "t2", metadata={"k": "v"}))
    assert names(await store.list_sandboxes(TenantId("t1"), SandboxFilter())) == ["a-1"]
    got = await store.list_sandboxes(TenantId("t2"), SandboxFilter(metadata={"k": "v"}))
    assert names(got) == ["a-2", "a-3"]
    assert await store.list_sandboxes(TenantId("t3"), SandboxFilter()) == []


ODD_KEYS = [
    "plain",
    "with space",
    "dotted.key",
    "a.b.c",
    'double"quote',
    "single'quote",
    "back\\slash",
    "brackets[0]",
    "$.dollar",
    "*",
    "",
    "ünïcödé ключ",
    "emoji 🚀",
    "semi;colon -- comment",
]


@pytest.mark.parametrize("key", ODD_KEYS)
async def test_list_metadata_filter_handles_odd_keys(store: SqlStore, key: str) -> None:
    value = f"value of {key}!"
    await create(store, sandbox("hit", metadata={key: value, "other": "x"}))
    await create(store, sandbox("miss-value", metadata={key: value + " no", "other": "x"}))
    await create(store, sandbox("miss-key", metadata={"other": "x"}))
    await create(store, sandbox("other-tenant", "t2", metadata={key: value}))
    got = await store.list_sandboxes(TenantId("t1"), SandboxFilter(metadata={key: value}))
    assert names(got) == ["hit"]


async def test_metadata_filter_is_exact_in_sql(store: SqlStore) -> None:
    # White-box: the SQL condition alone must already select exactly the right rows for
    # every odd key, so the Python re-check is a safety net, not the filter.
    for i, key in enumerate(ODD_KEYS):
        await create(store, sandbox(f"hit-{i:02d}", metadata={key: "v"}))
        await create(store, sandbox(f"miss-{i:02d}", metadata={key: "v2", "v": key}))
    async with store.engine.connect() as conn:
        for i, key in enumerate(ODD_KEYS):
            stmt = select(sandboxes.c.name).where(store._metadata_condition(key, "v"))
            assert (await conn.execute(stmt)).scalars().all() == [f"hit-{i:02d}"], key


async def test_python_recheck_drops_rows_sql_let_through(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simulate a metadata condition the database did not apply: listing must still be
    # exact, and a page that lost rows to the re-check keeps scanning to fill up.
    monkeypatch.setattr(store, "_metadata_condition", lambda key, value: true())
    for i in range(9):
        await create(store, sandbox(f"r-{i}", metadata={"keep": "yes" if i % 3 == 0 else "no"}))
    where = SandboxFilter(metadata={"keep": "yes"}, limit=2)
    first = await store.list_sandboxes(TenantId("t1"), where)
    assert names(first) == ["r-0", "r-3"]
    rest = await store.list_sandboxes(TenantId("t1"), replace(where, after=first[-1].name))
    assert names(rest) == ["r-6"]


async def test_list_metadata_filters_all_must_match(store: SqlStore) -> None:
    await create(store, sandbox("both", metadata={"idem": "d", "idem_owner": "t1"}))
    await create(store, sandbox("one", metadata={"idem": "d", "idem_owner": "t9"}))
    await create(store, sandbox("none", metadata={}))
    where = SandboxFilter(metadata={"idem": "d", "idem_owner": "t1"})
    assert names(await store.list_sandboxes(TenantId("t1"), where)) == ["both"]
    where = SandboxFilter(metadata={"idem": "d"})
    assert names(await store.list_sandboxes(TenantId("t1"), where)) == ["both", "one"]
    # values are compared as strings, exactly
    where = SandboxFilter(metadata={"idem": "D"})
    assert await store.list_sandboxes(TenantId("t1"), where) == []


async def test_list_cursor_paging(store: SqlStore) -> None:
    for i in range(7):
        await create(store, sandbox(f"p-{i}", metadata={"page": "yes"}))
    await create(store, sandbox("p-deleted", state="deleted", metadata={"page": "yes"}))
    await create(store, sandbox("p-other", "t2", metadata={"page": "yes"}))
    seen: list[str] = []
    after: SandboxName | None = None
    pages = 0
    while True:
        where = SandboxFilter(metadata={"page": "yes"}, after=after, limit=3)
        page = await store.list_sandboxes(TenantId("t1"), where)
        if not page:
            break
        pages += 1
        seen.extend(names(page))
        after = page[-1].name
    assert seen == [f"p-{i}" for i in range(7)]
    assert pages == 3


async def test_list_worker_sandboxes_and_count_live(store: SqlStore) -> None:
    w1, w2 = WorkerName("w1"), WorkerName("w2")
    for st in ("pending", "running", "stopped", "deleted"):
        await create(store, sandbox(f"w1-{st}", state=st, worker="w1"))
    await create(store, sandbox("w2-running", state="running", worker="w2"))
    await create(store, sandbox("unassigned"))
    got = await store.list_worker_sandboxes(w1, ("running", "stopped"))
    assert names(got) == ["w1-running", "w1-stopped"]
    assert names(await store.list_worker_sandboxes(w1, ())) == [
        "w1-pending",
        "w1-running",
        "w1-stopped",
    ]
    assert await store.count_live_sandboxes(w1) == 2
    assert await store.count_live_sandboxes(w2) == 1
    assert await store.count_live_sandboxes(WorkerName("w3")) == 0


async def test_tenant_scoped_counts_leave_other_tenants_out(store: SqlStore) -> None:
    """What GET /api/v1/workers and /api/v1/admission show a tenant: its own only."""
    rows: tuple[tuple[str, str, SandboxState, str | None], ...] = (
        ("a-run", "ta", "running", "w1"),
        ("b-run", "tb", "running", "w1"),
        ("b-pend", "tb", "pending", "w2"),
        ("b-stop", "tb", "stopped", "w1"),
        ("b-none", "tb", "pending", None),
    )
    for name, tenant, state, worker in rows:
        await create(store, sandbox(name, tenant, state=state, worker=worker))
    w1, w2 = WorkerName("w1"), WorkerName("w2")
    assert await store.live_sandboxes_per_worker() == {w1: 2, w2: 1}
    assert await store.live_sandboxes_per_worker(TenantId("ta")) == {w1: 1}
    assert await store.live_sandboxes_per_worker(TenantId("tb")) == {w1: 1, w2: 1}
    assert await store.live_sandboxes_per_worker(TenantId("tc")) == {}

    later, gone = T0 + timedelta(seconds=30), T0 - timedelta(seconds=1)
    for tenant, expires in (("tb", later), ("tb", later), ("tb", gone), ("ta", later)):
        assert await store.enqueue_create(TenantId(tenant), "http://x", gone, expires, 10)
    assert await store.count_tenant_queued(TenantId("tb"), T0) == 2  # the lapsed one is out
    assert await store.count_tenant_queued(TenantId("ta"), T0) == 1
    assert await store.count_tenant_queued(TenantId("tc"), T0) == 0

    policy = BreakerPolicy(threshold=99, window=600.0, open_for=60.0, trial_lease=40.0)
    for i, tenant in enumerate(("tb", "ta", "tb")):
        event = SchedulingTimeout(
            at=T0 + timedelta(seconds=i),
            sandbox_name=SandboxName(f"{tenant}-{i}"),
            tenant_id=TenantId(tenant),
            node_url="http://x",
            reason="slow",
        )
        await store.record_scheduling_timeout(event, policy)
    since = T0 - timedelta(seconds=60)
    own = await store.list_tenant_scheduling_timeouts(TenantId("tb"), since, 10)
    assert [t.sandbox_name for t in own] == ["tb-2", "tb-0"]  # newest first
    assert [
        t.sandbox_name
        for t in await store.list_tenant_scheduling_timeouts(TenantId("tb"), since, 1)
    ] == ["tb-2"]
    assert await store.list_tenant_scheduling_timeouts(TenantId("tc"), since, 10) == []


async def test_list_expired(store: SqlStore) -> None:
    now = T0 + timedelta(hours=1)
    await create(store, sandbox("gone-early", state="running", expires_at=now - timedelta(1)))
    await create(store, sandbox("gone-now", state="running", expires_at=now))
    await create(store, sandbox("later", state="running", expires_at=now + timedelta(seconds=1)))
    await create(store, sandbox("stopped", state="stopped", expires_at=now - timedelta(1)))
    await create(store, sandbox("no-ttl", state="running"))
    assert names(await store.list_expired(now, 10)) == ["gone-early", "gone-now"]
    assert names(await store.list_expired(now, 1)) == ["gone-early"]
    assert await store.list_expired(now, 0) == []
    # the same instant written in another zone compares equal
    other_zone = now.astimezone(timezone(timedelta(hours=-7)))
    assert names(await store.list_expired(other_zone, 10)) == ["gone-early", "gone-now"]


# ----------------------------------------------------------------- state moves


async def test_mark_running_only_from_pending(store: SqlStore) -> None:
    await create(store, sandbox("sb"))
    name, w = SandboxName("sb"), WorkerName("w1")
    started, expires = T0 + timedelta(seconds=5), T0 + timedelta(seconds=305)
    assert await store.mark_running(name, w, started, expires) is True
    got = await store.get_sandbox(name)
    assert got is not None
    assert (got.state, got.worker, got.started_at, got.expires_at) == (
        "running",
        "w1",
        started,
        expires,
    )
    assert got.updated_at == started
    assert await store.mark_running(name, w, started, expires) is False  # already running
    assert await store.mark_running(SandboxName("missing"), w, started, expires) is False


async def test_deleted_sandbox_cannot_be_marked_running(store: SqlStore) -> None:
    await create(store, sandbox("sb"))
    name = SandboxName("sb")
    now = T0 + timedelta(seconds=1)
    assert await store.set_sandbox_state(name, "deleted", from_states=("pending",), now=now)
    late = T0 + timedelta(seconds=9)
    assert await store.mark_running(name, WorkerName("w1"), late, late) is False
    got = await store.get_sandbox(name)
    assert got is not None and got.state == "deleted" and got.worker is None


async def test_set_sandbox_state_respects_from_states(store: SqlStore) -> None:
    await create(store, sandbox("sb", state="running"))
    name = SandboxName("sb")
    t1, t2, t3 = (T0 + timedelta(minutes=i) for i in (1, 2, 3))
    assert not await store.set_sandbox_state(name, "stopped", from_states=("pending",), now=t1)
    assert not await store.set_sandbox_state(name, "stopped", from_states=(), now=t1)
    got = await store.get_sandbox(name)
    assert got is not None and got.state == "running" and got.updated_at == T0

    assert await store.set_sandbox_state(
        name, "error", from_states=("pending", "running"), error="boom", now=t2
    )
    got = await store.get_sandbox(name)
    assert got is not None
    assert (got.state, got.error, got.updated_at) == ("error", "boom", t2)

    # without an error argument the recorded error is kept
    assert await store.set_sandbox_state(name, "deleted", from_states=("error",), now=t3)
    got = await store.get_sandbox(name)
    assert got is not None and (got.state, got.error) == ("deleted", "boom")
    assert not await store.set_sandbox_state(
        SandboxName("missing"), "deleted", from_states=("running",), now=t3
    )


async def test_set_expiry_only_while_running(store: SqlStore) -> None:
    await create(store, sandbox("run", state="running", expires_at=T0))
    await create(store, sandbox("stop", state="stopped", expires_at=T0))
    later, now = T0 + timedelta(hours=2), T0 + timedelta(minutes=1)
    assert await store.set_expiry(SandboxName("run"), later, now) is True
    assert await store.set_expiry(SandboxName("stop"), later, now) is False
    run = await store.get_sandbox(SandboxName("run"))
    stop = await store.get_sandbox(SandboxName("stop"))
    assert run is not None and run.expires_at == later and run.updated_at == now
    assert stop is not None and stop.expires_at == T0


async def test_assign_worker_only_while_pending(store: SqlStore) -> None:
    await create(store, sandbox("pend"))
    await create(store, sandbox("run", state="running", worker="w1"))
    now = T0 + timedelta(seconds=3)
    await store.assign_worker(SandboxName("pend"), WorkerName("w2"), now)
    await store.assign_worker(SandboxName("run"), WorkerName("w2"), now)
    pend = await store.get_sandbox(SandboxName("pend"))
    run = await store.get_sandbox(SandboxName("run"))
    assert pend is not None and pend.worker == "w2" and pend.updated_at == now
    assert run is not None and run.worker == "w1"


# ------------------------------------------------------------------------- jobs


async def test_finish_job_only_from_pending(store: SqlStore) -> None:
    await create(store, sandbox("sb"))
    job_id = JobId("job-sb")
    now = T0 + timedelta(seconds=2)
    assert await store.finish_job(job_id, "completed", now=now) is True
    assert await store.finish_job(job_id, "failed", error="late", now=now) is False
    got = await store.get_job(job_id)
    assert got is not None
    assert (got.state, got.error, got.updated_at) == ("completed", None, now)
    assert await store.finish_job(JobId("missing"), "completed", now=now) is False
    assert await store.get_job(JobId("missing")) is None


async def test_fail_sandbox_jobs_marks_pending_jobs_failed(store: SqlStore) -> None:
    await create(store, sandbox("sb"))
    await create(store, sandbox("other"))
    now = T0 + timedelta(seconds=4)
    assert await store.fail_sandbox_jobs(SandboxName("sb"), "sandbox deleted", now) == 1
    assert await store.fail_sandbox_jobs(SandboxName("sb"), "again", now) == 0
    failed = await store.get_job(JobId("job-sb"))
    untouched = await store.get_job(JobId("job-other"))
    assert failed is not None
    assert (failed.state, failed.error, failed.updated_at) == ("failed", "sandbox deleted", now)
    assert untouched is not None and untouched.state == "pending"
    assert await store.finish_job(JobId("job-sb"), "completed", now=now) is False


# ---------------------------------------------------------------------- workers


async def test_workers_upsert_and_list(store: SqlStore) -> None:
    w = Worker(
        name=WorkerName("w-b"),
        capacity=4,
        features={"network": True, "runtimes": ["bwrap"]},
        connected=True,
        last_seen_at=T0,
        node_url="http://10.0.0.1:8080",
    )
    await store.upsert_worker(w)
    await store.upsert_worker(replace(w, name=WorkerName("w-a"), node_url=None))
    changed = replace(w, capacity=8, features={}, last_seen_at=T0 + timedelta(seconds=1))
    await store.upsert_worker(changed)
    assert await store.list_workers() == [
        replace(w, name=WorkerName("w-a"), node_url=None),
        changed,
    ]

    seen = T0 + timedelta(seconds=30)
    await store.set_worker_connected(WorkerName("w-b"), False, seen)
    await store.set_worker_connected(WorkerName("nobody"), True, seen)  # no such worker: no-op
    workers = {x.name: x for x in await store.list_workers()}
    assert set(workers) == {"w-a", "w-b"}
    assert workers[WorkerName("w-b")].connected is False
    assert workers[WorkerName("w-b")].last_seen_at == seen


# ---------------------------------------------------------------------- tunnels


async def test_tunnel_claim_owner_release(store: SqlStore) -> None:
    assert await store.tunnel_owner("w1") is None
    await store.claim_tunnel("w1", "http://a:8000", T0)
    assert await store.tunnel_owner("w1") == ("http://a:8000", T0)
    renewed = T0 + timedelta(seconds=15)
    await store.claim_tunnel("w1", "http://a:8000", renewed)
    assert await store.tunnel_owner("w1") == ("http://a:8000", renewed)
    moved = T0 + timedelta(seconds=20)
    await store.claim_tunnel("w1", "http://b:8000", moved)
    assert await store.tunnel_owner("w1") == ("http://b:8000", moved)

    await store.release_tunnel("w1", "http://a:8000")  # a no longer owns it: no effect
    assert await store.tunnel_owner("w1") == ("http://b:8000", moved)
    await store.release_tunnel("w1", "http://b:8000")
    assert await store.tunnel_owner("w1") is None
    await store.release_tunnel("w1", "http://b:8000")  # releasing twice is harmless


async def test_a_starting_instance_releases_only_its_own_records(store: SqlStore) -> None:
    await store.claim_tunnel("w1", "http://a:8000", T0)
    await store.claim_tunnel("w2", "http://a:8000", T0)
    await store.claim_tunnel("w3", "http://b:8000", T0)
    assert await store.release_node_tunnels("http://a:8000") == 2
    assert await store.tunnel_owner("w1") is None
    assert await store.tunnel_owner("w2") is None
    assert await store.tunnel_owner("w3") == ("http://b:8000", T0)
    assert await store.release_node_tunnels("http://a:8000") == 0


# -------------------------------------------------------------------- datetimes


async def test_datetimes_round_trip_as_aware_utc(store: SqlStore) -> None:
    plus_two = timezone(timedelta(hours=2))
    local = datetime(2025, 6, 30, 23, 59, 59, 999999, tzinfo=plus_two)
    sb = replace(sandbox("tz", state="running"), created_at=local, updated_at=local)
    sb = replace(sb, started_at=local, expires_at=local + timedelta(days=1))
    await create(store, sb)
    got = await store.get_sandbox(SandboxName("tz"))
    assert got is not None
    for value, original in [
        (got.created_at, local),
        (got.updated_at, local),
        (got.started_at, local),
        (got.expires_at, local + timedelta(days=1)),
    ]:
        assert_utc(value)
        assert value == original
        assert value.astimezone(UTC).replace(tzinfo=None) == original.astimezone(UTC).replace(
            tzinfo=None
        )
    assert got.created_at.hour == 21  # 23:59 at +02:00

    job_got = await store.get_job(JobId("job-tz"))
    assert job_got is not None
    assert_utc(job_got.created_at)
    await store.claim_tunnel("k", "http://n", local)
    owner = await store.tunnel_owner("k")
    assert owner is not None
    assert_utc(owner[1])
    assert owner[1] == local


async def test_naive_datetime_is_refused(store: SqlStore) -> None:
    naive = datetime(2025, 1, 1, 12, 0, 0)
    with pytest.raises(StoreError):
        await store.claim_tunnel("k", "http://n", naive)
    with pytest.raises(StoreError):
        await create(store, replace(sandbox("naive"), created_at=naive))
    assert await store.get_sandbox(SandboxName("naive")) is None


async def test_json_columns_round_trip(store: SqlStore) -> None:
    payload: dict[str, Any] = {
        "text": 'ünïcödé "quoted" \\ back',
        "n": 1,
        "f": 2.5,
        "list": [1, "two", None, True],
        "nested": {"deep": {"er": []}},
    }
    j = replace(job("js"), request=payload)
    sb = replace(sandbox("js"), resources=payload, env={"PATH": "/bin:/usr/bin", "Q": '"'})
    await store.insert_sandbox(sb, j, None)
    assert await store.get_sandbox(SandboxName("js")) == sb
    assert await store.get_job(JobId("job-js")) == j


# ---------------------------------------------------------------------- failures


async def test_driver_failures_surface_as_store_error(tmp_path: Path) -> None:
    (tmp_path / "empty.db").touch()
    unmigrated = await open_store(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        with pytest.raises(StoreError):
            await unmigrated.get_tenant(TenantId("x"))
        with pytest.raises(StoreError):
            await unmigrated.claim_tunnel("k", "http://n", T0)
    finally:
        await unmigrated.aclose()
    with pytest.raises(StoreError):
        await open_store(f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}")
    with pytest.raises(StoreError):
        await open_store(f"sqlite:///{tmp_path / 'never-migrated.db'}")
    assert not (tmp_path / "never-migrated.db").exists()


async def test_unreachable_postgres_is_store_error() -> None:
    # Nothing listens on port 1: the connect fails before any PostgreSQL is involved.
    down = await open_store("postgresql://postgres@127.0.0.1:1/sandgate")
    try:
        with pytest.raises(StoreError):
            await down.find_api_key("a" * 64)
    finally:
        await down.aclose()


async def test_unique_names_across_many_creates(store: SqlStore) -> None:
    created = [f"bulk-{uuid.uuid4().hex[:8]}" for _ in range(20)]
    await asyncio.gather(*(create(store, sandbox(n), digest=n) for n in created))
    got = await store.list_sandboxes(TenantId("t1"), SandboxFilter(limit=100))
    assert names(got) == sorted(created)


async def test_worker_key_binds_to_its_first_name(store: SqlStore) -> None:
    worker_key = ApiKey(key_hash="e" * 64, kind="worker", tenant_id=None, created_at=T0)
    await store.add_api_key(worker_key)
    assert await store.bind_worker_key("e" * 64, "host-1") is True
    assert await store.bind_worker_key("e" * 64, "host-1") is True  # the same worker again
    assert await store.bind_worker_key("e" * 64, "host-2") is False
    found = await store.find_api_key("e" * 64)
    assert found is not None and found.label == "host-1"
    tenant = await store.ensure_tenant("acme")
    await store.add_api_key(ApiKey("f" * 64, "tenant", tenant.id, T0))
    assert await store.bind_worker_key("f" * 64, "host-1") is False  # not a worker token
    assert await store.bind_worker_key("0" * 64, "host-1") is False  # unknown


async def test_release_idempotency_frees_the_key_for_its_sandbox_only(store: SqlStore) -> None:
    await create(store, sandbox("first"), digest="d1")
    assert await store.release_idempotency(TenantId("t1"), SandboxName("other")) is False
    assert await store.release_idempotency(TenantId("t2"), SandboxName("first")) is False
    assert await store.find_idempotency(TenantId("t1"), "d1") is not None
    assert await store.release_idempotency(TenantId("t1"), SandboxName("first")) is True
    assert await store.find_idempotency(TenantId("t1"), "d1") is None
    await create(store, sandbox("second"), digest="d1")  # the key can be used again
    record = await store.find_idempotency(TenantId("t1"), "d1")
    assert record is not None and record.sandbox_name == "second"


async def test_list_stale_pending(store: SqlStore) -> None:
    await create(store, sandbox("old-pending", at=T0))
    await create(store, sandbox("new-pending", at=T0 + timedelta(minutes=5)))
    await create(store, sandbox("old-running", state="running", at=T0))
    before = T0 + timedelta(minutes=1)
    assert names(await store.list_stale_pending(before, 10)) == ["old-pending"]
    assert await store.list_stale_pending(before, 0) == []


async def test_claim_stale_jobs_has_one_winner(store_url: str) -> None:
    first, second = await open_store(store_url), await open_store(store_url)
    try:
        for i in range(10):
            await create(first, sandbox(f"job-{i}"))
        later = T0 + timedelta(minutes=5)
        won_a, won_b = await asyncio.gather(
            first.claim_stale_jobs(T0 + timedelta(minutes=1), "a", later, 100),
            second.claim_stale_jobs(T0 + timedelta(minutes=1), "b", later, 100),
        )
        ids = [j.id for j in won_a] + [j.id for j in won_b]
        assert sorted(ids) == sorted(f"job-job-{i}" for i in range(10))  # each once
        assert all(j.attempt == 1 and j.updated_at == later for j in won_a + won_b)
        # freshly claimed: not stale again until `before` passes their new updated_at
        assert await first.claim_stale_jobs(later, "a", later, 100) == []
        again = await first.claim_stale_jobs(later + timedelta(seconds=1), "a", later, 100)
        assert len(again) == 10 and all(j.attempt == 2 for j in again)
        await first.finish_job(again[0].id, "completed", now=later)
        left = await first.claim_stale_jobs(later + timedelta(minutes=9), "a", later, 100)
        assert again[0].id not in [j.id for j in left]
    finally:
        await first.aclose()
        await second.aclose()


async def test_renew_tunnel_never_steals(store: SqlStore) -> None:
    await store.claim_tunnel("w", "http://a", T0)
    assert await store.renew_tunnel("w", "http://a", T0 + timedelta(seconds=5)) is True
    await store.claim_tunnel("w", "http://b", T0 + timedelta(seconds=6))  # moved to b
    assert await store.renew_tunnel("w", "http://a", T0 + timedelta(seconds=7)) is False
    owner = await store.tunnel_owner("w")
    assert owner is not None and owner[0] == "http://b"


# ---------------------------------------------------------------------- exec jobs


def exec_job(
    job_id: str,
    tenant: str = "t1",
    *,
    sandbox_name: str = "sb",
    digest: str | None = None,
    at: datetime = T0,
    claimed_by: str | None = "http://a",
) -> ExecJob:
    return ExecJob(
        id=ExecJobId(job_id),
        tenant_id=TenantId(tenant),
        sandbox_name=SandboxName(sandbox_name),
        command="echo hi",
        timeout=30.0,
        state="queued",
        created_at=at,
        updated_at=at,
        digest=digest,
        fingerprint=None if digest is None else "f" * 64,
        claimed_by=claimed_by,
    )


async def test_exec_job_round_trip_and_tenant_scope(store: SqlStore) -> None:
    await store.insert_exec_job(exec_job("j1", digest="d1"))
    got = await store.get_exec_job(TenantId("t1"), ExecJobId("j1"))
    assert got == exec_job("j1", digest="d1")
    assert await store.get_exec_job(TenantId("t2"), ExecJobId("j1")) is None
    assert await store.find_exec_job_by_digest(TenantId("t1"), "d1") == got
    assert await store.find_exec_job_by_digest(TenantId("t2"), "d1") is None
    assert await store.find_exec_job_by_digest(TenantId("t1"), "d2") is None


async def test_exec_job_duplicate_digest_conflicts(store: SqlStore) -> None:
    await store.insert_exec_job(exec_job("j1", digest="d1"))
    with pytest.raises(IdempotencyConflictError):
        await store.insert_exec_job(exec_job("j2", digest="d1"))
    assert await store.get_exec_job(TenantId("t1"), ExecJobId("j2")) is None
    await store.insert_exec_job(exec_job("j3", "t2", digest="d1"))  # other tenant: its own


async def test_exec_jobs_without_key_never_collide(store: SqlStore) -> None:
    for i in range(3):
        await store.insert_exec_job(exec_job(f"n{i}"))
    listed = await store.list_exec_jobs(TenantId("t1"), SandboxName("sb"), 10)
    assert sorted(j.id for j in listed) == ["n0", "n1", "n2"]


async def test_concurrent_exec_job_inserts_have_one_winner(store_url: str) -> None:
    stores = [await open_store(store_url), await open_store(store_url)]
    try:

        async def attempt(i: int) -> str:
            try:
                await stores[i % 2].insert_exec_job(exec_job(f"r{i}", digest="one"))
            except IdempotencyConflictError:
                return "conflict"
            return "created"

        outcomes = await asyncio.gather(*(attempt(i) for i in range(30)))
        assert outcomes.count("created") == 1
        winner = await stores[1].find_exec_job_by_digest(TenantId("t1"), "one")
        assert winner is not None and outcomes[int(winner.id[1:])] == "created"
    finally:
        for s in stores:
            await s.aclose()


async def test_list_exec_jobs_newest_first_scoped_and_limited(store: SqlStore) -> None:
    for i in range(5):
        await store.insert_exec_job(exec_job(f"j{i}", at=T0 + timedelta(seconds=i)))
    await store.insert_exec_job(exec_job("other-sb", sandbox_name="sb2"))
    await store.insert_exec_job(exec_job("other-tenant", "t2"))
    listed = await store.list_exec_jobs(TenantId("t1"), SandboxName("sb"), 3)
    assert [j.id for j in listed] == ["j4", "j3", "j2"]
    assert await store.list_exec_jobs(TenantId("t1"), SandboxName("sb"), 0) == []
    assert [j.id for j in await store.list_exec_jobs(TenantId("t2"), SandboxName("sb"), 9)] == [
        "other-tenant"
    ]


async def test_exec_job_lists_carry_no_output_and_page_by_cursor(store: SqlStore) -> None:
    for i in range(5):  # two share a created_at: the id breaks the tie
        await store.insert_exec_job(exec_job(f"j{i}", at=T0 + timedelta(seconds=min(i, 3))))
    done = ExecResult(state="succeeded", exit_code=0, stdout="x" * 1000, stderr="e")
    assert await store.start_exec_job(ExecJobId("j4"), "http://a", T0)
    assert await store.finish_exec_job(ExecJobId("j4"), done, T0)
    seen: list[str] = []
    before = None
    while page := await store.list_exec_jobs(TenantId("t1"), SandboxName("sb"), 2, before=before):
        assert all(j.stdout == "" and j.stderr == "" for j in page)
        seen += [j.id for j in page]
        before = (page[-1].created_at, page[-1].id)
    assert seen == ["j4", "j3", "j2", "j1", "j0"]
    full = await store.get_exec_job(TenantId("t1"), ExecJobId("j4"))
    assert full is not None and full.stdout == "x" * 1000  # read one at a time, whole


async def test_sweep_deletes_finished_jobs_past_retention_or_of_gone_sandboxes(
    store: SqlStore,
) -> None:
    await store.insert_sandbox(sandbox("live", state="running"), job("live"), None)
    await store.insert_sandbox(sandbox("gone", state="running"), job("gone"), None)
    done = ExecResult(state="succeeded", exit_code=0, stdout="out")
    jobs = {
        "old-done": ("live", T0),
        "new-done": ("live", T0 + timedelta(hours=2)),
        "old-running": ("live", T0),
        "gone-done": ("gone", T0 + timedelta(hours=2)),
        "gone-queued": ("gone", T0 + timedelta(hours=2)),
    }
    for job_id, (sb, at) in jobs.items():
        await store.insert_exec_job(exec_job(job_id, sandbox_name=sb, at=at))
        if job_id != "gone-queued":
            assert await store.start_exec_job(ExecJobId(job_id), "http://a", at)
        if job_id.endswith("-done"):
            assert await store.finish_exec_job(ExecJobId(job_id), done, at)
    await store.set_sandbox_state(
        SandboxName("gone"), "deleted", from_states=("running",), error=None, now=T0
    )
    assert await store.sweep_exec_jobs(T0 + timedelta(hours=1), 100) == 2
    left = {j for j in jobs if await store.get_exec_job(TenantId("t1"), ExecJobId(j)) is not None}
    # past retention and finished, or finished with its sandbox gone: deleted; the rest kept
    assert left == {"new-done", "old-running", "gone-queued"}
    assert await store.sweep_exec_jobs(T0 + timedelta(hours=1), 100) == 0


async def test_exec_job_moves_are_conditional(store: SqlStore) -> None:
    await store.insert_exec_job(exec_job("j"))
    done = ExecResult(state="succeeded", exit_code=0, stdout="out", stderr="err")
    t1, t2 = T0 + timedelta(seconds=1), T0 + timedelta(seconds=2)
    assert await store.finish_exec_job(ExecJobId("j"), done, t1) is False  # not running yet
    assert await store.start_exec_job(ExecJobId("j"), "http://b", t1) is True
    assert await store.start_exec_job(ExecJobId("j"), "http://c", t1) is False  # runs once
    assert await store.finish_exec_job(ExecJobId("j"), done, t2) is True
    failed = ExecResult(state="failed", exit_code=1, error="late")
    assert await store.finish_exec_job(ExecJobId("j"), failed, t2) is False
    got = await store.get_exec_job(TenantId("t1"), ExecJobId("j"))
    assert got is not None
    assert (got.state, got.exit_code, got.stdout, got.stderr) == ("succeeded", 0, "out", "err")
    assert (got.claimed_by, got.started_at, got.finished_at) == ("http://b", t1, t2)
    assert got.error is None and not got.stdout_truncated and not got.stderr_truncated


async def test_fail_orphaned_exec_jobs_only_of_dead_instances(store: SqlStore) -> None:
    await store.heartbeat_instance("http://alive", T0 + timedelta(minutes=5))
    await store.heartbeat_instance("http://dead", T0)
    for job_id, owner in (("alive", "http://alive"), ("dead", "http://dead"), ("gone", "http://x")):
        await store.insert_exec_job(exec_job(job_id, claimed_by=owner))
        assert await store.start_exec_job(ExecJobId(job_id), owner, T0)
    await store.insert_exec_job(exec_job("queued-dead", claimed_by="http://dead"))
    await store.insert_exec_job(
        exec_job("fresh", claimed_by="http://x", at=T0 + timedelta(minutes=5))
    )
    await store.insert_exec_job(exec_job("finished", claimed_by="http://dead"))
    await store.start_exec_job(ExecJobId("finished"), "http://dead", T0)
    await store.finish_exec_job(ExecJobId("finished"), ExecResult("succeeded", 0), T0)

    now = T0 + timedelta(minutes=6)
    failed = await store.fail_orphaned_exec_jobs(T0 + timedelta(minutes=1), now)
    assert failed == 3  # dead, gone (never heartbeated), queued-dead
    states = {
        j.id: (j.state, j.error)
        for j in await store.list_exec_jobs(TenantId("t1"), SandboxName("sb"), 100)
    }
    assert states[ExecJobId("alive")] == ("running", None)
    assert states[ExecJobId("fresh")] == ("queued", None)  # touched after dead_before: not yet
    assert states[ExecJobId("finished")] == ("succeeded", None)
    for job_id in ("dead", "gone", "queued-dead"):
        assert states[ExecJobId(job_id)] == ("failed", ORPHANED_EXEC_JOB)
    assert await store.fail_orphaned_exec_jobs(T0 + timedelta(minutes=1), now) == 0
    # a failed job is never started again
    assert await store.start_exec_job(ExecJobId("queued-dead"), "http://alive", now) is False


async def test_heartbeat_upserts_and_instance_jobs_fail(store: SqlStore) -> None:
    await store.heartbeat_instance("http://a", T0)
    await store.heartbeat_instance("http://a", T0 + timedelta(minutes=10))
    await store.insert_exec_job(exec_job("j", claimed_by="http://a"))
    await store.start_exec_job(ExecJobId("j"), "http://a", T0)
    # heartbeat renewed: not orphaned
    assert await store.fail_orphaned_exec_jobs(T0 + timedelta(minutes=5), T0) == 0
    assert await store.fail_instance_exec_jobs("http://b", "restarted", T0) == 0
    assert await store.fail_instance_exec_jobs("http://a", "restarted", T0) == 1
    got = await store.get_exec_job(TenantId("t1"), ExecJobId("j"))
    assert got is not None and (got.state, got.error) == ("failed", "restarted")


async def test_overdue_exec_jobs_are_listed_and_failed_as_seen(store: SqlStore) -> None:
    # a live instance whose store writes were lost: one job never recorded its start, one
    # never recorded its result; their neighbours are fine and must be left alone
    for job_id in ("stuck-queued", "stuck-running", "long-running", "fresh"):
        at = T0 + timedelta(minutes=9) if job_id == "fresh" else T0
        await store.insert_exec_job(exec_job(job_id, claimed_by="http://alive", at=at))
    ran = (("stuck-running", 30.0), ("long-running", 3600.0))
    for job_id, timeout in ran:
        deadline = T0 + timedelta(seconds=timeout)
        assert await store.start_exec_job(ExecJobId(job_id), "http://alive", T0, deadline=deadline)
    now = T0 + timedelta(minutes=10)
    before = now - timedelta(seconds=60)
    overdue = await store.list_overdue_exec_jobs(before, 10)
    assert sorted(j.id for j in overdue) == ["stuck-queued", "stuck-running"]
    # compare-and-swap: a job that moved since it was read is left to whoever moved it
    moved = next(j for j in overdue if j.id == "stuck-running")
    done = ExecResult(state="succeeded", exit_code=0)
    assert await store.finish_exec_job(moved.id, done, now)  # its result arrived after all
    results = [await store.fail_exec_job_as_seen(j, "overdue", now) for j in overdue]
    assert sorted(results) == [False, True]
    states = {
        j.id: (j.state, j.error)
        for j in await store.list_exec_jobs(TenantId("t1"), SandboxName("sb"), 100)
    }
    assert states == {
        "stuck-queued": ("failed", "overdue"),
        "stuck-running": ("succeeded", None),
        "long-running": ("running", None),
        "fresh": ("queued", None),
    }
    assert await store.list_overdue_exec_jobs(before, 10) == []


# ------------------------------------------------------------------ readiness and causes


async def heartbeats(store: SqlStore) -> dict[str, datetime]:
    async with store.engine.connect() as conn:
        rows = (await conn.execute(select(instances))).all()
    return {row.node_url: row.heartbeat_at for row in rows}


async def test_probe_write_commits_and_moves_the_heartbeat_only_forward(
    store: SqlStore, store_url: str
) -> None:
    await store.probe_write("http://a", T0)  # a new instance: its row is written
    await store.heartbeat_instance("http://b", T0 + timedelta(minutes=10))
    await store.probe_write("http://b", T0)  # never moves it back
    await store.probe_write("http://b", T0 + timedelta(minutes=10))  # nor fails when equal
    other = await open_store(store_url)  # committed: another instance sees it
    try:
        seen = await heartbeats(other)
    finally:
        await other.aclose()
    assert seen == {"http://a": T0, "http://b": T0 + timedelta(minutes=10)}
    await store.probe_write("http://a", T0 + timedelta(minutes=1))
    assert (await heartbeats(store))["http://a"] == T0 + timedelta(minutes=1)
    # an instance that answers /readyz is alive: its jobs are not orphaned
    await store.insert_exec_job(exec_job("j", claimed_by="http://a"))
    assert await store.start_exec_job(ExecJobId("j"), "http://a", T0)
    assert await store.fail_orphaned_exec_jobs(T0 + timedelta(seconds=30), T0) == 0


async def test_a_failed_write_names_the_drivers_cause_but_no_value(store: SqlStore) -> None:
    await store.ensure_tenant("acme")
    secret_hash = "5ec2e7" * 10 + "abcd"
    key = ApiKey(key_hash=secret_hash, kind="worker", tenant_id=None, created_at=T0, label="x1")
    await store.add_api_key(key)
    with pytest.raises(StoreError) as caught:
        await store.add_api_key(replace(key, label="private-label"))  # the same hash again
    message = caught.value.message
    assert message.startswith("the store failed (add_api_key): ")
    # the driver's words: SQLite names the constraint, PostgreSQL's condition and SQLSTATE
    assert "UNIQUE constraint failed" in message or "unique violation (SQLSTATE 23505)" in message
    assert secret_hash not in message and "private-label" not in message
    assert "INSERT" not in message and "[parameters" not in message
