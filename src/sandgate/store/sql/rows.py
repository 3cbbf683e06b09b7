"""From a database row to a store record (`sandgate.store.base`), for every domain alike."""

from __future__ import annotations

from typing import Any, Final, cast

from sqlalchemy import Row

from sandgate.core import breaker
from sandgate.core.breaker import BreakerRecord
from sandgate.store.base import (
    ApiKey,
    ExecJob,
    ExecJobId,
    ExecJobState,
    IdempotencyRecord,
    Job,
    JobId,
    JobState,
    KeyKind,
    Sandbox,
    SandboxName,
    SandboxState,
    SchedulingTimeout,
    Tenant,
    TenantId,
    Worker,
    WorkerName,
)

# a sandbox in one of these states holds its slot on its worker and counts for its tenant
LIVE_STATES: Final[tuple[SandboxState, ...]] = ("pending", "running")


def tenant(row: Row[Any]) -> Tenant:
    return Tenant(id=TenantId(row.id), name=row.name, created_at=row.created_at)


def api_key(row: Row[Any]) -> ApiKey:
    return ApiKey(
        key_hash=row.key_hash,
        kind=cast(KeyKind, row.kind),
        tenant_id=None if row.tenant_id is None else TenantId(row.tenant_id),
        created_at=row.created_at,
        label=row.label,
    )


def sandbox(row: Row[Any]) -> Sandbox:
    return Sandbox(
        name=SandboxName(row.name),
        tenant_id=TenantId(row.tenant_id),
        state=cast(SandboxState, row.state),
        template=row.template,
        timeout=row.timeout,
        metadata=row.metadata,
        env=row.env,
        network=row.network,
        network_policy=row.network_policy,
        workspaces=row.workspaces,
        resources=row.resources,
        created_at=row.created_at,
        updated_at=row.updated_at,
        worker=None if row.worker is None else WorkerName(row.worker),
        started_at=row.started_at,
        expires_at=row.expires_at,
        error=row.error,
    )


def job(row: Row[Any]) -> Job:
    return Job(
        id=JobId(row.id),
        kind=row.kind,
        sandbox_name=SandboxName(row.sandbox_name),
        state=cast(JobState, row.state),
        request=row.request,
        attempt=row.attempt,
        created_at=row.created_at,
        updated_at=row.updated_at,
        error=row.error,
    )


def idempotency(row: Row[Any]) -> IdempotencyRecord:
    return IdempotencyRecord(
        tenant_id=TenantId(row.tenant_id),
        digest=row.digest,
        fingerprint=row.fingerprint,
        sandbox_name=SandboxName(row.sandbox_name),
        created_at=row.created_at,
    )


def worker(row: Row[Any]) -> Worker:
    return Worker(
        name=WorkerName(row.name),
        capacity=row.capacity,
        features=row.features,
        connected=row.connected,
        last_seen_at=row.last_seen_at,
        node_url=row.node_url,
    )


def exec_job(row: Row[Any], *, output: bool = True) -> ExecJob:
    """`output=False`: a listed job, read without its output (left empty)."""
    return ExecJob(
        id=ExecJobId(row.id),
        tenant_id=TenantId(row.tenant_id),
        sandbox_name=SandboxName(row.sandbox_name),
        command=row.command,
        timeout=row.timeout,
        state=cast(ExecJobState, row.state),
        created_at=row.created_at,
        updated_at=row.updated_at,
        digest=row.digest,
        fingerprint=row.fingerprint,
        exit_code=row.exit_code,
        stdout=row.stdout if output else "",
        stderr=row.stderr if output else "",
        stdout_truncated=bool(row.stdout_truncated),
        stderr_truncated=bool(row.stderr_truncated),
        error=row.error,
        claimed_by=row.claimed_by,
        started_at=row.started_at,
        finished_at=row.finished_at,
    )


def scheduling_timeout(row: Row[Any]) -> SchedulingTimeout:
    return SchedulingTimeout(
        at=row.at,
        sandbox_name=SandboxName(row.sandbox_name),
        tenant_id=TenantId(row.tenant_id),
        node_url=row.node_url,
        reason=row.reason,
    )


def breaker_record(row: Row[Any] | None) -> BreakerRecord:
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
