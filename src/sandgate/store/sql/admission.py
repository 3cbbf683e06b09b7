"""Admission in SQL: tenant limits and quotas, token buckets, and the create queue.

Each check-and-take is one transaction whose *first* statement is a write to the row that
guards it (an `UPDATE` of the limits row, the queue's lock row or the breaker row, in
`breaker`). On PostgreSQL that row lock serializes the check across every instance; on SQLite
the first write takes the database's write lock, so a transaction never has to upgrade a read
lock. That is what makes the counts exact under N instances: nothing here is counted in
memory. The rate limit needs no lock at all: one conditional `UPDATE` refills and takes a
token. `lock_tenant_limits` and `check_quota` are the quota's two steps inside the create
transactions of `sandboxes` and `exec_jobs`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

from sqlalchemy import (
    Float,
    Integer,
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    select,
    true,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.ext.asyncio import AsyncConnection

from sandgate.core import breaker
from sandgate.errors import QuotaConflictError, StoreError
from sandgate.store.base import AdmissionSnapshot, TenantId, TenantLimits, TenantShare
from sandgate.store.ops import store_op
from sandgate.store.schema import (
    admission_locks,
    admission_tickets,
    breakers,
    exec_jobs,
    rate_buckets,
    sandboxes,
    tenant_limits,
    tunnel_owners,
    workers,
)
from sandgate.store.sql import rows
from sandgate.store.sql.engine import Database, PerDialect, dialect_insert

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
_COUNT_TENANT_TICKETS = (
    select(func.count())
    .select_from(admission_tickets)
    .where(
        admission_tickets.c.tenant_id == bindparam("b_tenant_id"),
        admission_tickets.c.expires_at >= bindparam("b_now"),
    )
)
# one read for the create path: the scheduling breaker and how many wait in the queue
_SNAPSHOT = select(breakers, _LIVE_TICKETS.scalar_subquery().label("queued")).where(
    breakers.c.name == breaker.SCHEDULING
)


class _Upserts:
    """Admission's inserts whose ON CONFLICT clause differs per dialect."""

    def __init__(self, dialect: str) -> None:
        limits_ins = dialect_insert(dialect, tenant_limits)
        self.upsert_limits: Final = limits_ins.on_conflict_do_update(
            index_elements=[tenant_limits.c.tenant_id],
            set_={
                "rps": limits_ins.excluded.rps,
                "burst": limits_ins.excluded.burst,
                "max_sandboxes": limits_ins.excluded.max_sandboxes,
                "max_exec_jobs": limits_ins.excluded.max_exec_jobs,
                "updated_at": limits_ins.excluded.updated_at,
            },
        )
        self.insert_bucket: Final = dialect_insert(dialect, rate_buckets).on_conflict_do_nothing(
            index_elements=[rate_buckets.c.tenant_id]
        )
        self.insert_lock: Final = dialect_insert(dialect, admission_locks).on_conflict_do_nothing(
            index_elements=[admission_locks.c.name]
        )


_UPSERTS: Final = PerDialect(_Upserts)


async def lock_guard(
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


class Admission:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._upserts = _UPSERTS.of(db)

    # --- tenant limits

    @store_op
    async def set_tenant_limits(self, limits: TenantLimits, now: datetime) -> None:
        await self._db.write(
            self._upserts.upsert_limits,
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
        row = await self._db.fetch_one(_SELECT_LIMITS, {"b_tenant_id": tenant_id})
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
        row = await self._db.fetch_one(_COUNT_LIVE_SANDBOXES, {"b_tenant_id": tenant_id})
        return 0 if row is None else int(row[0])

    @store_op
    async def take_rate_token(
        self, tenant_id: TenantId, rps: float, burst: int, now: float
    ) -> float:
        if rps <= 0 or burst < 1:
            raise StoreError("a rate limit needs rps > 0 and burst >= 1")
        params = {"b_tenant_id": tenant_id, "b_now": now, "b_rps": rps, "b_burst": float(burst)}
        for _ in range(2):
            async with self._db.counters.connect() as conn:
                if (await conn.execute(_TAKE_TOKEN, params)).rowcount == 1:
                    await conn.commit()  # a no-op in autocommit; pysqlite needs it
                    return 0.0
                row = (await conn.execute(_READ_LEVEL, params)).first()
                if row is not None:
                    return max((1.0 - float(row.level)) / rps, 1e-3)
                # the tenant's first request: a full bucket, less this one
                seed = {"tenant_id": tenant_id, "tokens": float(burst) - 1.0, "refilled_at": now}
                inserted = (await conn.execute(self._upserts.insert_bucket, seed)).rowcount
                await conn.commit()
                if inserted == 1:
                    return 0.0
        raise StoreError("the rate bucket could not be read")  # pragma: no cover

    # --- the create queue

    @store_op
    async def admission_snapshot(self, now: datetime) -> AdmissionSnapshot:
        row = await self._db.fetch_one(_SNAPSHOT, {"b_now": now})
        if row is None:
            queued = await self._db.fetch_one(_LIVE_TICKETS, {"b_now": now})
            return AdmissionSnapshot(breaker.CLOSED_AT_START, int(queued[0]) if queued else 0)
        return AdmissionSnapshot(rows.breaker_record(row), int(row.queued))

    @store_op
    async def enqueue_create(
        self, tenant_id: TenantId, node_url: str, now: datetime, expires_at: datetime, limit: int
    ) -> int | None:
        async with self._db.begin() as conn:
            lock_row = {"name": QUEUE_LOCK, "touched": 0}
            await lock_guard(
                conn, _GUARD_QUEUE, {"b_name": QUEUE_LOCK}, self._upserts.insert_lock, lock_row
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
        row = await self._db.fetch_one(stmt, params)
        return None if row is None else int(row.ahead)

    @store_op
    async def renew_ticket(self, ticket: int, expires_at: datetime) -> bool:
        params = {"b_id": ticket, "b_expires_at": expires_at}
        return await self._db.write(_RENEW_TICKET, params) == 1

    @store_op
    async def leave_queue(self, ticket: int) -> None:
        await self._db.write(_DELETE_TICKET, {"b_id": ticket})

    @store_op
    async def count_tenant_queued(self, tenant_id: TenantId, now: datetime) -> int:
        row = await self._db.fetch_one(
            _COUNT_TENANT_TICKETS, {"b_tenant_id": tenant_id, "b_now": now}
        )
        return 0 if row is None else int(row[0])
