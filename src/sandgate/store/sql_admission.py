"""Admission in SQL: tenant limits, token buckets, the create queue and the breaker.

Each check-and-take is one transaction whose *first* statement is a write to the row that
guards it (an `UPDATE` of the limits row, the queue's lock row or the breaker row). On
PostgreSQL that row lock serializes the check across every instance; on SQLite the first
write takes the database's write lock, so a transaction never has to upgrade a read lock.
That is what makes the counts exact under N instances: nothing here is counted in memory.
The rate limit needs no lock at all: one conditional `UPDATE` refills and takes a token.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, cast

from sqlalchemy import (
    Float,
    Integer,
    Row,
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    true,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from sandgate.core import breaker
from sandgate.core.breaker import BreakerPolicy, BreakerRecord
from sandgate.errors import QuotaConflictError, StoreError
from sandgate.store.base import (
    AdmissionSnapshot,
    SandboxName,
    SchedulingTimeout,
    TenantId,
    TenantLimits,
    TenantShare,
)
from sandgate.store.ops import store_op
from sandgate.store.schema import (
    admission_locks,
    admission_tickets,
    breakers,
    exec_jobs,
    rate_buckets,
    sandboxes,
    scheduling_timeouts,
    tenant_limits,
    tunnel_owners,
    workers,
)

if TYPE_CHECKING:
    from collections.abc import Mapping
    from contextlib import AbstractAsyncContextManager

    from sqlalchemy.ext.asyncio import AsyncEngine

QUEUE_LOCK: Final = "queue"

# --- quotas
_GUARD_TENANT = (
    update(tenant_limits)
    .where(tenant_limits.c.tenant_id == bindparam("b_tenant_id"))
    .values(guard=tenant_limits.c.guard + 1)
)
_COUNT_LIVE_SANDBOXES = (
    select(func.count())
    .select_from(sandboxes)
    .where(
        sandboxes.c.tenant_id == bindparam("b_tenant_id"),
        sandboxes.c.state.in_(("pending", "running")),
    )
)
_COUNT_ACTIVE_EXEC_JOBS = (
    select(func.count())
    .select_from(exec_jobs)
    .where(
        exec_jobs.c.tenant_id == bindparam("b_tenant_id"),
        exec_jobs.c.state.in_(("queued", "running")),
    )
)
_SELECT_LIMITS = select(tenant_limits).where(tenant_limits.c.tenant_id == bindparam("b_tenant_id"))

# --- rate limit: refill and take in one statement (no lock, no read)
_NOW_S = bindparam("b_now", type_=Float)
_RPS = bindparam("b_rps", type_=Float)
_BURST = bindparam("b_burst", type_=Float)
_ELAPSED = case(
    (_NOW_S > rate_buckets.c.refilled_at, _NOW_S - rate_buckets.c.refilled_at),
    else_=literal(0.0, Float),
)
_REFILLED = rate_buckets.c.tokens + _ELAPSED * _RPS
_LEVEL = case((_REFILLED > _BURST, _BURST), else_=_REFILLED)
_TAKE_TOKEN = (
    update(rate_buckets)
    # (a hair under 1: refills in float arithmetic land just below whole tokens)
    .where(rate_buckets.c.tenant_id == bindparam("b_tenant_id"), _LEVEL >= 1.0 - 1e-9)
    .values(
        tokens=case((_LEVEL > 1.0, _LEVEL - 1.0), else_=literal(0.0, Float)),
        refilled_at=case(
            (_NOW_S > rate_buckets.c.refilled_at, _NOW_S), else_=rate_buckets.c.refilled_at
        ),
    )
)
_READ_LEVEL = select(_LEVEL.label("level")).where(
    rate_buckets.c.tenant_id == bindparam("b_tenant_id")
)

# --- queue
_GUARD_QUEUE = (
    update(admission_locks)
    .where(admission_locks.c.name == bindparam("b_name"))
    .values(touched=admission_locks.c.touched + 1)
)
_PURGE_TICKETS = delete(admission_tickets).where(
    admission_tickets.c.expires_at < bindparam("b_now")
)
_LIVE_TICKETS = (
    select(func.count())
    .select_from(admission_tickets)
    .where(admission_tickets.c.expires_at >= bindparam("b_now"))
)
_INSERT_TICKET = insert(admission_tickets).returning(admission_tickets.c.id)


def _position_statement(*, share: bool) -> Any:
    """The live tickets served before `b_id`, in one statement (`sandgate.core.fair_queue`):
    a ticket's turn is its rank among its tenant's live tickets plus the tenant's live
    sandboxes created since its oldest live ticket (placed during its streak); served by
    turn, then by id. With a share, a tenant whose live sandboxes are at least `b_share` of
    the connected workers' capacity is held behind the others. No row: the ticket is not
    live."""
    live = (
        select(
            admission_tickets.c.id, admission_tickets.c.tenant_id, admission_tickets.c.created_at
        )
        .where(admission_tickets.c.expires_at >= bindparam("b_now"))
        .cte("live_tickets")
    )
    streaks = (
        select(live.c.tenant_id, func.min(live.c.created_at).label("since"))
        .group_by(live.c.tenant_id)
        .cte("tenant_streaks")
    )
    # the waiting tenants' live sandboxes: at most the fleet's capacity, by the state index
    holding = (
        select(
            streaks.c.tenant_id,
            func.count().label("live"),
            func.sum(case((sandboxes.c.created_at >= streaks.c.since, 1), else_=0)).label("served"),
        )
        .select_from(streaks.join(sandboxes, sandboxes.c.tenant_id == streaks.c.tenant_id))
        .where(sandboxes.c.state.in_(("pending", "running")))
        .group_by(streaks.c.tenant_id)
        .cte("tenant_holding")
    )
    rank = func.row_number().over(partition_by=live.c.tenant_id, order_by=live.c.id)
    turn = rank + func.coalesce(holding.c.served, 0)
    columns: list[Any] = [live.c.id, turn.label("turn")]
    source: Any = live.outerjoin(holding, holding.c.tenant_id == live.c.tenant_id)
    if share:
        connected = (
            select(func.coalesce(func.sum(workers.c.capacity), 0).label("capacity"))
            .select_from(workers.join(tunnel_owners, tunnel_owners.c.tunnel_key == workers.c.name))
            .where(tunnel_owners.c.updated_at >= bindparam("b_connected_since"))
            .cte("connected_capacity")
        )
        source = source.join(connected, true())
        # core.fair_queue.at_share: live / capacity >= share, each rounded once
        at_share = and_(
            connected.c.capacity > 0,
            sql_cast(func.coalesce(holding.c.live, 0), Float)
            / sql_cast(connected.c.capacity, Float)
            >= bindparam("b_share", type_=Float),
        )
        columns.append(case((at_share, 1), else_=0).label("held"))
    ranked = select(*columns).select_from(source).cte("ranked_tickets")
    key = (ranked.c.held, ranked.c.turn, ranked.c.id) if share else (ranked.c.turn, ranked.c.id)
    ordered = select(
        ranked.c.id, (func.row_number().over(order_by=key) - 1).label("ahead")
    ).subquery("ordered_tickets")
    return select(ordered.c.ahead).where(ordered.c.id == bindparam("b_id", type_=Integer))


_POSITION = _position_statement(share=False)
_POSITION_WITH_SHARE = _position_statement(share=True)
_RENEW_TICKET = (
    update(admission_tickets)
    .where(admission_tickets.c.id == bindparam("b_id", type_=Integer))
    .values(expires_at=bindparam("b_expires_at"))
)
_DELETE_TICKET = delete(admission_tickets).where(
    admission_tickets.c.id == bindparam("b_id", type_=Integer)
)

# --- breaker
_IS_SCHEDULING = breakers.c.name == breaker.SCHEDULING
_SNAPSHOT = select(breakers, _LIVE_TICKETS.scalar_subquery().label("queued")).where(_IS_SCHEDULING)
_GUARD_BREAKER = update(breakers).where(_IS_SCHEDULING).values(updated_at=breakers.c.updated_at)
_SELECT_BREAKER = select(breakers).where(_IS_SCHEDULING)
_INSERT_TIMEOUT = insert(scheduling_timeouts)
_PURGE_TIMEOUTS = delete(scheduling_timeouts).where(
    scheduling_timeouts.c.at < bindparam("b_before")
)
_COUNT_TIMEOUTS = (
    select(func.count())
    .select_from(scheduling_timeouts)
    .where(scheduling_timeouts.c.at >= bindparam("b_since"))
)
_LIST_TIMEOUTS = (
    select(scheduling_timeouts)
    .where(scheduling_timeouts.c.at >= bindparam("b_since"))
    .order_by(scheduling_timeouts.c.id.desc())
    .limit(bindparam("b_limit", type_=Integer))
)
_WRITE_BREAKER = (
    update(breakers)
    .where(_IS_SCHEDULING)
    .values(
        state=bindparam("b_state"),
        reason=bindparam("b_reason"),
        opened_at=bindparam("b_opened_at"),
        open_until=bindparam("b_open_until"),
        trial=bindparam("b_trial"),
        trial_at=bindparam("b_trial_at"),
        closed_at=bindparam("b_closed_at"),
        updated_at=bindparam("b_updated_at"),
    )
)
_CLAIM_TRIAL = (
    update(breakers)
    .where(
        _IS_SCHEDULING,
        or_(
            and_(breakers.c.state == "open", breakers.c.open_until <= bindparam("b_now")),
            and_(
                breakers.c.state == "half_open", breakers.c.trial_at <= bindparam("b_stale_before")
            ),
        ),
    )
    .values(
        state="half_open",
        trial=bindparam("b_trial"),
        trial_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
    )
)
_TRIAL_SUCCEEDED = (
    update(breakers)
    .where(_IS_SCHEDULING, breakers.c.state == "half_open")
    .where(breakers.c.trial == bindparam("b_trial"))
    .values(
        state="closed",
        reason=None,
        opened_at=None,
        open_until=None,
        trial=None,
        trial_at=None,
        closed_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
    )
)
_TRIAL_INCONCLUSIVE = (
    update(breakers)
    .where(_IS_SCHEDULING, breakers.c.state == "half_open")
    .where(breakers.c.trial == bindparam("b_trial"))
    .values(
        state="open",
        open_until=bindparam("b_now"),
        trial=None,
        trial_at=None,
        updated_at=bindparam("b_now"),
    )
)


class _AdmissionStatements:
    """The inserts whose ON CONFLICT clause differs per dialect."""

    def __init__(self, dialect_name: str) -> None:
        dialect_insert = sqlite_dialect.insert if dialect_name == "sqlite" else pg.insert
        limits_ins = dialect_insert(tenant_limits)
        self.upsert_limits = limits_ins.on_conflict_do_update(
            index_elements=[tenant_limits.c.tenant_id],
            set_={
                "rps": limits_ins.excluded.rps,
                "burst": limits_ins.excluded.burst,
                "max_sandboxes": limits_ins.excluded.max_sandboxes,
                "max_exec_jobs": limits_ins.excluded.max_exec_jobs,
                "updated_at": limits_ins.excluded.updated_at,
            },
        )
        self.insert_bucket = dialect_insert(rate_buckets).on_conflict_do_nothing(
            index_elements=[rate_buckets.c.tenant_id]
        )
        self.insert_lock = dialect_insert(admission_locks).on_conflict_do_nothing(
            index_elements=[admission_locks.c.name]
        )
        self.insert_breaker = dialect_insert(breakers).on_conflict_do_nothing(
            index_elements=[breakers.c.name]
        )


_STATEMENTS: Final = MappingProxyType(
    {name: _AdmissionStatements(name) for name in ("sqlite", "postgresql")}
)


def _breaker(row: Row[Any] | None) -> BreakerRecord:
    if row is None:  # a database migrated before its row was seeded: closed
        return breaker.CLOSED_AT_START
    return BreakerRecord(
        state=cast(breaker.BreakerStateName, row.state),
        updated_at=row.updated_at,
        reason=row.reason,
        opened_at=row.opened_at,
        open_until=row.open_until,
        trial=row.trial,
        trial_at=row.trial_at,
        closed_at=row.closed_at,
    )


def _breaker_params(record: BreakerRecord) -> dict[str, Any]:
    return {
        "b_state": record.state,
        "b_reason": record.reason,
        "b_opened_at": record.opened_at,
        "b_open_until": record.open_until,
        "b_trial": record.trial,
        "b_trial_at": record.trial_at,
        "b_closed_at": record.closed_at,
        "b_updated_at": record.updated_at,
    }


async def _lock(
    conn: AsyncConnection, guard: Any, params: dict[str, Any], seed: Any, row: dict[str, Any]
) -> None:
    """Lock a guard row by writing it, first seeding it if a database lacks it (the
    migration seeds it; the insert does nothing if another transaction got there first)."""
    if (await conn.execute(guard, params)).rowcount != 1:
        await conn.execute(seed, row)
        await conn.execute(guard, params)


async def lock_tenant_limits(conn: AsyncConnection, tenant_id: TenantId) -> bool:
    """First statement of a transaction that checks a quota: lock the tenant's limits row.
    False: the tenant has no limits row (they were removed meanwhile): nothing to hold."""
    return (await conn.execute(_GUARD_TENANT, {"b_tenant_id": tenant_id})).rowcount == 1


async def check_quota(
    conn: AsyncConnection, tenant_id: TenantId, limit: int, *, exec_jobs_quota: bool
) -> None:
    """With the limits row locked and the new row inserted: over the quota raises (the
    transaction then rolls back, new row included)."""
    count_stmt = _COUNT_ACTIVE_EXEC_JOBS if exec_jobs_quota else _COUNT_LIVE_SANDBOXES
    live = int((await conn.execute(count_stmt, {"b_tenant_id": tenant_id})).scalar_one())
    if live > limit:
        raise QuotaConflictError(f"{live - 1} already, the quota is {limit}", live=live - 1)


class AdmissionQueries:
    """The admission half of `SqlStore` (mixed in; uses its engine and helpers)."""

    if TYPE_CHECKING:
        _engine: AsyncEngine
        _counters: AsyncEngine

        @property
        def dialect(self) -> str: ...

        def _single(self) -> AbstractAsyncContextManager[AsyncConnection]: ...
        async def _fetch_one(self, stmt: Any, params: Mapping[str, Any]) -> Row[Any] | None: ...
        async def _fetch_all(self, stmt: Any, params: Mapping[str, Any]) -> list[Row[Any]]: ...
        async def _write(self, stmt: Any, params: Mapping[str, Any]) -> int: ...

    @property
    def _admission(self) -> _AdmissionStatements:
        return _STATEMENTS[self.dialect]

    # --- tenant limits

    @store_op
    async def set_tenant_limits(self, limits: TenantLimits, now: datetime) -> None:
        await self._write(
            self._admission.upsert_limits,
            {
                "tenant_id": limits.tenant_id,
                "rps": limits.rps,
                "burst": limits.burst,
                "max_sandboxes": limits.max_sandboxes,
                "max_exec_jobs": limits.max_exec_jobs,
                "guard": 0,
                "updated_at": now,
            },
        )

    @store_op
    async def get_tenant_limits(self, tenant_id: TenantId) -> TenantLimits | None:
        row = await self._fetch_one(_SELECT_LIMITS, {"b_tenant_id": tenant_id})
        if row is None or row.tenant_id != tenant_id:
            return None
        return TenantLimits(
            tenant_id=TenantId(row.tenant_id),
            rps=row.rps,
            burst=row.burst,
            max_sandboxes=row.max_sandboxes,
            max_exec_jobs=row.max_exec_jobs,
        )

    @store_op
    async def count_tenant_live_sandboxes(self, tenant_id: TenantId) -> int:
        row = await self._fetch_one(_COUNT_LIVE_SANDBOXES, {"b_tenant_id": tenant_id})
        return 0 if row is None else int(row[0])

    @store_op
    async def take_rate_token(
        self, tenant_id: TenantId, rps: float, burst: int, now: float
    ) -> float:
        if rps <= 0 or burst < 1:
            raise StoreError("a rate limit needs rps > 0 and burst >= 1")
        params = {"b_tenant_id": tenant_id, "b_now": now, "b_rps": rps, "b_burst": float(burst)}
        for _ in range(2):
            async with self._counters.connect() as conn:
                if (await conn.execute(_TAKE_TOKEN, params)).rowcount == 1:
                    await conn.commit()  # a no-op in autocommit; pysqlite needs it
                    return 0.0
                row = (await conn.execute(_READ_LEVEL, params)).first()
                if row is not None:
                    return max((1.0 - float(row.level)) / rps, 1e-3)
                # the tenant's first request: a full bucket, less this one
                seed = {"tenant_id": tenant_id, "tokens": float(burst) - 1.0, "refilled_at": now}
                inserted = (await conn.execute(self._admission.insert_bucket, seed)).rowcount
                await conn.commit()
                if inserted == 1:
                    return 0.0
        raise StoreError("the rate bucket could not be read")  # pragma: no cover

    # --- the create queue

    @store_op
    async def admission_snapshot(self, now: datetime) -> AdmissionSnapshot:
        row = await self._fetch_one(_SNAPSHOT, {"b_now": now})
        if row is None:
            queued = await self._fetch_one(_LIVE_TICKETS, {"b_now": now})
            return AdmissionSnapshot(breaker.CLOSED_AT_START, int(queued[0]) if queued else 0)
        return AdmissionSnapshot(_breaker(row), int(row.queued))

    @store_op
    async def enqueue_create(
        self, tenant_id: TenantId, node_url: str, now: datetime, expires_at: datetime, limit: int
    ) -> int | None:
        async with self._engine.begin() as conn:
            lock_row = {"name": QUEUE_LOCK, "touched": 0}
            await _lock(
                conn, _GUARD_QUEUE, {"b_name": QUEUE_LOCK}, self._admission.insert_lock, lock_row
            )
            await conn.execute(_PURGE_TICKETS, {"b_now": now})
            queued = int((await conn.execute(_LIVE_TICKETS, {"b_now": now})).scalar_one())
            if queued >= limit:
                return None
            result = await conn.execute(
                _INSERT_TICKET,
                {
                    "tenant_id": tenant_id,
                    "node_url": node_url,
                    "created_at": now,
                    "expires_at": expires_at,
                },
            )
            return int(result.scalar_one())

    @store_op
    async def queue_position(
        self, ticket: int, now: datetime, share: TenantShare | None = None
    ) -> int | None:
        params: dict[str, Any] = {"b_id": ticket, "b_now": now}
        stmt = _POSITION
        if share is not None:
            stmt = _POSITION_WITH_SHARE
            params |= {"b_share": share.fraction, "b_connected_since": share.connected_since}
        row = await self._fetch_one(stmt, params)
        return None if row is None else int(row.ahead)

    @store_op
    async def renew_ticket(self, ticket: int, expires_at: datetime) -> bool:
        return await self._write(_RENEW_TICKET, {"b_id": ticket, "b_expires_at": expires_at}) == 1

    @store_op
    async def leave_queue(self, ticket: int) -> None:
        await self._write(_DELETE_TICKET, {"b_id": ticket})

    # --- the scheduling breaker

    @store_op
    async def record_scheduling_timeout(
        self, event: SchedulingTimeout, policy: BreakerPolicy
    ) -> BreakerRecord:
        now = event.at
        async with self._engine.begin() as conn:
            closed = {"name": breaker.SCHEDULING, "state": "closed", "updated_at": now}
            await _lock(conn, _GUARD_BREAKER, {}, self._admission.insert_breaker, closed)
            record = _breaker((await conn.execute(_SELECT_BREAKER)).first())
            await conn.execute(
                _PURGE_TIMEOUTS, {"b_before": now - timedelta(seconds=policy.window)}
            )
            await conn.execute(
                _INSERT_TIMEOUT,
                {
                    "at": now,
                    "sandbox_name": event.sandbox_name,
                    "tenant_id": event.tenant_id,
                    "node_url": event.node_url,
                    "reason": event.reason,
                },
            )
            since = breaker.window_start(record, now, policy)
            counted = int((await conn.execute(_COUNT_TIMEOUTS, {"b_since": since})).scalar_one())
            changed = breaker.after_timeout(
                record, counted, event.sandbox_name, event.reason, now, policy
            )
            if changed is None:
                return record
            await conn.execute(_WRITE_BREAKER, _breaker_params(changed))
            return changed

    @store_op
    async def list_scheduling_timeouts(
        self, since: datetime, limit: int
    ) -> list[SchedulingTimeout]:
        rows = await self._fetch_all(_LIST_TIMEOUTS, {"b_since": since, "b_limit": limit})
        return [
            SchedulingTimeout(
                at=r.at,
                sandbox_name=SandboxName(r.sandbox_name),
                tenant_id=TenantId(r.tenant_id),
                node_url=r.node_url,
                reason=r.reason,
            )
            for r in rows
        ]

    @store_op
    async def claim_breaker_trial(self, trial: str, now: datetime, stale_before: datetime) -> bool:
        params = {"b_trial": trial, "b_now": now, "b_stale_before": stale_before}
        return await self._write(_CLAIM_TRIAL, params) == 1

    @store_op
    async def conclude_breaker_trial(self, trial: str, success: bool, now: datetime) -> bool:
        stmt = _TRIAL_SUCCEEDED if success else _TRIAL_INCONCLUSIVE
        return await self._write(stmt, {"b_trial": trial, "b_now": now}) == 1
