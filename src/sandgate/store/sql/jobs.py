"""Create jobs: one per sandbox, written with it (`sandboxes`), finished once, and claimed by
compare-and-swap when recovery takes over a stale one."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from sqlalchemy import bindparam, select, update

from sandgate.store.base import Job, JobId, JobState, SandboxName, WorkerName
from sandgate.store.ops import store_op
from sandgate.store.schema import jobs, sandboxes
from sandgate.store.sql import rows
from sandgate.store.sql.engine import Database

_SELECT_JOB = select(jobs).where(jobs.c.id == bindparam("b_id"))
_FINISH_JOB = (
    update(jobs)
    .where(jobs.c.id == bindparam("b_id"), jobs.c.state == "pending")
    .values(state=bindparam("b_state"), error=bindparam("b_error"), updated_at=bindparam("b_now"))
)
_FAIL_SANDBOX_JOBS = (
    update(jobs)
    .where(jobs.c.sandbox_name == bindparam("b_name"), jobs.c.state == "pending")
    .values(state="failed", error=bindparam("b_error"), updated_at=bindparam("b_now"))
)
_SELECT_STALE_JOBS = (
    select(jobs)
    .where(jobs.c.state == "pending", jobs.c.updated_at < bindparam("b_before"))
    .order_by(jobs.c.updated_at, jobs.c.id)
    .limit(bindparam("b_limit"))
)
_SELECT_WORKER_PENDING_JOBS = (
    select(jobs)
    .join(sandboxes, sandboxes.c.name == jobs.c.sandbox_name)
    .where(
        jobs.c.state == "pending",
        jobs.c.updated_at < bindparam("b_before"),
        sandboxes.c.worker == bindparam("b_worker"),
    )
    .order_by(jobs.c.updated_at, jobs.c.id)
    .limit(bindparam("b_limit"))
)
_CLAIM_JOB = (
    update(jobs)
    .where(
        jobs.c.id == bindparam("b_id"),
        jobs.c.state == "pending",
        jobs.c.updated_at == bindparam("b_old_updated_at"),
        jobs.c.attempt == bindparam("b_old_attempt"),
    )
    .values(
        updated_at=bindparam("b_now"),
        attempt=bindparam("b_attempt"),
        claimed_by=bindparam("b_claimer"),
    )
)


class Jobs:
    def __init__(self, db: Database) -> None:
        self._db = db

    @store_op
    async def get_job(self, job_id: JobId) -> Job | None:
        row = await self._db.fetch_one(_SELECT_JOB, {"b_id": job_id})
        return None if row is None else rows.job(row)

    @store_op
    async def finish_job(
        self, job_id: JobId, state: JobState, *, error: str | None = None, now: datetime
    ) -> bool:
        moved = await self._db.write(
            _FINISH_JOB, {"b_id": job_id, "b_state": state, "b_error": error, "b_now": now}
        )
        return moved == 1

    @store_op
    async def fail_sandbox_jobs(self, name: SandboxName, error: str, now: datetime) -> int:
        return await self._db.write(
            _FAIL_SANDBOX_JOBS, {"b_name": name, "b_error": error, "b_now": now}
        )

    @store_op
    async def claim_stale_jobs(
        self,
        before: datetime,
        claimer: str,
        now: datetime,
        limit: int,
        *,
        worker: WorkerName | None = None,
    ) -> list[Job]:
        """Pending jobs last touched before `before` (of sandboxes placed on `worker`, if
        given), each won by compare-and-swap.

        The swap is on the job's `updated_at` and `attempt` as read: of N instances reading
        the same job, exactly one update matches; the others see zero rows and skip it.
        """
        if limit <= 0:
            return []
        if worker is None:
            found = await self._db.fetch_all(
                _SELECT_STALE_JOBS, {"b_before": before, "b_limit": limit}
            )
        else:
            found = await self._db.fetch_all(
                _SELECT_WORKER_PENDING_JOBS,
                {"b_before": before, "b_limit": limit, "b_worker": worker},
            )
        won = []
        for row in found:
            candidate = rows.job(row)
            moved = await self._db.write(
                _CLAIM_JOB,
                {
                    "b_id": candidate.id,
                    "b_old_updated_at": row.updated_at,
                    "b_old_attempt": candidate.attempt,
                    "b_now": now,
                    "b_attempt": candidate.attempt + 1,
                    "b_claimer": claimer,
                },
            )
            if moved == 1:
                won.append(replace(candidate, attempt=candidate.attempt + 1, updated_at=now))
        return won
