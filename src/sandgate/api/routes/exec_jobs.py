"""`/api/v1/.../exec-jobs`: commands run once in the background, idempotent across instances."""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import JSONResponse

from sandgate.api.deps import Services, services, tenant
from sandgate.api.responses import JSON_BODY, PARAMS, SANDBOX, TENANT, error_docs, replayed
from sandgate.api.schemas import CreateExecJob, ExecJobList, ExecJobOut, ExecJobSummary
from sandgate.control.exec_jobs import ExecJobRequest
from sandgate.errors import InvalidRequestError
from sandgate.store.base import ExecJob, ExecJobId, TenantId

router = APIRouter(prefix="/api/v1", tags=["exec-jobs"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]


def exec_job_out(job: ExecJob) -> dict[str, Any]:
    return ExecJobOut(**_summary_fields(job), stdout=job.stdout, stderr=job.stderr).model_dump(
        mode="json"
    )


def exec_job_summary(job: ExecJob) -> dict[str, Any]:
    """A job as lists show it: everything but its output."""
    return ExecJobSummary(**_summary_fields(job)).model_dump(mode="json")


def _summary_fields(job: ExecJob) -> dict[str, Any]:
    return dict(
        id=job.id,
        sandbox=job.sandbox_name,
        state=job.state,
        command=job.command,
        timeout=job.timeout,
        exit_code=job.exit_code,
        stdout_truncated=job.stdout_truncated,
        stderr_truncated=job.stderr_truncated,
        error=job.error,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
    )


@router.post(
    "/sandboxes/{name}/exec-jobs",
    status_code=202,
    response_model=ExecJobOut,
    responses={202: {"headers": replayed()}, **error_docs(TENANT, JSON_BODY, SANDBOX)},
)
async def create_exec_job(
    name: str,
    body: CreateExecJob,
    who: Tenant,
    svc: Svc,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> JSONResponse:
    timeout = body.timeout if body.timeout is not None else svc.settings.default_exec_timeout
    if timeout > svc.settings.max_exec_timeout:
        raise InvalidRequestError(f"timeout is at most {svc.settings.max_exec_timeout:g} seconds")
    request = ExecJobRequest(command=body.command, timeout=timeout, env=body.env, cwd=body.cwd)
    result = await svc.exec_jobs.submit(who, name, request, idempotency_key)
    headers = {"Idempotent-Replayed": "true"} if result.replayed else {}
    return JSONResponse(exec_job_out(result.job), status_code=202, headers=headers)


@router.get("/exec-jobs/{job_id}", response_model=ExecJobOut, responses=error_docs(TENANT, 404))
async def get_exec_job(job_id: str, who: Tenant, svc: Svc) -> dict[str, Any]:
    return exec_job_out(await svc.exec_jobs.get(who, job_id))


@router.get(
    "/sandboxes/{name}/exec-jobs",
    response_model=ExecJobList,
    responses=error_docs(TENANT, PARAMS, 400, 404),  # 400: a cursor not of ours
)
async def list_exec_jobs(
    name: str,
    who: Tenant,
    svc: Svc,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
) -> dict[str, Any]:
    """Newest first, without output (`GET /exec-jobs/{id}` has it); `next_cursor` pages on."""
    before = _decode_cursor(cursor) if cursor else None
    jobs = await svc.exec_jobs.list_jobs(who, name, limit, before=before)
    summaries = [exec_job_summary(j) for j in jobs]
    last = jobs[-1] if len(jobs) == limit else None
    next_cursor = None if last is None else _encode_cursor(last.created_at, last.id)
    return {"exec_jobs": summaries, "next_cursor": next_cursor}


def _encode_cursor(created_at: datetime, job_id: str) -> str:
    raw = f"{created_at.isoformat()}|{job_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, ExecJobId]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, job_id = raw.split("|", 1)
        created_at = datetime.fromisoformat(at)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequestError(
            "invalid cursor: pass back the next_cursor of the previous page", code="bad_cursor"
        ) from None
    if created_at.tzinfo is None:
        raise InvalidRequestError("invalid cursor", code="bad_cursor")
    return created_at, ExecJobId(job_id)
