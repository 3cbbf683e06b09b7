"""Admission in the store, on SQLite and PostgreSQL: every count exact under concurrency.

Two store handles (two engines, as two instances have) race on the same database.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from sandgate.core.breaker import BreakerPolicy
from sandgate.core.fair_queue import Waiting, order
from sandgate.errors import CapacityConflictError, IdempotencyConflictError, QuotaConflictError
from sandgate.store.base import (
    ExecJob,
    ExecJobId,
    SandboxName,
    SchedulingTimeout,
    TenantId,
    TenantLimits,
    TenantShare,
    Worker,
    WorkerName,
)
from sandgate.store.schema import admission_tickets
from sandgate.store.sql import SqlStore, open_store

from .test_store_contract import idem, job, sandbox

pytestmark = pytest.mark.anyio

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
POLICY = BreakerPolicy(threshold=3, window=600.0, open_for=60.0, trial_lease=40.0)
T1 = TenantId("t1")


async def two_handles(url: str) -> tuple[SqlStore, SqlStore]:
    return await open_store(url), await open_store(url)


def timeout_at(at: datetime, name: str = "sb", tenant: str = "t1") -> SchedulingTimeout:
    return SchedulingTimeout(
        at=at,
        sandbox_name=SandboxName(name),
        tenant_id=TenantId(tenant),
        node_url="http://a",
        reason="not ready",
    )


# ------------------------------------------------------------------ tenant limits


async def test_tenant_limits_round_trip_and_replace(store: SqlStore) -> None:
    assert await store.get_tenant_limits(T1) is None
    await store.set_tenant_limits(TenantLimits(T1, rps=5, burst=7, max_sandboxes=2), NOW)
    assert await store.get_tenant_limits(T1) == TenantLimits(T1, 5.0, 7, 2, None)
    await store.set_tenant_limits(TenantLimits(T1, max_exec_jobs=1), NOW)
    assert await store.get_tenant_limits(T1) == TenantLimits(T1, None, None, None, 1)
    assert await store.get_tenant_limits(TenantId("t2")) is None


async def test_rate_bucket_gives_burst_then_refills_at_rate(store: SqlStore) -> None:
    t = 1_000_000.0
    taken = [await store.take_rate_token(T1, 5.0, 3, t) for _ in range(5)]
    assert taken[:3] == [0.0, 0.0, 0.0]  # the burst
    assert taken[3] == pytest.approx(0.2)  # one token per 1/5 s
    assert taken[4] == pytest.approx(0.2)  # a refusal takes nothing
    assert await store.take_rate_token(T1, 5.0, 3, t + 0.1) == pytest.approx(0.1)
    assert await store.take_rate_token(T1, 5.0, 3, t + 0.2) == 0.0
    assert await store.take_rate_token(T1, 5.0, 3, t + 0.2) > 0
    # a long pause refills up to the burst, never beyond
    got = [await store.take_rate_token(T1, 5.0, 3, t + 100) for _ in range(4)]
    assert [g == 0.0 for g in got] == [True, True, True, False]
    # another tenant has its own bucket
    assert await store.take_rate_token(TenantId("t2"), 5.0, 3, t) == 0.0


async def test_rate_bucket_is_exact_across_two_handles(store_url: str) -> None:
    a, b = await two_handles(store_url)
    try:
        t = 2_000_000.0
        got = await asyncio.gather(
            *(s.take_rate_token(T1, 1.0, 10, t) for s in (a, b) * 20)  # 40 at one instant
        )
    finally:
        await a.aclose()
        await b.aclose()
    assert sum(1 for g in got if g == 0.0) == 10


# ------------------------------------------------------------------ quotas


async def test_sandbox_quota_is_exact_across_two_handles(store_url: str) -> None:
    a, b = await two_handles(store_url)
    try:
        await a.set_tenant_limits(TenantLimits(T1, max_sandboxes=3), NOW)

        async def one(s: SqlStore, i: int) -> bool:
            sb = sandbox(f"q-{i}", "t1")
            try:
                await s.insert_sandbox(sb, job(sb.name), None, max_live=3)
            except QuotaConflictError as exc:
                assert exc.live == 3
                return False
            return True

        got = await asyncio.gather(*(one(s, i) for i, s in enumerate((a, b) * 8)))
        assert sum(got) == 3
        assert await b.count_tenant_live_sandboxes(T1) == 3
        # another tenant is not counted against t1
        other = sandbox("other", "t2")
        await a.insert_sandbox(other, job(other.name), None, max_live=3)
        # a sandbox that ended frees its slot
        ok = [n for n, g in zip(range(16), got, strict=True) if g]
        moved = await a.set_sandbox_state(
            SandboxName(f"q-{ok[0]}"), "deleted", from_states=("pending",), now=NOW
        )
        assert moved
        assert await one(b, 100)
        assert not await one(a, 101)
    finally:
        await a.aclose()
        await b.aclose()


def exec_job(i: int, tenant: str = "t1") -> ExecJob:
    return ExecJob(
        id=ExecJobId(f"ej-{tenant}-{i}"),
        tenant_id=TenantId(tenant),
        sandbox_name=SandboxName("sb"),
        command="true",
        timeout=5.0,
        state="queued",
        created_at=NOW,
        updated_at=NOW,
    )


async def test_exec_job_quota_is_exact_across_two_handles(store_url: str) -> None:
    a, b = await two_handles(store_url)
    try:
        await a.set_tenant_limits(TenantLimits(T1, max_exec_jobs=2), NOW)

        async def one(s: SqlStore, i: int) -> bool:
            try:
                await s.insert_exec_job(exec_job(i), max_active=2)
            except QuotaConflictError:
                return False
            return True

        got = await asyncio.gather(*(one(s, i) for i, s in enumerate((a, b) * 6)))
        assert sum(got) == 2
    finally:
        await a.aclose()
        await b.aclose()


# ------------------------------------------------------------------ the create queue


async def test_queue_limit_is_exact_across_two_handles(store_url: str) -> None:
    a, b = await two_handles(store_url)
    try:
        later = NOW + timedelta(seconds=30)
        got = await asyncio.gather(
            *(s.enqueue_create(T1, "http://x", NOW, later, 10) for s in (a, b) * 15)
        )
        tickets = [g for g in got if g is not None]
        assert len(tickets) == 10
        assert (await a.admission_snapshot(NOW)).queued == 10
        # FIFO: each ticket's position is the number of older live tickets
        ordered = sorted(tickets)
        assert [await a.queue_position(t, NOW) for t in ordered] == list(range(10))
        await b.leave_queue(ordered[0])
        assert await a.queue_position(ordered[1], NOW) == 0
        assert await a.queue_position(ordered[0], NOW) is None
        assert await a.enqueue_create(T1, "http://x", NOW, later, 10) is not None
        assert await a.enqueue_create(T1, "http://x", NOW, later, 10) is None
    finally:
        await a.aclose()
        await b.aclose()


async def test_expired_tickets_stop_counting(store: SqlStore) -> None:
    soon = NOW + timedelta(seconds=5)
    dead = await store.enqueue_create(T1, "http://dead", NOW, soon, 2)
    live = await store.enqueue_create(T1, "http://live", NOW, NOW + timedelta(seconds=60), 2)
    assert dead is not None and live is not None
    assert await store.enqueue_create(T1, "http://x", NOW, soon, 2) is None
    after = NOW + timedelta(seconds=10)
    assert await store.queue_position(dead, after) is None
    assert await store.queue_position(live, after) == 0  # the dead one ahead no longer counts
    assert (await store.admission_snapshot(after)).queued == 1
    assert await store.renew_ticket(live, NOW + timedelta(seconds=90))
    assert await store.enqueue_create(T1, "http://x", after, after + timedelta(seconds=5), 2)


async def enqueue(store: SqlStore, tenant: str, n: int = 1, lease: float = 60.0) -> list[int]:
    got = []
    for _ in range(n):
        expires = NOW + timedelta(seconds=lease)
        ticket = await store.enqueue_create(TenantId(tenant), "http://x", NOW, expires, 100)
        assert ticket is not None
        got.append(ticket)
    return got


async def served(
    store: SqlStore, share: TenantShare | None = None, at: datetime = NOW
) -> list[int]:
    """The live tickets in the order the store serves them (by their positions)."""
    rows = await store._fetch_all(select(admission_tickets.c.id), {})
    positions = {r.id: await store.queue_position(r.id, at, share) for r in rows}
    live = {t: p for t, p in positions.items() if p is not None}
    assert sorted(live.values()) == list(range(len(live)))  # 0..n-1, each once
    return sorted(live, key=live.__getitem__)


async def place(store: SqlStore, name: str, tenant: str, *, before: bool = False) -> None:
    """A sandbox of `tenant` on worker w: placed from the queue (created after the tickets,
    at NOW) or already there before (`before`)."""
    at = NOW - timedelta(minutes=1) if before else NOW + timedelta(seconds=1)
    sb = replace(sandbox(name, tenant, at=at), worker=WorkerName("w"))
    await store.insert_sandbox(sb, job(sb.name), None)


async def test_a_tenant_flooding_the_queue_does_not_push_another_back(store_url: str) -> None:
    a, b = await two_handles(store_url)
    try:
        await place(a, "b-old", "B", before=True)  # B holds one already
        flood = await enqueue(b, "B", 10)
        (late,) = await enqueue(a, "A")
        assert await a.queue_position(late, NOW) == 1  # right behind B's oldest, not 10th
        assert await b.queue_position(flood[0], NOW) == 0  # B's head keeps its place
        assert await a.queue_position(flood[1], NOW) == 2
        # turns: B1 A1 B2 A2 B3 A3 B4 ...; both handles (instances) see the same order
        more = await enqueue(b, "A", 2)
        expected = [flood[0], late, flood[1], more[0], flood[2], more[1], *flood[3:]]
        assert await served(a) == expected
        assert await served(b) == expected
        # B's head places (its sandbox, then it leaves): A's ticket is next, not B's 2nd
        await place(b, "b-1", "B")
        await b.leave_queue(flood[0])
        assert await a.queue_position(late, NOW) == 0
        assert await served(b) == expected[1:]
        await place(a, "a-1", "A")
        await a.leave_queue(late)
        assert await served(b) == expected[2:]
    finally:
        await a.aclose()
        await b.aclose()


async def test_queue_positions_match_the_pure_order(store: SqlStore) -> None:
    """Tenants of random sizes, some tickets expired, some placed: the SQL statement and
    core.fair_queue.order agree."""
    rng = random.Random(10)
    waiting: list[Waiting] = []
    for _ in range(40):
        tenant = rng.choice("ABCDE")
        lease = rng.choice((5.0, 60.0, 60.0, 60.0))  # a quarter are expired at NOW + 10 s
        (ticket,) = await enqueue(store, tenant, lease=lease)
        if lease > 10:
            waiting.append(Waiting(ticket, tenant))
    placed = {"A": 2, "C": 1}
    for tenant, n in placed.items():
        for i in range(n):
            await place(store, f"{tenant}-{i}", tenant)
        await place(store, f"{tenant}-old", tenant, before=True)  # before: not this streak
    later = NOW + timedelta(seconds=10)
    assert await served(store, at=later) == order(waiting, placed)
    assert await served(store, at=later) != order(waiting)


async def test_a_tenant_at_its_share_waits_behind_the_others(store: SqlStore) -> None:
    await store.upsert_worker(Worker(WorkerName("w"), 4, {}, connected=True, last_seen_at=NOW))
    await store.claim_tunnel("w", "http://a", NOW)
    for i in range(2):  # B holds 2 of 4, A 1
        await place(store, f"b-{i}", "B", before=True)
    await place(store, "a-0", "A", before=True)
    (b1,) = await enqueue(store, "B")
    a1, a2 = await enqueue(store, "A", 2)
    half = TenantShare(0.5, connected_since=NOW - timedelta(seconds=90))
    assert await served(store) == [b1, a1, a2]  # no share: turns only
    assert await served(store, half) == [a1, a2, b1]  # B is at 2/4 >= 0.5: it waits
    assert await served(store, TenantShare(0.75, half.connected_since)) == [b1, a1, a2]
    # a worker whose tunnel is no longer owned does not count: no capacity, nobody held
    stale = TenantShare(0.5, connected_since=NOW + timedelta(seconds=1))
    assert await served(store, stale) == [b1, a1, a2]
    # A1 places: A is at its share too; both at it, they take turns again (capacity is
    # never left idle because of the share)
    await place(store, "a-1", "A")
    await store.leave_queue(a1)
    assert await served(store, half) == [b1, a2]
    # one of B's ends: B is below its share again
    assert await store.set_sandbox_state(
        SandboxName("b-0"), "deleted", from_states=("pending",), now=NOW
    )
    assert await served(store, half) == [b1, a2]
    # B's ticket leaves; a tenant alone in the queue places even at its share
    await store.leave_queue(b1)
    assert await served(store, half) == [a2]


# ------------------------------------------------------------------ the breaker


async def test_breaker_opens_on_exactly_the_threshold_across_two_handles(store_url: str) -> None:
    a, b = await two_handles(store_url)
    try:
        assert (await a.admission_snapshot(NOW)).breaker.state == "closed"
        states = await asyncio.gather(
            *(
                s.record_scheduling_timeout(timeout_at(NOW + timedelta(seconds=i), f"s{i}"), POLICY)
                for i, s in enumerate((a, b, a))
            )
        )
        # whichever order they committed in, exactly one of them saw the 3rd and opened it
        assert sorted(r.state for r in states) == ["closed", "closed", "open"]
        record = (await b.admission_snapshot(NOW)).breaker
        assert record.state == "open"
        assert record.open_until is not None and record.opened_at is not None
        assert record.open_until - record.opened_at == timedelta(seconds=60)
        assert record.reason is not None and "3 sandboxes" in record.reason
    finally:
        await a.aclose()
        await b.aclose()


async def test_timeouts_outside_the_window_do_not_count(store: SqlStore) -> None:
    await store.record_scheduling_timeout(timeout_at(NOW), POLICY)
    await store.record_scheduling_timeout(timeout_at(NOW + timedelta(seconds=10)), POLICY)
    late = NOW + timedelta(seconds=601)  # the first one left the window
    assert (await store.record_scheduling_timeout(timeout_at(late), POLICY)).state == "closed"
    assert (
        await store.record_scheduling_timeout(timeout_at(late + timedelta(seconds=1)), POLICY)
    ).state == "open"
    recent = await store.list_scheduling_timeouts(late - timedelta(seconds=600), 10)
    assert [r.at for r in recent] == [
        late + timedelta(seconds=1),
        late,
        NOW + timedelta(seconds=10),
    ]


async def test_one_trial_after_the_open_period_closes_or_reopens(store_url: str) -> None:
    a, b = await two_handles(store_url)
    try:
        for i in range(3):
            await a.record_scheduling_timeout(timeout_at(NOW + timedelta(seconds=i)), POLICY)
        opened = (await a.admission_snapshot(NOW)).breaker
        assert opened.state == "open" and opened.open_until is not None
        early = opened.open_until - timedelta(seconds=1)
        stale = early - timedelta(seconds=40)
        assert not await a.claim_breaker_trial("early", early, stale)
        due = opened.open_until
        wins = await asyncio.gather(
            *(
                s.claim_breaker_trial(f"trial-{i}", due, due - timedelta(seconds=40))
                for i, s in enumerate((a, b) * 5)
            )
        )
        assert sum(wins) == 1
        winner = f"trial-{wins.index(True)}"
        record = (await b.admission_snapshot(due)).breaker
        assert record.state == "half_open" and record.trial == winner
        # the trial times out: open again for the full period
        again = await b.record_scheduling_timeout(timeout_at(due, winner), POLICY)
        assert again.state == "open" and again.open_until == due + timedelta(seconds=60)
        # next period: a trial that succeeds closes it, and old timeouts no longer count
        due2 = due + timedelta(seconds=60)
        assert await a.claim_breaker_trial("good", due2, due2 - timedelta(seconds=40))
        assert not await a.conclude_breaker_trial("not-the-trial", True, due2)
        assert await b.conclude_breaker_trial("good", True, due2)
        closed = (await a.admission_snapshot(due2)).breaker
        assert closed.state == "closed" and closed.closed_at == due2
        one_more = await a.record_scheduling_timeout(timeout_at(due2), POLICY)
        assert one_more.state == "closed"  # 1 since closing, not 5 in the window
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_trial_left_unconcluded_is_taken_over_after_its_lease(store: SqlStore) -> None:
    for i in range(3):
        await store.record_scheduling_timeout(timeout_at(NOW + timedelta(seconds=i)), POLICY)
    due = NOW + timedelta(seconds=62)
    assert await store.claim_breaker_trial("lost", due, due - timedelta(seconds=40))
    soon = due + timedelta(seconds=10)
    assert not await store.claim_breaker_trial("next", soon, soon - timedelta(seconds=40))
    later = due + timedelta(seconds=41)
    assert await store.claim_breaker_trial("next", later, later - timedelta(seconds=40))
    # an inconclusive trial (failed for another reason) leaves it open and due at once
    assert await store.conclude_breaker_trial("next", False, later)
    record = (await store.admission_snapshot(later)).breaker
    assert record.state == "open" and record.open_until == later
    assert await store.claim_breaker_trial("third", later, later - timedelta(seconds=40))


async def test_a_workers_last_slot_goes_to_exactly_one_of_two_handles(store_url: str) -> None:
    a, b = await two_handles(store_url)
    try:
        await a.upsert_worker(
            Worker(WorkerName("w"), 2, {}, connected=True, last_seen_at=NOW, node_url="http://a")
        )

        async def one(s: SqlStore, i: int) -> bool:
            sb = replace(sandbox(f"c-{i}", "t1"), worker=WorkerName("w"))
            try:
                await s.insert_sandbox(sb, job(sb.name), None, worker_capacity=2)
            except CapacityConflictError:
                return False
            return True

        got = await asyncio.gather(*(one(s, i) for i, s in enumerate((a, b) * 4)))
        assert sum(got) == 2
        assert await a.count_live_sandboxes(WorkerName("w")) == 2
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_workers_last_memory_goes_to_exactly_one_of_two_handles(store_url: str) -> None:
    """Slots are plenty; the worker's memory budget (1000 MiB) holds three 300 MiB sandboxes:
    exactly three of eight concurrent inserts on two handles get it, and what is counted is
    what the live sandboxes were granted."""
    a, b = await two_handles(store_url)
    try:
        await a.upsert_worker(
            Worker(WorkerName("m"), 64, {}, connected=True, last_seen_at=NOW, node_url="http://a")
        )
        budget = {"memory_mb": 1000, "disk_mb": 100_000}

        async def one(s: SqlStore, i: int) -> bool:
            granted = {"memory_mb": 300, "cpus": 1.0, "pids": 64, "disk_mb": 1024}
            sb = replace(sandbox(f"m-{i}", "t1"), worker=WorkerName("m"), resources=granted)
            try:
                await s.insert_sandbox(
                    sb, job(sb.name), None, worker_capacity=64, worker_budget=budget
                )
            except CapacityConflictError as exc:
                assert "memory_mb" in exc.message
                return False
            return True

        got = await asyncio.gather(*(one(s, i) for i, s in enumerate((a, b) * 4)))
        assert sum(got) == 3
        usage = await b.worker_usage(WorkerName("m"))
        assert usage.sandboxes == 3 and usage.granted == {"memory_mb": 900, "disk_mb": 3072}
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_keys_retry_at_the_quota_meets_its_key_not_the_quota(store: SqlStore) -> None:
    await store.set_tenant_limits(TenantLimits(T1, max_sandboxes=1), NOW)
    first = sandbox("k-1", "t1")
    await store.insert_sandbox(first, job(first.name), idem("t1", "K", first.name), max_live=1)
    retry = sandbox("k-2", "t1")
    with pytest.raises(IdempotencyConflictError):  # the replay path, not a 429
        await store.insert_sandbox(retry, job(retry.name), idem("t1", "K", retry.name), max_live=1)
    other = sandbox("k-3", "t1")
    with pytest.raises(QuotaConflictError):
        await store.insert_sandbox(other, job(other.name), idem("t1", "L", other.name), max_live=1)
    assert await store.get_sandbox(SandboxName("k-3")) is None  # rolled back, key included
    assert await store.find_idempotency(T1, "L") is None
