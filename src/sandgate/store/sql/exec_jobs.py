"""Exec jobs: accepted once per Idempotency-Key, moved queued -> running -> succeeded/failed by
conditional UPDATEs, never re-run; recovery fails the orphaned and the overdue ones."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

from sqlalchemy import and_, bindparam, delete, exists, literal, or_, select, update

from sandgate.errors import IdempotencyConflictError, StoreError
from sandgate.store.base import (
    ORPHANED_EXEC_JOB,
    ExecJob,
    ExecJobId,
    ExecResult,
    SandboxName,
    TenantId,
)
from sandgate.store.ops import store_op
from sandgate.store.schema import exec_jobs, instances, sandboxes
from sandgate.store.sql import rows
from sandgate.store.sql.admission import check_quota, lock_tenant_limits
from sandgate.store.sql.engine import Database, PerDialect, dialect_insert

_UNFINISHED_EXEC = ("queued", "running")

# a NULL digest (no key) never matches the unique (tenant_id, digest) constraint
_INSERT_EXEC_JOB: Final = PerDialect(
    lambda dialect: dialect_insert(dialect, exec_jobs).on_conflict_do_nothing(
        index_elements=[exec_jobs.c.tenant_id, exec_jobs.c.digest]
    )
)
_SELECT_EXEC_JOB = select(exec_jobs).where(
    exec_jobs.c.id == bindparam("b_id"), exec_jobs.c.tenant_id == bindparam("b_tenant_id")
)
_SELECT_EXEC_JOB_BY_DIGEST = select(exec_jobs).where(
    exec_jobs.c.tenant_id == bindparam("b_tenant_id"),
    exec_jobs.c.digest == bindparam("b_digest"),
)
# lists never carry output (a job's output is read one job at a time): every column but it
_EXEC_JOB_SUMMARY = tuple(c for c in exec_jobs.c if c.name not in ("stdout", "stderr"))
_LIST_EXEC_JOBS = (
    select(*_EXEC_JOB_SUMMARY)
    .where(
        exec_jobs.c.sandbox_name == bindparam("b_sandbox_name"),
        exec_jobs.c.tenant_id == bindparam("b_tenant_id"),
    )
    .order_by(exec_jobs.c.created_at.desc(), exec_jobs.c.id.desc())
    .limit(bindparam("b_limit"))
)
_LIST_EXEC_JOBS_AFTER = _LIST_EXEC_JOBS.where(
    or_(
        exec_jobs.c.created_at < bindparam("b_before_at"),
        and_(
            exec_jobs.c.created_at == bindparam("b_before_at"),
            exec_jobs.c.id < bindparam("b_before_id"),
        ),
    )
)
# finished jobs past their retention, or of a sandbox that is gone: deleted with their output
_SWEEP_EXEC_JOBS = delete(exec_jobs).where(
    exec_jobs.c.id.in_(
        select(exec_jobs.c.id)
        .where(
            exec_jobs.c.state.in_(("succeeded", "failed")),
            or_(
                exec_jobs.c.finished_at < bindparam("b_ended_before"),
                ~exists().where(
                    sandboxes.c.name == exec_jobs.c.sandbox_name,
                    sandboxes.c.state.in_(("pending", "running")),
                ),
            ),
        )
        .limit(bindparam("b_limit"))
        .scalar_subquery()
    )
)
_START_EXEC_JOB = (
    update(exec_jobs)
    .where(exec_jobs.c.id == bindparam("b_id"), exec_jobs.c.state == "queued")
    .values(
        state="running",
        claimed_by=bindparam("b_claimed_by"),
        started_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
        deadline_at=bindparam("b_deadline"),
    )
)
_FINISH_EXEC_JOB = (
    update(exec_jobs)
    .where(exec_jobs.c.id == bindparam("b_id"), exec_jobs.c.state == "running")
    .values(
        state=bindparam("b_state"),
        exit_code=bindparam("b_exit_code"),
        stdout=bindparam("b_stdout"),
        stderr=bindparam("b_stderr"),
        stdout_truncated=bindparam("b_stdout_truncated"),
        stderr_truncated=bindparam("b_stderr_truncated"),
        error=bindparam("b_error"),
        finished_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
    )
)
_FAIL_ORPHANED_EXEC_JOBS = (
    update(exec_jobs)
    .where(
        exec_jobs.c.state.in_(_UNFINISHED_EXEC),
        exec_jobs.c.updated_at < bindparam("b_dead_before"),
        ~exists(
            select(literal(1))
            .select_from(instances)
            .where(
                instances.c.node_url == exec_jobs.c.claimed_by,
                instances.c.heartbeat_at >= bindparam("b_dead_before"),
            )
        ),
    )
    .values(
        state="failed",
        error=ORPHANED_EXEC_JOB,
        finished_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
    )
)
_LIST_OVERDUE_EXEC_JOBS = (
    select(exec_jobs)
    .where(
        or_(
            # a job starts right after it is accepted: queued this long, it never will
            (exec_jobs.c.state == "queued") & (exec_jobs.c.updated_at < bindparam("b_before")),
            # the agent kills a job at its timeout: running past it, its result was lost
            (exec_jobs.c.state == "running") & (exec_jobs.c.deadline_at < bindparam("b_before")),
        )
    )
    .order_by(exec_jobs.c.updated_at)
    .limit(bindparam("b_limit"))
)
_FAIL_EXEC_JOB_AS_SEEN = (
    update(exec_jobs)
    .where(
        exec_jobs.c.id == bindparam("b_id"),
        exec_jobs.c.state == bindparam("b_seen_state"),
        exec_jobs.c.updated_at == bindparam("b_seen_at"),
    )
    .values(
        state="failed",
        error=bindparam("b_error"),
        finished_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
    )
)
_FAIL_INSTANCE_EXEC_JOBS = (
    update(exec_jobs)
    .where(
        exec_jobs.c.state.in_(_UNFINISHED_EXEC),
        exec_jobs.c.claimed_by == bindparam("b_node_url"),
    )
    .values(
        state="failed",
        error=bindparam("b_error"),
        finished_at=bindparam("b_now"),
        updated_at=bindparam("b_now"),
    )
)


class ExecJobs:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._insert_exec_job = _INSERT_EXEC_JOB.of(db)

    @store_op
    async def insert_exec_job(self, job: ExecJob, *, max_active: int | None = None) -> None:
        if (job.digest is None) != (job.fingerprint is None):
            raise StoreError("an exec job has both a digest and a fingerprint, or neither")
        async with self._db.begin() as conn:  # tenant limits -> key, as insert_sandbox
            quota = max_active is not None and await lock_tenant_limits(conn, job.tenant_id)
            result = await conn.execute(
                self._insert_exec_job,
                {
                    "id": job.id,
                    "tenant_id": job.tenant_id,
                    "sandbox_name": job.sandbox_name,
                    "digest": job.digest,
                    "fingerprint": job.fingerprint,
                    "command": job.command,
                    "timeout": job.timeout,
                    "state": job.state,
                    "exit_code": job.exit_code,
                    "stdout": job.stdout,
                    "stderr": job.stderr,
                    "stdout_truncated": job.stdout_truncated,
                    "stderr_truncated": job.stderr_truncated,
                    "error": job.error,
                    "claimed_by": job.claimed_by,
                    "created_at": job.created_at,
                    "started_at": job.started_at,
                    "finished_at": job.finished_at,
                    "updated_at": job.updated_at,
                },
            )
            if result.rowcount != 1:
                raise IdempotencyConflictError("an exec job with this Idempotency-Key exists")
            if quota:
                assert max_active is not None
                await check_quota(conn, job.tenant_id, max_active, exec_jobs_quota=True)

    @store_op
    async def get_exec_job(self, tenant_id: TenantId, job_id: ExecJobId) -> ExecJob | None:
        row = await self._db.fetch_one(_SELECT_EXEC_JOB, {"b_id": job_id, "b_tenant_id": tenant_id})
        if row is None or row.tenant_id != tenant_id or row.id != job_id:
            return None
        return rows.exec_job(row)

    @store_op
    async def list_exec_jobs(
        self,
        tenant_id: TenantId,
        sandbox_name: SandboxName,
        limit: int,
        *,
        before: tuple[datetime, ExecJobId] | None = None,
    ) -> list[ExecJob]:
        if limit <= 0:
            return []
        params: dict[str, Any] = {
            "b_sandbox_name": sandbox_name,
            "b_tenant_id": tenant_id,
            "b_limit": limit,
        }
        statement = _LIST_EXEC_JOBS
        if before is not None:
            statement = _LIST_EXEC_JOBS_AFTER
            params |= {"b_before_at": before[0], "b_before_id": before[1]}
        listed = await self._db.fetch_all(statement, params)
        found = [rows.exec_job(r, output=False) for r in listed]
        return [j for j in found if j.tenant_id == tenant_id and j.sandbox_name == sandbox_name]

    @store_op
    async def sweep_exec_jobs(self, ended_before: datetime, limit: int) -> int:
        """Delete finished exec jobs that ended before `ended_before`, or whose sandbox is
        gone; at most `limit` per call. Returns how many."""
        return await self._db.write(
            _SWEEP_EXEC_JOBS, {"b_ended_before": ended_before, "b_limit": limit}
        )

    @store_op
    async def find_exec_job_by_digest(self, tenant_id: TenantId, digest: str) -> ExecJob | None:
        row = await self._db.fetch_one(
            _SELECT_EXEC_JOB_BY_DIGEST, {"b_tenant_id": tenant_id, "b_digest": digest}
        )
        if row is None or row.tenant_id != tenant_id or row.digest != digest:
            return None
        return rows.exec_job(row)

    @store_op
    async def start_exec_job(
        self,
        job_id: ExecJobId,
        claimed_by: str,
        now: datetime,
        *,
        deadline: datetime | None = None,
    ) -> bool:
        params = {"b_id": job_id, "b_claimed_by": claimed_by, "b_now": now, "b_deadline": deadline}
        return await self._db.write(_START_EXEC_JOB, params) == 1

    @store_op
    async def finish_exec_job(self, job_id: ExecJobId, result: ExecResult, now: datetime) -> bool:
        if result.state not in ("succeeded", "failed"):
            raise StoreError(f"an exec job cannot finish as {result.state!r}")
        moved = await self._db.write(
            _FINISH_EXEC_JOB,
            {
                "b_id": job_id,
                "b_state": result.state,
                "b_exit_code": result.exit_code,
                "b_stdout": result.stdout,
                "b_stderr": result.stderr,
                "b_stdout_truncated": result.stdout_truncated,
                "b_stderr_truncated": result.stderr_truncated,
                "b_error": result.error,
                "b_now": now,
            },
        )
        return moved == 1

    @store_op
    async def fail_orphaned_exec_jobs(self, dead_before: datetime, now: datetime) -> int:
        return await self._db.write(
            _FAIL_ORPHANED_EXEC_JOBS, {"b_dead_before": dead_before, "b_now": now}
        )

    @store_op
    async def list_overdue_exec_jobs(self, before: datetime, limit: int) -> list[ExecJob]:
        params = {"b_before": before, "b_limit": limit}
        return [rows.exec_job(r) for r in await self._db.fetch_all(_LIST_OVERDUE_EXEC_JOBS, params)]

    @store_op
    async def fail_exec_job_as_seen(self, job: ExecJob, error: str, now: datetime) -> bool:
        params = {
            "b_id": job.id,
            "b_seen_state": job.state,
            "b_seen_at": job.updated_at,
            "b_error": error,
            "b_now": now,
        }
        return await self._db.write(_FAIL_EXEC_JOB_AS_SEEN, params) == 1

    @store_op
    async def fail_instance_exec_jobs(self, node_url: str, error: str, now: datetime) -> int:
        return await self._db.write(
            _FAIL_INSTANCE_EXEC_JOBS, {"b_node_url": node_url, "b_error": error, "b_now": now}
        )
