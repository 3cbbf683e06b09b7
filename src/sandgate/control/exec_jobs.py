"""Exec jobs: a bash command run once, in the background, in a running sandbox.

Accept: the job row (`queued`) is written to the store first; with an Idempotency-Key the
unique (tenant, digest) constraint decides which request's job it is, on any instance. Run:
the accepting instance moves it `queued -> running` (conditional), runs it through the same
agent exec path as `/execute`, and records `succeeded` or `failed`. A job is never re-run:
if its instance dies, recovery on another instance fails it with a reason
(`store.base.ORPHANED_EXEC_JOB`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from sandgate.config import ServerSettings
from sandgate.control.admission import Admission
from sandgate.control.sandboxes import SandboxService
from sandgate.control.state import ServerLocalState
from sandgate.control.toolbox import Toolbox
from sandgate.core import idempotency
from sandgate.core.clock import utcnow
from sandgate.errors import (
    IdempotencyConflictError,
    IdempotencyMismatchError,
    InvalidRequestError,
    NotFoundError,
    SandgateError,
    UnavailableError,
)
from sandgate.store.base import (
    ExecJob,
    ExecJobId,
    ExecResult,
    SandboxName,
    Store,
    TenantId,
)

log = logging.getLogger(__name__)

SHUTDOWN_ERROR = "the instance running it shut down before it finished; it was not re-run"
RESTART_ERROR = "the instance running it restarted; it was not re-run"
LIST_LIMIT = 100


@dataclass(frozen=True)
class ExecJobRequest:
    command: str
    timeout: float
    env: dict[str, str]
    cwd: str | None  # None: the sandbox's default (/workspace, or its template's WorkingDir)


@dataclass(frozen=True)
class SubmitResult:
    job: ExecJob
    replayed: bool


class ExecJobService:
    def __init__(
        self,
        store: Store,
        state: ServerLocalState,
        sandboxes: SandboxService,
        toolbox: Toolbox,
        settings: ServerSettings,
        admission: Admission,
        *,
        node_url: str,
    ) -> None:
        self.store = store
        self.state = state
        self.sandboxes = sandboxes
        self.toolbox = toolbox
        self.settings = settings
        self.admission = admission
        self.node_url = node_url

    # -- accept ------------------------------------------------------------------------------
    async def submit(
        self, tenant: TenantId, name: str, request: ExecJobRequest, idempotency_key: str | None
    ) -> SubmitResult:
        digest = fingerprint = None
        if idempotency_key is not None:
            problem = idempotency.validate_key(idempotency_key)
            if problem is not None:
                raise InvalidRequestError(problem, code="invalid_idempotency_key")
            digest = idempotency.digest(tenant, idempotency_key)
            fingerprint = idempotency.fingerprint(
                {
                    "sandbox": name,
                    "command": request.command,
                    "timeout": request.timeout,
                    "env": request.env,
                    "cwd": request.cwd,
                }
            )
            existing = await self._lookup(tenant, digest)
            if existing is not None:
                return SubmitResult(_replay(existing, fingerprint), replayed=True)
        sandbox = await self.sandboxes.running(tenant, name)  # 404 / 409 before accepting
        now = utcnow()
        job = ExecJob(
            id=ExecJobId(uuid.uuid4().hex),
            tenant_id=tenant,
            sandbox_name=sandbox.name,
            command=request.command,
            timeout=request.timeout,
            state="queued",
            created_at=now,
            updated_at=now,
            digest=digest,
            fingerprint=fingerprint,
            claimed_by=self.node_url,
        )

        async def insert(max_active: int | None) -> None:
            await self.store.insert_exec_job(job, max_active=max_active)

        try:
            await self.admission.within_quota(tenant, insert, exec_jobs=True)
        except IdempotencyConflictError:
            assert digest is not None and fingerprint is not None
            winner = await self.store.find_exec_job_by_digest(tenant, digest)
            if winner is None or winner.tenant_id != tenant:
                raise UnavailableError("exec job raced and lost its record; retry") from None
            return SubmitResult(_replay(winner, fingerprint), replayed=True)
        log.info("exec_job.accepted", extra={"job": job.id, "sandbox": sandbox.name})
        task = asyncio.create_task(self._run(job, request), name=f"exec-job-{job.id}")
        self.state.exec_job_tasks.add(task)
        task.add_done_callback(self.state.exec_job_tasks.discard)
        return SubmitResult(job, replayed=False)

    async def _lookup(self, tenant: TenantId, digest: str) -> ExecJob | None:
        """A failed lookup counts as not found: the unique constraint is the final word."""
        try:
            found = await self.store.find_exec_job_by_digest(tenant, digest)
        except Exception:
            log.warning("exec_job.lookup_failed", exc_info=True)
            return None
        if found is None or found.tenant_id != tenant or found.digest != digest:
            return None
        return found

    # -- run ---------------------------------------------------------------------------------
    async def _run(self, job: ExecJob, request: ExecJobRequest) -> None:
        try:
            now = utcnow()
            deadline = now + timedelta(seconds=job.timeout)
            if not await self.store.start_exec_job(job.id, self.node_url, now, deadline=deadline):
                return  # already failed (recovery or a restart): never run it
            result = await self._execute(job, request)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self.store.finish_exec_job(
                        job.id, ExecResult("failed", None, error=SHUTDOWN_ERROR), utcnow()
                    )
                )
            raise
        except Exception:
            log.exception("exec_job.not_started", extra={"job": job.id})
            return
        try:
            await self.store.finish_exec_job(job.id, result, utcnow())
        except SandgateError:
            log.exception("exec_job.result_not_recorded", extra={"job": job.id})
        log.info("exec_job.finished", extra={"job": job.id, "state": result.state})

    async def _execute(self, job: ExecJob, request: ExecJobRequest) -> ExecResult:
        try:
            ran = await self.toolbox.execute(
                job.tenant_id,
                job.sandbox_name,
                request.command,
                time_limit=request.timeout,
                env=request.env,
                cwd=request.cwd,
            )
        except SandgateError as exc:
            return ExecResult("failed", None, error=f"{exc.code}: {exc.message}")
        except Exception as exc:
            log.exception("exec_job.failed_unexpectedly", extra={"job": job.id})
            return ExecResult("failed", None, error=f"internal error: {type(exc).__name__}")
        if ran.timed_out:
            error: str | None = f"timed out after {request.timeout:g} s; the command was killed"
        elif ran.oom_killed:
            error = (
                f"killed at the sandbox's memory limit (exit code {ran.exit_code}); create the "
                "sandbox with a larger resources.memory_mb, or use less memory"
            )
        elif ran.exit_code != 0:
            error = f"exited with code {ran.exit_code}"
        else:
            error = None
        return ExecResult(
            state="succeeded" if error is None else "failed",
            exit_code=ran.exit_code,
            stdout=ran.stdout,
            stderr=ran.stderr,
            stdout_truncated=ran.stdout_truncated,
            stderr_truncated=ran.stderr_truncated,
            error=error,
        )

    # -- read --------------------------------------------------------------------------------
    async def get(self, tenant: TenantId, job_id: str) -> ExecJob:
        job = await self.store.get_exec_job(tenant, ExecJobId(job_id))
        if job is None or job.tenant_id != tenant:
            raise NotFoundError(f"exec job {job_id} not found")
        return job

    async def list_jobs(
        self,
        tenant: TenantId,
        name: str,
        limit: int = LIST_LIMIT,
        *,
        before: tuple[datetime, ExecJobId] | None = None,
    ) -> list[ExecJob]:
        """Newest first, without output; `before` (created_at, id) of the last one seen."""
        sandbox = await self.sandboxes.get(tenant, name)  # 404 for another tenant's sandbox
        return await self.store.list_exec_jobs(
            tenant, SandboxName(sandbox.name), limit, before=before
        )

    # -- lifecycle ---------------------------------------------------------------------------
    async def fail_leftovers(self) -> int:
        """At start: jobs this node_url left unfinished in an earlier life run nowhere now."""
        return await self.store.fail_instance_exec_jobs(self.node_url, RESTART_ERROR, utcnow())

    async def aclose(self) -> None:
        tasks = list(self.state.exec_job_tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


OVERDUE_GRACE = 60.0  # past its deadline (or this long queued), an unfinished job is stuck


def _replay(job: ExecJob, fingerprint: str) -> ExecJob:
    if job.fingerprint != fingerprint:
        raise IdempotencyMismatchError(
            "this Idempotency-Key was used with a different request body; "
            "use a new key for a different request"
        )
    return job
