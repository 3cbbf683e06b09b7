"""The scheduling breaker in SQL: its one row, and the scheduling timeouts it counts.

A timeout is recorded under the breaker row's lock (written first, as `admission` explains),
so N instances count one window; the transitions themselves are computed by
`sandgate.core.breaker`. A trial is claimed and concluded by conditional UPDATEs.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import Integer, and_, bindparam, delete, func, insert, or_, select, update

from sandgate.core import breaker
from sandgate.core.breaker import BreakerPolicy, BreakerRecord
from sandgate.store.base import SchedulingTimeout, TenantId
from sandgate.store.ops import store_op
from sandgate.store.schema import breakers, scheduling_timeouts
from sandgate.store.sql import rows
from sandgate.store.sql.admission import lock_guard
from sandgate.store.sql.engine import Database, PerDialect, dialect_insert

_IS_SCHEDULING = breakers.c.name == breaker.SCHEDULING
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
# tenant-scoped view (GET /api/v1/admission)
_LIST_TENANT_TIMEOUTS = (
    select(scheduling_timeouts)
    .where(
        scheduling_timeouts.c.tenant_id == bindparam("b_tenant_id"),
        scheduling_timeouts.c.at >= bindparam("b_since"),
    )
    .order_by(scheduling_timeouts.c.id.desc())
    .limit(bindparam("b_limit", type_=Integer))
)
_INSERT_BREAKER: Final = PerDialect(
    lambda dialect: dialect_insert(dialect, breakers).on_conflict_do_nothing(
        index_elements=[breakers.c.name]
    )
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


class Breaker:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._insert_breaker = _INSERT_BREAKER.of(db)

    # --- the scheduling breaker

    @store_op
    async def record_scheduling_timeout(
        self, event: SchedulingTimeout, policy: BreakerPolicy
    ) -> BreakerRecord:
        now = event.at
        async with self._db.begin() as conn:
            closed = {"name": breaker.SCHEDULING, "state": "closed", "updated_at": now}
            await lock_guard(conn, _GUARD_BREAKER, {}, self._insert_breaker, closed)
            record = rows.breaker_record((await conn.execute(_SELECT_BREAKER)).first())
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
        params = {"b_since": since, "b_limit": limit}
        found = await self._db.fetch_all(_LIST_TIMEOUTS, params)
        return [rows.scheduling_timeout(r) for r in found]

    @store_op
    async def list_tenant_scheduling_timeouts(
        self, tenant_id: TenantId, since: datetime, limit: int
    ) -> list[SchedulingTimeout]:
        params = {"b_tenant_id": tenant_id, "b_since": since, "b_limit": limit}
        found = await self._db.fetch_all(_LIST_TENANT_TIMEOUTS, params)
        return [rows.scheduling_timeout(r) for r in found]

    @store_op
    async def claim_breaker_trial(self, trial: str, now: datetime, stale_before: datetime) -> bool:
        params = {"b_trial": trial, "b_now": now, "b_stale_before": stale_before}
        return await self._db.write(_CLAIM_TRIAL, params) == 1

    @store_op
    async def conclude_breaker_trial(self, trial: str, success: bool, now: datetime) -> bool:
        stmt = _TRIAL_SUCCEEDED if success else _TRIAL_INCONCLUSIVE
        return await self._db.write(stmt, {"b_trial": trial, "b_now": now}) == 1
