"""The store interface: every durable fact sandgate keeps goes through this Protocol.

Implementations: `sql.SqlStore` on SQLite (one instance) and PostgreSQL (any number).
Times are aware UTC datetimes. Methods raise `sandgate.errors.StoreError` subclasses only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, NewType, Protocol

from sandgate.core.breaker import BreakerPolicy, BreakerRecord

TenantId = NewType("TenantId", str)
SandboxName = NewType("SandboxName", str)
WorkerName = NewType("WorkerName", str)
JobId = NewType("JobId", str)
ExecJobId = NewType("ExecJobId", str)

KeyKind = Literal["tenant", "worker", "admin"]  # admin: fleet-wide read views only
SandboxState = Literal["pending", "running", "stopped", "error", "deleted"]
JobState = Literal["pending", "completed", "failed"]
ExecJobState = Literal["queued", "running", "succeeded", "failed"]


PUBLIC_OWNER = "*"  # the owner of a template every tenant may start from


@dataclass(frozen=True)
class TemplateRecord:
    owner: str  # a tenant id, or PUBLIC_OWNER
    name: str
    digest: str  # content address of its image: layers and config (control/templates.py)
    source: str  # "oci", "rootfs" or "build"
    image: dict[str, Any]  # layers [{digest, size, media}], env, workdir, user, cmd
    size: int  # bytes of its layers' blobs
    created_at: datetime


@dataclass(frozen=True)
class BuildRecord:
    id: str
    owner: str  # as TemplateRecord.owner
    name: str  # the template it makes
    state: str  # "running", "succeeded", "failed"
    log: str  # what its steps printed (the last MAX_BUILD_LOG characters)
    error: str | None
    digest: str | None  # the template's, once it succeeded
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class Tenant:
    id: TenantId
    name: str
    created_at: datetime


@dataclass(frozen=True)
class ApiKey:
    key_hash: str  # sha256 hex of the secret key; the key itself is never stored
    kind: KeyKind
    tenant_id: TenantId | None  # None for worker tokens
    created_at: datetime
    label: str = ""


@dataclass(frozen=True)
class Sandbox:
    name: SandboxName
    tenant_id: TenantId
    state: SandboxState
    template: str
    timeout: float  # seconds of life from running
    metadata: dict[str, str]
    env: dict[str, str]
    network: bool
    resources: dict[str, Any]  # {"memory_mb": int, "cpus": float, "pids": int}
    created_at: datetime
    updated_at: datetime
    worker: WorkerName | None = None
    started_at: datetime | None = None
    expires_at: datetime | None = None
    error: str | None = None
    # with `network`, its rules ({"allow_out": [...], "deny_out": [...]}: egress_policy);
    # None: none, `network` alone says on (the public internet) or off
    network_policy: dict[str, list[str]] | None = None
    # the workspaces it mounts ([{id, name, path, owner}]: core/workspaces); None: none
    workspaces: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class WorkspaceRecord:
    id: str
    tenant_id: str
    name: str
    quota_mb: int
    state: str  # creating | ready | deleting
    worker: str | None  # where its history's operations go (the last that mounted it)
    fence: int  # the last fence handed to a holder of its lock
    head: str | None  # its last commit, as last seen
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class Job:
    id: JobId
    kind: Literal["create"]
    sandbox_name: SandboxName
    state: JobState
    request: dict[str, Any]  # the exact payload pushed down the tunnel
    attempt: int
    created_at: datetime
    updated_at: datetime
    error: str | None = None


@dataclass(frozen=True)
class ExecJob:
    """A command run once, in the background, in a sandbox (`/exec-jobs`)."""

    id: ExecJobId
    tenant_id: TenantId
    sandbox_name: SandboxName
    command: str
    timeout: float
    state: ExecJobState
    created_at: datetime
    updated_at: datetime
    digest: str | None = None  # sha256 of (tenant scope, Idempotency-Key); None without a key
    fingerprint: str | None = None  # sha256 of the canonical request body
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: str | None = None
    claimed_by: str | None = None  # node_url of the instance running it
    started_at: datetime | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True)
class ExecResult:
    state: Literal["succeeded", "failed"]
    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: str | None = None


@dataclass(frozen=True)
class IdempotencyRecord:
    tenant_id: TenantId
    digest: str  # sha256 hex of (tenant scope, Idempotency-Key)
    fingerprint: str  # sha256 hex of the canonical request body
    sandbox_name: SandboxName
    created_at: datetime


@dataclass(frozen=True)
class WorkerUsage:
    sandboxes: int
    granted: dict[str, int]  # core.placement.BUDGETED -> the sum over its live sandboxes


@dataclass(frozen=True)
class Worker:
    name: WorkerName
    capacity: int
    features: dict[str, Any]  # what the worker's runtime enforces, as it reported
    connected: bool
    last_seen_at: datetime
    node_url: str | None = None


@dataclass(frozen=True)
class SandboxFilter:
    states: tuple[SandboxState, ...] = ()  # empty: every state but "deleted"
    metadata: dict[str, str] = field(default_factory=dict)  # all must match exactly
    after: SandboxName | None = None  # cursor: names sorted ascending
    limit: int = 100


class Store(Protocol):
    """All durable state. Every tenant-facing read takes the tenant and filters by it."""

    @property
    def statements(self) -> int: ...  # statements sent to the database by this process so far

    # each statement's duration goes to it (api/metrics.py); None: nowhere
    observe_statement: Callable[[float], None] | None

    async def aclose(self) -> None: ...

    # tenants and keys
    async def ensure_tenant(self, name: str) -> Tenant: ...
    async def get_tenant(self, tenant_id: TenantId) -> Tenant | None: ...
    async def add_api_key(self, key: ApiKey) -> None: ...
    async def find_api_key(self, key_hash: str) -> ApiKey | None: ...
    # a worker token serves one worker name: bound on first use (label), refused for others
    async def bind_worker_key(self, key_hash: str, name: str) -> bool: ...

    # create: one transaction writes the sandbox, its create job and the idempotency record.
    # Raises IdempotencyConflictError if (tenant, digest) already exists (nothing is written).
    # With `max_live`, the tenant's live sandboxes are counted under its limits row's lock
    # and QuotaConflictError is raised (nothing written) past it. With `worker_capacity`,
    # the sandbox's worker row is locked and CapacityConflictError raised when it is full:
    # its slots, or (with `worker_budget`) the memory_mb/disk_mb its sandboxes were granted.
    async def insert_sandbox(
        self,
        sandbox: Sandbox,
        job: Job,
        idempotency: IdempotencyRecord | None,
        *,
        max_live: int | None = None,
        worker_capacity: int | None = None,
        worker_budget: Mapping[str, int] | None = None,
    ) -> None: ...
    async def find_idempotency(
        self, tenant_id: TenantId, digest: str
    ) -> IdempotencyRecord | None: ...
    # a create that failed before its sandbox ran gives its key back, so a retry can create
    async def release_idempotency(self, tenant_id: TenantId, sandbox_name: SandboxName) -> bool: ...

    async def get_sandbox(self, name: SandboxName) -> Sandbox | None: ...
    async def get_tenant_sandbox(
        self, tenant_id: TenantId, name: SandboxName
    ) -> Sandbox | None: ...
    async def list_sandboxes(self, tenant_id: TenantId, where: SandboxFilter) -> list[Sandbox]: ...
    async def list_worker_sandboxes(
        self, worker: WorkerName, states: tuple[SandboxState, ...]
    ) -> list[Sandbox]: ...
    async def count_live_sandboxes(self, worker: WorkerName) -> int: ...  # pending + running
    # what a worker's live sandboxes hold: how many, and the budgeted resources granted
    async def worker_usage(self, worker: WorkerName) -> WorkerUsage: ...
    async def count_tenant_live_sandboxes(self, tenant_id: TenantId) -> int: ...
    # tenant-scoped views (GET /api/v1/workers, /api/v1/admission; None: the whole fleet):
    # live (pending + running) sandboxes per worker, workers without any left out
    async def live_sandboxes_per_worker(
        self, tenant_id: TenantId | None = None
    ) -> dict[WorkerName, int]: ...
    # this tenant's live tickets in the create queue
    async def count_tenant_queued(self, tenant_id: TenantId, now: datetime) -> int: ...
    # this tenant's scheduling timeouts since `since`, newest first
    async def list_tenant_scheduling_timeouts(
        self, tenant_id: TenantId, since: datetime, limit: int
    ) -> list[SchedulingTimeout]: ...
    async def count_sandboxes_by_state(self) -> dict[str, int]: ...
    async def list_expired(self, now: datetime, limit: int) -> list[Sandbox]: ...  # running
    # pending sandboxes created before `before`: their create never finished
    async def list_stale_pending(self, before: datetime, limit: int) -> list[Sandbox]: ...

    # State moves are conditional: each applies only when the current state is in `from_states`
    # and returns whether it applied. That is what stops a late delivery from resurrecting a
    # deleted sandbox.
    async def mark_running(
        self, name: SandboxName, worker: WorkerName, started_at: datetime, expires_at: datetime
    ) -> bool: ...
    async def set_sandbox_state(
        self,
        name: SandboxName,
        state: SandboxState,
        *,
        from_states: tuple[SandboxState, ...],
        error: str | None = None,
        now: datetime,
    ) -> bool: ...
    async def set_expiry(self, name: SandboxName, expires_at: datetime, now: datetime) -> bool: ...
    # only while running: the policy a PUT …/network gives it (False from any other state)
    async def set_network(
        self,
        name: SandboxName,
        network: bool,
        policy: dict[str, list[str]] | None,
        now: datetime,
    ) -> bool: ...
    async def assign_worker(self, name: SandboxName, worker: WorkerName, now: datetime) -> None: ...

    # jobs
    async def get_job(self, job_id: JobId) -> Job | None: ...
    async def finish_job(
        self, job_id: JobId, state: JobState, *, error: str | None = None, now: datetime
    ) -> bool: ...  # only from "pending"
    async def fail_sandbox_jobs(self, name: SandboxName, error: str, now: datetime) -> int: ...
    # pending jobs untouched since `before` (only those of sandboxes placed on `worker`, if
    # given), each claimed by compare-and-swap on (updated_at, attempt): exactly one
    # instance wins a job; attempt counts deliveries
    async def claim_stale_jobs(
        self,
        before: datetime,
        claimer: str,
        now: datetime,
        limit: int,
        *,
        worker: WorkerName | None = None,
    ) -> list[Job]: ...

    # workers
    async def upsert_worker(self, worker: Worker) -> None: ...
    async def set_worker_connected(
        self, name: WorkerName, connected: bool, now: datetime
    ) -> None: ...
    async def list_workers(self) -> list[Worker]: ...

    # tunnel ownership: which instance holds a worker's tunnel (trusted while fresh)
    async def claim_tunnel(self, tunnel_key: str, node_url: str, now: datetime) -> None: ...
    async def renew_tunnel(self, tunnel_key: str, node_url: str, now: datetime) -> bool: ...
    async def release_tunnel(self, tunnel_key: str, node_url: str) -> None: ...
    # every record naming `node_url`: an instance starting holds no tunnel yet, so a record
    # naming it is its earlier life's (a crash, a restart on the same address); returns how many
    async def release_node_tunnels(self, node_url: str) -> int: ...
    async def tunnel_owner(self, tunnel_key: str) -> tuple[str, datetime] | None: ...

    # exec jobs. Insert raises IdempotencyConflictError if (tenant, digest) exists (a NULL
    # digest never conflicts). State moves are conditional: queued -> running (start), running
    # -> succeeded/failed (finish); each returns whether it applied. A job is never re-run.
    # With `max_active`, as insert_sandbox's `max_live` for queued + running exec jobs.
    async def insert_exec_job(self, job: ExecJob, *, max_active: int | None = None) -> None: ...
    async def get_exec_job(self, tenant_id: TenantId, job_id: ExecJobId) -> ExecJob | None: ...
    # newest first, without output (stdout/stderr empty); `before` (created_at, id) pages on
    async def list_exec_jobs(
        self,
        tenant_id: TenantId,
        sandbox_name: SandboxName,
        limit: int,
        *,
        before: tuple[datetime, ExecJobId] | None = None,
    ) -> list[ExecJob]: ...
    # finished jobs ended before `ended_before` or of a sandbox no longer pending/running,
    # deleted with their output, at most `limit`; returns how many
    async def sweep_exec_jobs(self, ended_before: datetime, limit: int) -> int: ...
    # retention (sandgate.store.sql.retention): each deletes at most `limit` rows, returns
    # how many. Sandboxes ended (stopped/error/deleted) before `ended_before`, with their
    # create jobs and idempotency records; tunnel owners not renewed and instances without a
    # heartbeat since `before`; queue tickets expired at `now`; all but the newest `keep`
    # scheduling timeouts
    async def sweep_sandboxes(self, ended_before: datetime, limit: int) -> int: ...
    async def sweep_tunnel_owners(self, before: datetime, limit: int) -> int: ...
    async def sweep_instances(self, before: datetime, limit: int) -> int: ...
    async def sweep_admission_tickets(self, now: datetime, limit: int) -> int: ...
    async def sweep_scheduling_timeouts(self, keep: int, limit: int) -> int: ...
    async def find_exec_job_by_digest(self, tenant_id: TenantId, digest: str) -> ExecJob | None: ...
    # `deadline`: when the job must have finished (started + timeout), for the overdue sweep
    async def start_exec_job(
        self,
        job_id: ExecJobId,
        claimed_by: str,
        now: datetime,
        *,
        deadline: datetime | None = None,
    ) -> bool: ...
    async def finish_exec_job(
        self, job_id: ExecJobId, result: ExecResult, now: datetime
    ) -> bool: ...
    # queued or running jobs whose instance's heartbeat is older than `dead_before` (or
    # missing) and that were not touched since: failed with ORPHANED_EXEC_JOB. Returns how many.
    async def fail_orphaned_exec_jobs(self, dead_before: datetime, now: datetime) -> int: ...
    # queued jobs untouched since `before` and running jobs whose deadline is before it:
    # their start or result was lost (the overdue sweep), oldest first
    async def list_overdue_exec_jobs(self, before: datetime, limit: int) -> list[ExecJob]: ...
    # fail a job only if it is still exactly as read (state and updated_at): compare-and-swap
    async def fail_exec_job_as_seen(self, job: ExecJob, error: str, now: datetime) -> bool: ...
    # queued or running jobs of this very instance, at its start: none of them runs any more
    async def fail_instance_exec_jobs(self, node_url: str, error: str, now: datetime) -> int: ...

    # instances: each API instance renews its heartbeat on every recovery tick
    async def heartbeat_instance(self, node_url: str, now: datetime) -> None: ...

    # tenant limits (set by an operator) and the rate limit's token bucket
    async def set_tenant_limits(self, limits: TenantLimits, now: datetime) -> None: ...
    async def get_tenant_limits(self, tenant_id: TenantId) -> TenantLimits | None: ...
    # take one token (refilled at `rps` up to `burst` since the last take, `now` in epoch
    # seconds); returns 0.0 when taken, else the seconds until one is there
    async def take_rate_token(
        self, tenant_id: TenantId, rps: float, burst: int, now: float
    ) -> float: ...

    # admission: one read for the create path, the fair create queue (tickets are leases),
    # and the scheduling breaker (transitions computed by sandgate.core.breaker)
    async def admission_snapshot(self, now: datetime) -> AdmissionSnapshot: ...
    # a ticket id, or None when `limit` live tickets are already queued (checked and taken
    # under one lock, so N instances together never queue more than `limit`)
    async def enqueue_create(
        self, tenant_id: TenantId, node_url: str, now: datetime, expires_at: datetime, limit: int
    ) -> int | None: ...
    # live tickets served before this one (tenants in turn, then by age; with a share,
    # tenants at it after the others: sandgate.core.fair_queue), or None when this ticket
    # is gone (its lease ran out); 0: this ticket may place
    async def queue_position(
        self, ticket: int, now: datetime, share: TenantShare | None = None
    ) -> int | None: ...
    async def renew_ticket(self, ticket: int, expires_at: datetime) -> bool: ...
    async def leave_queue(self, ticket: int) -> None: ...
    async def record_scheduling_timeout(
        self, event: SchedulingTimeout, policy: BreakerPolicy
    ) -> BreakerRecord: ...
    async def list_scheduling_timeouts(
        self, since: datetime, limit: int
    ) -> list[SchedulingTimeout]: ...  # newest first
    # open (past open_until) or half-open with a trial older than `stale_before` -> half-open
    # with this trial; exactly one caller wins
    async def claim_breaker_trial(
        self, trial: str, now: datetime, stale_before: datetime
    ) -> bool: ...
    # the trial's outcome: success closes the breaker; otherwise it stays open, due for a new
    # trial at once. Applies only while `trial` is still the breaker's trial.
    async def conclude_breaker_trial(self, trial: str, success: bool, now: datetime) -> bool: ...

    # readiness (/readyz): one small committed write, so a store that cannot write (disk full,
    # read-only, gone) fails it with the driver's cause: this instance's heartbeat moved to
    # `now` (it answers, so it is alive), never back
    async def probe_write(self, node_url: str, now: datetime) -> None: ...
    # templates and their layers' blobs (store/sql/templates.py)
    async def blob_complete(self, digest: str) -> bool: ...
    async def begin_blob(self, digest: str, size: int) -> None: ...
    async def write_blob_chunk(self, digest: str, seq: int, data: bytes) -> None: ...
    async def complete_blob(self, digest: str, size: int) -> bool: ...
    async def touch_blob(self, digest: str) -> bool: ...
    async def read_blob(self, digest: str, offset: int, length: int) -> bytes | None: ...
    async def put_template(self, record: TemplateRecord) -> None: ...
    async def get_template(self, owner: str, name: str) -> TemplateRecord | None: ...
    async def list_templates(self, owners: list[str]) -> list[TemplateRecord]: ...
    async def delete_template(self, owner: str, name: str) -> bool: ...
    async def insert_workspace(self, record: WorkspaceRecord) -> bool: ...
    async def get_workspace(self, tenant_id: str, name: str) -> WorkspaceRecord | None: ...
    async def get_workspace_by_id(self, ws_id: str) -> WorkspaceRecord | None: ...
    async def list_workspaces(self, tenant_id: str) -> list[WorkspaceRecord]: ...
    async def set_workspace_state(
        self, ws_id: str, state: str, *, from_states: tuple[str, ...], now: datetime
    ) -> bool: ...
    async def move_workspace(
        self, ws_id: str, worker: str, *, expected: str | None, now: datetime
    ) -> bool: ...
    async def next_workspace_fence(self, ws_id: str) -> int | None: ...
    async def set_workspace_head(self, ws_id: str, head: str, now: datetime) -> None: ...
    async def delete_workspace(self, ws_id: str) -> bool: ...
    async def workspace_users(self, tenant_id: str, ws_id: str) -> list[SandboxName]: ...
    async def sweep_blobs(self, now: datetime) -> int: ...
    async def insert_build(self, record: BuildRecord, *, keep: int) -> None: ...
    async def update_build(
        self,
        build_id: str,
        *,
        state: str,
        log: str,
        error: str | None,
        digest: str | None,
        finished_at: datetime | None,
    ) -> None: ...
    async def get_build(self, owner: str, build_id: str) -> BuildRecord | None: ...
    async def get_cached_step(self, owner: str, key: str) -> tuple[bool, dict[str, Any] | None]: ...
    async def put_cached_step(self, owner: str, key: str, layer: dict[str, Any] | None) -> None: ...


@dataclass(frozen=True)
class TenantLimits:
    """What an operator allows one tenant; None: no limit of that kind."""

    tenant_id: TenantId
    rps: float | None = None  # requests per second, refilled continuously...
    burst: int | None = None  # ...into a bucket this deep (default: max(1, rps))
    max_sandboxes: int | None = None  # live (pending + running) at once
    max_exec_jobs: int | None = None  # queued + running at once

    @property
    def bucket(self) -> int:
        return self.burst if self.burst is not None else max(1, round(self.rps or 1))


@dataclass(frozen=True)
class SchedulingTimeout:
    at: datetime
    sandbox_name: SandboxName
    tenant_id: TenantId
    node_url: str
    reason: str


@dataclass(frozen=True)
class AdmissionSnapshot:
    breaker: BreakerRecord
    queued: int  # live tickets in the create queue


@dataclass(frozen=True)
class TenantShare:
    """The deployment's per-tenant share (`--tenant-share`): a tenant holding at least
    `fraction` of the capacity of the connected workers (those whose tunnel owner row was
    renewed since `connected_since`) waits while a tenant below it waits
    (`sandgate.core.fair_queue`)."""

    fraction: float
    connected_since: datetime


ORPHANED_EXEC_JOB = "the instance running it stopped; it was not re-run"
OVERDUE_EXEC_JOB = (
    "its result was never recorded (the store failed while it ran) and it is past its "
    "timeout; it was not re-run"
)
