"""`SqlStore`: the Store Protocol on SQLAlchemy Core, for SQLite and PostgreSQL.

One implementation for both backends; the differences are confined to `open_store`
(driver, pool, SQLite pragmas) and the dialect-specific INSERT used for upserts.

Rules this module keeps:
- Every tenant-facing read filters by tenant in SQL and checks the rows again in
  Python before returning them (never trust a filter you did not apply yourself).
- State moves are single conditional UPDATEs (`... WHERE name = ? AND state IN (...)`)
  and report whether exactly one row moved.
- The create path writes the idempotency record, the sandbox and its job in one
  transaction; the unique (tenant, digest) key decides races across instances.
- Statements are module-level constructs with bound parameters, so SQLAlchemy's
  compiled cache (and asyncpg's prepared statements) serve the hot paths.
- Driver failures surface as `StoreError` (message safe to show; cause chained).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from sqlalchemy import (
    ColumnElement,
    Integer,
    Row,
    and_,
    bindparam,
    case,
    delete,
    event,
    exists,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from sandgate.core import placement
from sandgate.errors import CapacityConflictError, IdempotencyConflictError, StoreError
from sandgate.store.base import (
    ORPHANED_EXEC_JOB,
    ApiKey,
    ExecJob,
    ExecJobId,
    ExecJobState,
    ExecResult,
    IdempotencyRecord,
    Job,
    JobId,
    JobState,
    KeyKind,
    Sandbox,
    SandboxFilter,
    SandboxName,
    SandboxState,
    SchedulingTimeout,
    Store,
    Tenant,
    TenantId,
    Worker,
    WorkerName,
    WorkerUsage,
)
from sandgate.store.migrate import async_url
from sandgate.store.ops import store_op as _store_op
from sandgate.store.schema import (
    admission_tickets,
    api_keys,
    exec_jobs,
    idempotency_keys,
    instances,
    jobs,
    sandboxes,
    scheduling_timeouts,
    tenants,
    tunnel_owners,
    workers,
)
from sandgate.store.sql_admission import AdmissionQueries, check_quota, lock_tenant_limits
from sandgate.store.sql_retention import RetentionQueries

_LIVE_STATES: Final[tuple[SandboxState, ...]] = ("pending", "running")

# Metadata keys that are safe inside an SQLite JSON path label `$."..."`. Any other key
# (quotes, backslashes, empty, ...) is matched through json_each() instead, which takes
# the key as a plain bound value.
_SQLITE_PATH_SAFE_KEY = re.compile(r"[A-Za-z0-9_\-.:/@ ]+")


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _utcnow() -> datetime:
    return datetime.now(UTC)


# --------------------------------------------------------------------------- statements
# Bound-parameter names in WHERE clauses carry a b_ prefix: SQLAlchemy reserves the bare
# column names for the SET/VALUES clause of the same statement.

_SELECT_TENANT = select(tenants).where(tenants.c.id == bindparam("b_id"))
_SELECT_TENANT_BY_NAME = select(tenants).where(tenants.c.name == bindparam("b_name"))
_INSERT_API_KEY = insert(api_keys)
_SELECT_API_KEY = select(api_keys).where(api_keys.c.key_hash == bindparam("b_key_hash"))

_INSERT_SANDBOX = insert(sandboxes)
_GUARD_WORKER = (
    update(workers).where(workers.c.name == bindparam("b_name")).values(capacity=workers.c.capacity)
)
_INSERT_JOB = insert(jobs)
_SELECT_IDEMPOTENCY = select(idempotency_keys).where(
    idempotency_keys.c.tenant_id == bindparam("b_tenant_id"),
    idempotency_keys.c.digest == bindparam("b_digest"),
)
_SELECT_SANDBOX = select(sandboxes).where(sandboxes.c.name == bindparam("b_name"))
_SELECT_TENANT_SANDBOX = select(sandboxes).where(
    sandboxes.c.name == bindparam("b_name"),
    sandboxes.c.tenant_id == bindparam("b_tenant_id"),
)
_SELECT_WORKER_SANDBOXES = (
    select(sandboxes)
    .where(
        sandboxes.c.worker == bindparam("b_worker"),
        sandboxes.c.state.in_(bindparam("b_states", expanding=True)),
    )
    .order_by(sandboxes.c.name)
)
_WORKER_GRANTS = select(sandboxes.c.resources).where(
    sandboxes.c.worker == bindparam("b_worker"),
    sandboxes.c.state.in_(bindparam("b_states", expanding=True)),
)
_COUNT_WORKER_SANDBOXES = (
    select(func.count())
    .select_from(sandboxes)
    .where(
        sandboxes.c.worker == bindparam("b_worker"),
        sandboxes.c.state.in_(bindparam("b_states", expanding=True)),
    )
)
# tenant-scoped views (GET /api/v1/workers, /api/v1/admission)
_LIVE_PER_WORKER = (
    select(sandboxes.c.worker, func.count().label("live"))
    .where(sandboxes.c.worker.is_not(None), sandboxes.c.state.in_(_LIVE_STATES))
    .group_by(sandboxes.c.worker)
)
_TENANT_LIVE_PER_WORKER = _LIVE_PER_WORKER.where(sandboxes.c.tenant_id == bindparam("b_tenant_id"))
_COUNT_TENANT_TICKETS = (
    select(func.count())
    .select_from(admission_tickets)
    .where(
        admission_tickets.c.tenant_id == bindparam("b_tenant_id"),
        admission_tickets.c.expires_at >= bindparam("b_now"),
    )
)
_LIST_TENANT_TIMEOUTS = (
    select(scheduling_timeouts)
    .where(
        scheduling_timeouts.c.tenant_id == bindparam("b_tenant_id"),
        scheduling_timeouts.c.at >= bindparam("b_since"),
    )
    .order_by(scheduling_timeouts.c.id.desc())
    .limit(bindparam("b_limit", type_=Integer))
)
_SELECT_EXPIRED = (
    select(sandboxes)
    .where(
        sandboxes.c.state == "running",
        sandboxes.c.expires_at.is_not(None),
        sandboxes.c.expires_at <= bindparam("b_now"),
    )
    .order_by(sandboxes.c.expires_at, sandboxes.c.name)
    .limit(bindparam("b_limit"))
)

_MARK_RUNNING = (
    update(sandboxes)
    .where(sandboxes.c.name == bindparam("b_name"), sandboxes.c.state == "pending")
    .values(
        state="running",
        worker=bindparam("b_worker"),
        started_at=bindparam("b_started_at"),
        expires_at=bindparam("b_expires_at"),
        updated_at=bindparam("b_started_at"),
    )
)
_SET_STATE_WHERE = (
    sandboxes.c.name == bindparam("b_name"),
    sandboxes.c.state.in_(bindparam("b_from_states", expanding=True)),
)
_SET_STATE = (
    update(sandboxes)
    .where(*_SET_STATE_WHERE)
    .values(state=bindparam("b_state"), updated_at=bindparam("b_now"))
)
_SET_STATE_WITH_ERROR = (
    update(sandboxes)
    .where(*_SET_STATE_WHERE)
    .values(state=bindparam("b_state"), error=bindparam("b_error"), updated_at=bindparam("b_now"))
)
_SELECT_STALE_PENDING = (
    select(sandboxes)
    .where(sandboxes.c.state == "pending", sandboxes.c.created_at < bindparam("b_before"))
    .order_by(sandboxes.c.created_at, sandboxes.c.name)
    .limit(bindparam("b_limit"))
)
_BIND_WORKER_KEY = (
    update(api_keys)
    .where(
        api_keys.c.key_hash == bindparam("b_key_hash"),
        api_keys.c.kind == "worker",
        or_(api_keys.c.label == "", api_keys.c.label == bindparam("b_name")),
    )
    .values(label=bindparam("b_name"))
)
_RELEASE_IDEMPOTENCY = delete(idempotency_keys).where(
    idempotency_keys.c.tenant_id == bindparam("b_tenant_id"),
    idempotency_keys.c.sandbox_name == bindparam("b_sandbox_name"),
)
_SET_EXPIRY = (
    update(sandboxes)
    .where(sandboxes.c.name == bindparam("b_name"), sandboxes.c.state == "running")
    .values(expires_at=bindparam("b_expires_at"), updated_at=bindparam("b_now"))
)
_ASSIGN_WORKER = (
    update(sandboxes)
    .where(sandboxes.c.name == bindparam("b_name"), sandboxes.c.state == "pending")
    .values(worker=bindparam("b_worker"), updated_at=bindparam("b_now"))
)

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

_SET_WORKER_CONNECTED = (
    update(workers)
    .where(workers.c.name == bindparam("b_name"))
    .values(connected=bindparam("b_connected"), last_seen_at=bindparam("b_now"))
)
_SELECT_WORKERS = select(workers).order_by(workers.c.name)

_RELEASE_TUNNEL = delete(tunnel_owners).where(
    tunnel_owners.c.tunnel_key == bindparam("b_key"),
    tunnel_owners.c.node_url == bindparam("b_node_url"),
)
_RELEASE_NODE_TUNNELS = delete(tunnel_owners).where(
    tunnel_owners.c.node_url == bindparam("b_node_url")
)
_RENEW_TUNNEL = (
    update(tunnel_owners)
    .where(
        tunnel_owners.c.tunnel_key == bindparam("b_key"),
        tunnel_owners.c.node_url == bindparam("b_node_url"),
    )
    .values(updated_at=bindparam("b_now"))
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
_SELECT_TUNNEL = select(tunnel_owners.c.node_url, tunnel_owners.c.updated_at).where(
    tunnel_owners.c.tunnel_key == bindparam("b_key")
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
_UNFINISHED_EXEC = ("queued", "running")
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


class _DialectStatements:
    """The few statements whose SQL differs per dialect: ON CONFLICT inserts."""

    def __init__(self, dialect_name: str) -> None:
        dialect_insert = sqlite_dialect.insert if dialect_name == "sqlite" else pg.insert
        self.insert_tenant = dialect_insert(tenants).on_conflict_do_nothing(
            index_elements=[tenants.c.name]
        )
        self.insert_idempotency = dialect_insert(idempotency_keys).on_conflict_do_nothing(
            index_elements=[idempotency_keys.c.tenant_id, idempotency_keys.c.digest]
        )
        worker_ins = dialect_insert(workers)
        self.upsert_worker = worker_ins.on_conflict_do_update(
            index_elements=[workers.c.name],
            set_={
                "capacity": worker_ins.excluded.capacity,
                "features": worker_ins.excluded.features,
                "connected": worker_ins.excluded.connected,
                "node_url": worker_ins.excluded.node_url,
                "last_seen_at": worker_ins.excluded.last_seen_at,
            },
        )
        # a NULL digest (no key) never matches the unique (tenant_id, digest) constraint
        self.insert_exec_job = dialect_insert(exec_jobs).on_conflict_do_nothing(
            index_elements=[exec_jobs.c.tenant_id, exec_jobs.c.digest]
        )
        instance_ins = dialect_insert(instances)
        self.heartbeat_instance = instance_ins.on_conflict_do_update(
            index_elements=[instances.c.node_url],
            set_={"heartbeat_at": instance_ins.excluded.heartbeat_at},
        )
        # /readyz: the heartbeat moved forward, never back. It must change the row: SQLite
        # writes nothing (and so cannot fail) for an UPDATE that leaves a row as it was.
        self.probe_write = instance_ins.on_conflict_do_update(
            index_elements=[instances.c.node_url],
            set_={
                "heartbeat_at": case(
                    (
                        instance_ins.excluded.heartbeat_at > instances.c.heartbeat_at,
                        instance_ins.excluded.heartbeat_at,
                    ),
                    else_=instances.c.heartbeat_at,
                )
            },
        )
        tunnel_ins = dialect_insert(tunnel_owners)
        self.claim_tunnel = tunnel_ins.on_conflict_do_update(
            index_elements=[tunnel_owners.c.tunnel_key],
            set_={
                "node_url": tunnel_ins.excluded.node_url,
                "updated_at": tunnel_ins.excluded.updated_at,
            },
        )


_SQLITE_STATEMENTS: Final = _DialectStatements("sqlite")
_POSTGRESQL_STATEMENTS: Final = _DialectStatements("postgresql")


# ------------------------------------------------------------------------------ rows


def _tenant(row: Row[Any]) -> Tenant:
    return Tenant(id=TenantId(row.id), name=row.name, created_at=row.created_at)


def _api_key(row: Row[Any]) -> ApiKey:
    return ApiKey(
        key_hash=row.key_hash,
        kind=cast(KeyKind, row.kind),
        tenant_id=None if row.tenant_id is None else TenantId(row.tenant_id),
        created_at=row.created_at,
        label=row.label,
    )


def _sandbox(row: Row[Any]) -> Sandbox:
    return Sandbox(
        name=SandboxName(row.name),
        tenant_id=TenantId(row.tenant_id),
        state=cast(SandboxState, row.state),
        template=row.template,
        timeout=row.timeout,
        metadata=row.metadata,
        env=row.env,
        network=row.network,
        resources=row.resources,
        created_at=row.created_at,
        updated_at=row.updated_at,
        worker=None if row.worker is None else WorkerName(row.worker),
        started_at=row.started_at,
        expires_at=row.expires_at,
        error=row.error,
    )


def _job(row: Row[Any]) -> Job:
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


def _idempotency(row: Row[Any]) -> IdempotencyRecord:
    return IdempotencyRecord(
        tenant_id=TenantId(row.tenant_id),
        digest=row.digest,
        fingerprint=row.fingerprint,
        sandbox_name=SandboxName(row.sandbox_name),
        created_at=row.created_at,
    )


def _worker(row: Row[Any]) -> Worker:
    return Worker(
        name=WorkerName(row.name),
        capacity=row.capacity,
        features=row.features,
        connected=row.connected,
        last_seen_at=row.last_seen_at,
        node_url=row.node_url,
    )


def _exec_job(row: Row[Any], *, output: bool = True) -> ExecJob:
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


def _state_ok(state: str, states: tuple[SandboxState, ...]) -> bool:
    return state in states if states else state != "deleted"


def _sandbox_matches(sb: Sandbox, tenant_id: TenantId, where: SandboxFilter) -> bool:
    if sb.tenant_id != tenant_id or not _state_ok(sb.state, where.states):
        return False
    meta = sb.metadata if isinstance(sb.metadata, dict) else {}
    return all(meta.get(k) == v for k, v in where.metadata.items())


# ----------------------------------------------------------------------------- store


class SqlStore(AdmissionQueries, RetentionQueries):
    """The Store Protocol on one SQLAlchemy async engine (SQLite or PostgreSQL)."""

    def __init__(self, engine: AsyncEngine, counters: AsyncEngine | None = None) -> None:
        self._engine = engine
        self.dialect: Final[str] = engine.dialect.name
        if self.dialect == "sqlite":
            self._stmts = _SQLITE_STATEMENTS
        elif self.dialect == "postgresql":
            self._stmts = _POSTGRESQL_STATEMENTS
        else:
            raise ValueError(f"unsupported database dialect {self.dialect!r}")
        self._sqlite = self.dialect == "sqlite"
        # One-statement reads and writes need no explicit transaction: a single statement
        # is atomic on its own. On PostgreSQL, AUTOCOMMIT saves the BEGIN and the
        # COMMIT/ROLLBACK round trips around it (asyncpg's adapter otherwise opens a
        # transaction before every first statement). pysqlite manages SQLite's implicit
        # transactions itself: it starts one before a write, never before a SELECT.
        self._auto = (
            engine if self._sqlite else engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        # Rate-limit counters: on PostgreSQL their own small pool, in autocommit with
        # synchronous_commit=off (see open_store); elsewhere the main engine.
        self._counter_engine = counters
        self._counters = self._auto if counters is None else counters
        # statements sent to the database by this process (exported on /metrics)
        self.statements = 0
        for each in (engine, counters):
            if each is not None:
                event.listen(each.sync_engine, "before_cursor_execute", self._count_statement)

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    # --- helpers

    def _count_statement(self, *_args: Any) -> None:
        self.statements += 1

    def _single(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for one statement: autocommit on PG, a short txn on SQLite."""
        return self._engine.begin() if self._sqlite else self._auto.connect()

    async def _fetch_one(self, stmt: Any, params: Mapping[str, Any]) -> Row[Any] | None:
        async with self._auto.connect() as conn:
            result = await conn.execute(stmt, params)
            return result.first()

    async def _fetch_all(self, stmt: Any, params: Mapping[str, Any]) -> list[Row[Any]]:
        async with self._auto.connect() as conn:
            result = await conn.execute(stmt, params)
            return list(result.all())

    async def _write(self, stmt: Any, params: Mapping[str, Any]) -> int:
        async with self._single() as conn:
            result = await conn.execute(stmt, params)
            return result.rowcount

    # --- lifecycle

    @_store_op
    async def aclose(self) -> None:
        if self._counter_engine is not None:
            await self._counter_engine.dispose()
        await self._engine.dispose()

    # --- tenants and keys

    @_store_op
    async def ensure_tenant(self, name: str) -> Tenant:
        async with self._engine.begin() as conn:
            # Insert first, then read: two instances ensuring the same tenant both end up
            # with the one row, and on SQLite the transaction starts with its write.
            await conn.execute(
                self._stmts.insert_tenant,
                {"id": uuid.uuid4().hex, "name": name, "created_at": _utcnow()},
            )
            row = (await conn.execute(_SELECT_TENANT_BY_NAME, {"b_name": name})).first()
        if row is None:  # pragma: no cover - the row was just written or already there
            raise StoreError("tenant vanished while being ensured")
        return _tenant(row)

    @_store_op
    async def get_tenant(self, tenant_id: TenantId) -> Tenant | None:
        row = await self._fetch_one(_SELECT_TENANT, {"b_id": tenant_id})
        return None if row is None else _tenant(row)

    @_store_op
    async def add_api_key(self, key: ApiKey) -> None:
        await self._write(
            _INSERT_API_KEY,
            {
                "key_hash": key.key_hash,
                "kind": key.kind,
                "tenant_id": key.tenant_id,
                "label": key.label,
                "created_at": key.created_at,
            },
        )

    @_store_op
    async def find_api_key(self, key_hash: str) -> ApiKey | None:
        row = await self._fetch_one(_SELECT_API_KEY, {"b_key_hash": key_hash})
        if row is None or row.key_hash != key_hash:
            return None
        return _api_key(row)

    @_store_op
    async def bind_worker_key(self, key_hash: str, name: str) -> bool:
        """Tie a worker token to the first worker name it registers; later names are refused."""
        return await self._write(_BIND_WORKER_KEY, {"b_key_hash": key_hash, "b_name": name}) == 1

    # --- create

    @_store_op
    async def insert_sandbox(
        self,
        sandbox: Sandbox,
        job: Job,
        idempotency: IdempotencyRecord | None,
        *,
        max_live: int | None = None,
        worker_capacity: int | None = None,
        worker_budget: Mapping[str, int] | None = None,
    ) -> None:
        if job.sandbox_name != sandbox.name or (
            idempotency is not None
            and (
                idempotency.tenant_id != sandbox.tenant_id
                or idempotency.sandbox_name != sandbox.name
            )
        ):
            raise StoreError("sandbox, job and idempotency record do not belong together")
        # Locks are taken in one order, tenant limits -> key -> worker, and the first
        # statement is always a write (on SQLite it takes the write lock before any read).
        async with self._engine.begin() as conn:
            quota = max_live is not None and await lock_tenant_limits(conn, sandbox.tenant_id)
            if idempotency is not None:
                # On PostgreSQL a concurrent insert of the same key waits here for the other
                # transaction, then does nothing: the key decides before any quota counts.
                result = await conn.execute(
                    self._stmts.insert_idempotency,
                    {
                        "tenant_id": idempotency.tenant_id,
                        "digest": idempotency.digest,
                        "fingerprint": idempotency.fingerprint,
                        "sandbox_name": idempotency.sandbox_name,
                        "created_at": idempotency.created_at,
                    },
                )
                if result.rowcount != 1:
                    raise IdempotencyConflictError("idempotency key already recorded")
            if worker_capacity is not None and sandbox.worker is not None:
                await self._hold_worker_slot(conn, sandbox, worker_capacity, worker_budget or {})
            await conn.execute(
                _INSERT_SANDBOX,
                {
                    "name": sandbox.name,
                    "tenant_id": sandbox.tenant_id,
                    "state": sandbox.state,
                    "template": sandbox.template,
                    "timeout": sandbox.timeout,
                    "metadata": sandbox.metadata,
                    "env": sandbox.env,
                    "network": sandbox.network,
                    "resources": sandbox.resources,
                    "worker": sandbox.worker,
                    "error": sandbox.error,
                    "created_at": sandbox.created_at,
                    "updated_at": sandbox.updated_at,
                    "started_at": sandbox.started_at,
                    "expires_at": sandbox.expires_at,
                },
            )
            await conn.execute(
                _INSERT_JOB,
                {
                    "id": job.id,
                    "kind": job.kind,
                    "sandbox_name": job.sandbox_name,
                    "state": job.state,
                    "request": job.request,
                    "attempt": job.attempt,
                    "claimed_by": None,
                    "error": job.error,
                    "created_at": job.created_at,
                    "updated_at": job.updated_at,
                },
            )
            if quota:
                assert max_live is not None
                await check_quota(conn, sandbox.tenant_id, max_live, exec_jobs_quota=False)

    async def _hold_worker_slot(
        self, conn: AsyncConnection, sandbox: Sandbox, capacity: int, budget: Mapping[str, int]
    ) -> None:
        """Lock the worker's row and count what it already hosts, slots and (with a budget)
        the memory and disk granted: placement is exact even when two instances pick the
        same worker's last free slot or its last free GiB."""
        worker = sandbox.worker
        if (await conn.execute(_GUARD_WORKER, {"b_name": worker})).rowcount != 1:
            return  # an unknown worker: delivery will fail it
        params = {"b_worker": worker, "b_states": list(_LIVE_STATES)}
        grants = [(r[0] or {}) for r in await conn.execute(_WORKER_GRANTS, params)]
        if len(grants) >= capacity:
            raise CapacityConflictError(
                f"worker {worker} hosts {len(grants)} of {capacity} already"
            )
        used = placement.usage(grants)
        if (short := placement.short_of(sandbox.resources, used, budget)) is not None:
            raise CapacityConflictError(
                f"worker {worker} has {budget[short] - used[short]} {short} left"
            )

    @_store_op
    async def find_idempotency(self, tenant_id: TenantId, digest: str) -> IdempotencyRecord | None:
        row = await self._fetch_one(
            _SELECT_IDEMPOTENCY, {"b_tenant_id": tenant_id, "b_digest": digest}
        )
        if row is None or row.tenant_id != tenant_id or row.digest != digest:
            return None
        return _idempotency(row)

    # --- sandboxes

    @_store_op
    async def get_sandbox(self, name: SandboxName) -> Sandbox | None:
        row = await self._fetch_one(_SELECT_SANDBOX, {"b_name": name})
        return None if row is None else _sandbox(row)

    @_store_op
    async def get_tenant_sandbox(self, tenant_id: TenantId, name: SandboxName) -> Sandbox | None:
        row = await self._fetch_one(
            _SELECT_TENANT_SANDBOX, {"b_name": name, "b_tenant_id": tenant_id}
        )
        if row is None or row.tenant_id != tenant_id:
            return None
        return _sandbox(row)

    def _metadata_condition(self, key: str, value: str) -> ColumnElement[bool]:
        if self._sqlite and not _SQLITE_PATH_SAFE_KEY.fullmatch(key):
            pairs = func.json_each(sandboxes.c.metadata).table_valued("key", "value")
            return exists(
                select(literal(1))
                .select_from(pairs)
                .where(pairs.c.key == key, pairs.c.value == value)
            )
        return cast(ColumnElement[bool], sandboxes.c.metadata[key].as_string() == value)

    @_store_op
    async def list_sandboxes(self, tenant_id: TenantId, where: SandboxFilter) -> list[Sandbox]:
        if where.limit <= 0:
            return []
        conditions: list[ColumnElement[bool]] = [sandboxes.c.tenant_id == tenant_id]
        if where.states:
            conditions.append(sandboxes.c.state.in_(where.states))
        else:
            conditions.append(sandboxes.c.state != "deleted")
        conditions.extend(self._metadata_condition(k, v) for k, v in where.metadata.items())
        base = select(sandboxes).where(*conditions).order_by(sandboxes.c.name)

        found: list[Sandbox] = []
        cursor = where.after
        async with self._auto.connect() as conn:
            while len(found) < where.limit:
                want = where.limit - len(found)
                stmt = base if cursor is None else base.where(sandboxes.c.name > cursor)
                rows = (await conn.execute(stmt.limit(want))).all()
                for row in rows:
                    sb = _sandbox(row)
                    if _sandbox_matches(sb, tenant_id, where):
                        found.append(sb)
                if len(rows) < want:
                    break
                # Some row failed the re-check: keep scanning after the last one seen so a
                # short page never falsely signals the end of the listing.
                cursor = SandboxName(rows[-1].name)
        return found

    @_store_op
    async def list_worker_sandboxes(
        self, worker: WorkerName, states: tuple[SandboxState, ...]
    ) -> list[Sandbox]:
        wanted: Iterable[str] = states or ("pending", "running", "stopped", "error")
        rows = await self._fetch_all(
            _SELECT_WORKER_SANDBOXES, {"b_worker": worker, "b_states": list(wanted)}
        )
        out = [_sandbox(r) for r in rows]
        return [sb for sb in out if sb.worker == worker and _state_ok(sb.state, states)]

    @_store_op
    async def worker_usage(self, worker: WorkerName) -> WorkerUsage:
        rows = await self._fetch_all(
            _WORKER_GRANTS, {"b_worker": worker, "b_states": list(_LIVE_STATES)}
        )
        grants = [(r[0] or {}) for r in rows]
        return WorkerUsage(len(grants), placement.usage(grants))

    @_store_op
    async def count_live_sandboxes(self, worker: WorkerName) -> int:
        row = await self._fetch_one(
            _COUNT_WORKER_SANDBOXES, {"b_worker": worker, "b_states": list(_LIVE_STATES)}
        )
        return 0 if row is None else int(row[0])

    @_store_op
    async def live_sandboxes_per_worker(
        self, tenant_id: TenantId | None = None
    ) -> dict[WorkerName, int]:
        if tenant_id is None:
            rows = await self._fetch_all(_LIVE_PER_WORKER, {})
        else:
            rows = await self._fetch_all(_TENANT_LIVE_PER_WORKER, {"b_tenant_id": tenant_id})
        return {WorkerName(r.worker): int(r.live) for r in rows}

    @_store_op
    async def count_tenant_queued(self, tenant_id: TenantId, now: datetime) -> int:
        row = await self._fetch_one(_COUNT_TENANT_TICKETS, {"b_tenant_id": tenant_id, "b_now": now})
        return 0 if row is None else int(row[0])

    @_store_op
    async def list_tenant_scheduling_timeouts(
        self, tenant_id: TenantId, since: datetime, limit: int
    ) -> list[SchedulingTimeout]:
        params = {"b_tenant_id": tenant_id, "b_since": since, "b_limit": limit}
        rows = await self._fetch_all(_LIST_TENANT_TIMEOUTS, params)
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

    @_store_op
    async def release_idempotency(self, tenant_id: TenantId, sandbox_name: SandboxName) -> bool:
        params = {"b_tenant_id": tenant_id, "b_sandbox_name": sandbox_name}
        return await self._write(_RELEASE_IDEMPOTENCY, params) >= 1

    @_store_op
    async def list_stale_pending(self, before: datetime, limit: int) -> list[Sandbox]:
        if limit <= 0:
            return []
        rows = await self._fetch_all(_SELECT_STALE_PENDING, {"b_before": before, "b_limit": limit})
        found = [_sandbox(r) for r in rows]
        return [sb for sb in found if sb.state == "pending" and sb.created_at < before]

    @_store_op
    async def list_expired(self, now: datetime, limit: int) -> list[Sandbox]:
        if limit <= 0:
            return []
        rows = await self._fetch_all(_SELECT_EXPIRED, {"b_now": now, "b_limit": limit})
        out = [_sandbox(r) for r in rows]
        return [
            sb
            for sb in out
            if sb.state == "running" and sb.expires_at is not None and sb.expires_at <= now
        ]

    # --- conditional state moves

    @_store_op
    async def mark_running(
        self, name: SandboxName, worker: WorkerName, started_at: datetime, expires_at: datetime
    ) -> bool:
        moved = await self._write(
            _MARK_RUNNING,
            {
                "b_name": name,
                "b_worker": worker,
                "b_started_at": started_at,
                "b_expires_at": expires_at,
            },
        )
        return moved == 1

    @_store_op
    async def set_sandbox_state(
        self,
        name: SandboxName,
        state: SandboxState,
        *,
        from_states: tuple[SandboxState, ...],
        error: str | None = None,
        now: datetime,
    ) -> bool:
        if not from_states:
            return False
        params: dict[str, Any] = {
            "b_name": name,
            "b_from_states": list(from_states),
            "b_state": state,
            "b_now": now,
        }
        if error is None:
            stmt = _SET_STATE  # keeps whatever error was recorded before
        else:
            stmt = _SET_STATE_WITH_ERROR
            params["b_error"] = error
        return await self._write(stmt, params) == 1

    @_store_op
    async def set_expiry(self, name: SandboxName, expires_at: datetime, now: datetime) -> bool:
        """Only while running: a TTL means nothing for a sandbox that is not."""
        moved = await self._write(
            _SET_EXPIRY, {"b_name": name, "b_expires_at": expires_at, "b_now": now}
        )
        return moved == 1

    @_store_op
    async def assign_worker(self, name: SandboxName, worker: WorkerName, now: datetime) -> None:
        """Only while pending: a running sandbox lives on the worker that started it."""
        await self._write(_ASSIGN_WORKER, {"b_name": name, "b_worker": worker, "b_now": now})

    # --- jobs

    @_store_op
    async def get_job(self, job_id: JobId) -> Job | None:
        row = await self._fetch_one(_SELECT_JOB, {"b_id": job_id})
        return None if row is None else _job(row)

    @_store_op
    async def finish_job(
        self, job_id: JobId, state: JobState, *, error: str | None = None, now: datetime
    ) -> bool:
        moved = await self._write(
            _FINISH_JOB, {"b_id": job_id, "b_state": state, "b_error": error, "b_now": now}
        )
        return moved == 1

    @_store_op
    async def fail_sandbox_jobs(self, name: SandboxName, error: str, now: datetime) -> int:
        return await self._write(
            _FAIL_SANDBOX_JOBS, {"b_name": name, "b_error": error, "b_now": now}
        )

    # --- workers

    @_store_op
    async def upsert_worker(self, worker: Worker) -> None:
        await self._write(
            self._stmts.upsert_worker,
            {
                "name": worker.name,
                "capacity": worker.capacity,
                "features": worker.features,
                "connected": worker.connected,
                "node_url": worker.node_url,
                "last_seen_at": worker.last_seen_at,
            },
        )

    @_store_op
    async def set_worker_connected(self, name: WorkerName, connected: bool, now: datetime) -> None:
        await self._write(
            _SET_WORKER_CONNECTED, {"b_name": name, "b_connected": connected, "b_now": now}
        )

    @_store_op
    async def list_workers(self) -> list[Worker]:
        return [_worker(r) for r in await self._fetch_all(_SELECT_WORKERS, {})]

    # --- tunnel ownership

    @_store_op
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
            rows = await self._fetch_all(_SELECT_STALE_JOBS, {"b_before": before, "b_limit": limit})
        else:
            rows = await self._fetch_all(
                _SELECT_WORKER_PENDING_JOBS,
                {"b_before": before, "b_limit": limit, "b_worker": worker},
            )
        won = []
        for row in rows:
            candidate = _job(row)
            moved = await self._write(
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

    @_store_op
    async def renew_tunnel(self, tunnel_key: str, node_url: str, now: datetime) -> bool:
        """Renew ownership only if this node still holds it: never steal it back."""
        params = {"b_key": tunnel_key, "b_node_url": node_url, "b_now": now}
        return await self._write(_RENEW_TUNNEL, params) == 1

    @_store_op
    async def claim_tunnel(self, tunnel_key: str, node_url: str, now: datetime) -> None:
        await self._write(
            self._stmts.claim_tunnel,
            {"tunnel_key": tunnel_key, "node_url": node_url, "updated_at": now},
        )

    @_store_op
    async def release_tunnel(self, tunnel_key: str, node_url: str) -> None:
        await self._write(_RELEASE_TUNNEL, {"b_key": tunnel_key, "b_node_url": node_url})

    @_store_op
    async def release_node_tunnels(self, node_url: str) -> int:
        return await self._write(_RELEASE_NODE_TUNNELS, {"b_node_url": node_url})

    @_store_op
    async def tunnel_owner(self, tunnel_key: str) -> tuple[str, datetime] | None:
        row = await self._fetch_one(_SELECT_TUNNEL, {"b_key": tunnel_key})
        return None if row is None else (row.node_url, row.updated_at)

    # --- exec jobs

    @_store_op
    async def insert_exec_job(self, job: ExecJob, *, max_active: int | None = None) -> None:
        if (job.digest is None) != (job.fingerprint is None):
            raise StoreError("an exec job has both a digest and a fingerprint, or neither")
        async with self._engine.begin() as conn:  # tenant limits -> key, as insert_sandbox
            quota = max_active is not None and await lock_tenant_limits(conn, job.tenant_id)
            result = await conn.execute(
                self._stmts.insert_exec_job,
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

    @_store_op
    async def get_exec_job(self, tenant_id: TenantId, job_id: ExecJobId) -> ExecJob | None:
        row = await self._fetch_one(_SELECT_EXEC_JOB, {"b_id": job_id, "b_tenant_id": tenant_id})
        if row is None or row.tenant_id != tenant_id or row.id != job_id:
            return None
        return _exec_job(row)

    @_store_op
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
        rows = await self._fetch_all(statement, params)
        found = [_exec_job(r, output=False) for r in rows]
        return [j for j in found if j.tenant_id == tenant_id and j.sandbox_name == sandbox_name]

    @_store_op
    async def sweep_exec_jobs(self, ended_before: datetime, limit: int) -> int:
        """Delete finished exec jobs that ended before `ended_before`, or whose sandbox is
        gone; at most `limit` per call. Returns how many."""
        return await self._write(
            _SWEEP_EXEC_JOBS, {"b_ended_before": ended_before, "b_limit": limit}
        )

    @_store_op
    async def find_exec_job_by_digest(self, tenant_id: TenantId, digest: str) -> ExecJob | None:
        row = await self._fetch_one(
            _SELECT_EXEC_JOB_BY_DIGEST, {"b_tenant_id": tenant_id, "b_digest": digest}
        )
        if row is None or row.tenant_id != tenant_id or row.digest != digest:
            return None
        return _exec_job(row)

    @_store_op
    async def start_exec_job(
        self,
        job_id: ExecJobId,
        claimed_by: str,
        now: datetime,
        *,
        deadline: datetime | None = None,
    ) -> bool:
        params = {"b_id": job_id, "b_claimed_by": claimed_by, "b_now": now, "b_deadline": deadline}
        return await self._write(_START_EXEC_JOB, params) == 1

    @_store_op
    async def finish_exec_job(self, job_id: ExecJobId, result: ExecResult, now: datetime) -> bool:
        if result.state not in ("succeeded", "failed"):
            raise StoreError(f"an exec job cannot finish as {result.state!r}")
        moved = await self._write(
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

    @_store_op
    async def fail_orphaned_exec_jobs(self, dead_before: datetime, now: datetime) -> int:
        return await self._write(
            _FAIL_ORPHANED_EXEC_JOBS, {"b_dead_before": dead_before, "b_now": now}
        )

    @_store_op
    async def list_overdue_exec_jobs(self, before: datetime, limit: int) -> list[ExecJob]:
        params = {"b_before": before, "b_limit": limit}
        return [_exec_job(r) for r in await self._fetch_all(_LIST_OVERDUE_EXEC_JOBS, params)]

    @_store_op
    async def fail_exec_job_as_seen(self, job: ExecJob, error: str, now: datetime) -> bool:
        params = {
            "b_id": job.id,
            "b_seen_state": job.state,
            "b_seen_at": job.updated_at,
            "b_error": error,
            "b_now": now,
        }
        return await self._write(_FAIL_EXEC_JOB_AS_SEEN, params) == 1

    @_store_op
    async def fail_instance_exec_jobs(self, node_url: str, error: str, now: datetime) -> int:
        return await self._write(
            _FAIL_INSTANCE_EXEC_JOBS, {"b_node_url": node_url, "b_error": error, "b_now": now}
        )

    # --- instances

    @_store_op
    async def heartbeat_instance(self, node_url: str, now: datetime) -> None:
        await self._write(
            self._stmts.heartbeat_instance, {"node_url": node_url, "heartbeat_at": now}
        )

    # --- readiness

    @_store_op
    async def probe_write(self, node_url: str, now: datetime) -> None:
        await self._write(self._stmts.probe_write, {"node_url": node_url, "heartbeat_at": now})


# ------------------------------------------------------------------------------ open


def _sqlite_on_connect(dbapi_connection: Any, _connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA busy_timeout=5000")
        # WAL is a property of the file and sticks once set (`migrate.upgrade` sets it).
        # Switching needs an exclusive lock that fails at once, without waiting, while
        # other connections are open, so only switch when the file is not in WAL yet.
        cursor.execute("PRAGMA journal_mode")
        row = cursor.fetchone()
        if row is None or str(row[0]).lower() != "wal":
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _skip_idle_sqlite_rollbacks(engine: AsyncEngine) -> None:
    """Save one aiosqlite thread round trip on every read.

    SQLAlchemy rolls back every connection it releases. After a plain SELECT, pysqlite
    has no transaction open (it only begins one before a write), so that ROLLBACK is a
    no-op that still costs a hop to the connection's thread. aiosqlite reports
    `in_transaction` without a hop; skip the call when there is nothing to roll back.
    """
    dialect = engine.sync_engine.dialect
    original = dialect.do_rollback

    def do_rollback(dbapi_connection: Any) -> None:
        driver = getattr(dbapi_connection, "driver_connection", None)
        if driver is not None and getattr(driver, "in_transaction", True) is False:
            return
        original(dbapi_connection)

    setattr(dialect, "do_rollback", do_rollback)  # noqa: B010 - per-engine override


def _existing_sqlite_file(database: str) -> Path | None:
    path = Path(os.path.expanduser(database))
    return path if path.is_file() else None


async def open_store(url: str) -> SqlStore:
    """Open (not migrate) the store at `url`. See `migrate.async_url` for URL forms."""
    target = async_url(url)
    if target.get_backend_name() == "sqlite":
        db_file = _existing_sqlite_file(target.database or "")
        if db_file is None:
            # Never create an empty database by opening it: that is `migrate`'s job.
            raise StoreError(
                f"no SQLite database at {target.database!r}; run `sandgate migrate` first"
            )
        # aiosqlite: one thread per connection. WAL lets readers run beside the writer;
        # writers queue on busy_timeout. (In-memory SQLite is refused by async_url.)
        engine = create_async_engine(
            target,
            pool_size=5,
            max_overflow=10,
            pool_timeout=30,
            json_serializer=_dumps,
        )
        event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
        _skip_idle_sqlite_rollbacks(engine)
    else:
        engine = create_async_engine(
            target,
            pool_size=10,
            max_overflow=10,
            pool_timeout=30,
            pool_recycle=1800,
            json_serializer=_dumps,
        )
        # Token buckets are written on every request of a rate-limited tenant. Their commits
        # need not wait for the WAL flush (about half a millisecond here): a PostgreSQL crash
        # can forget the last few hundred milliseconds of takes (a tenant gets that much
        # extra once), and never corrupts anything. Nothing else is written through it.
        counters = create_async_engine(
            target,
            pool_size=4,
            max_overflow=16,
            pool_timeout=30,
            pool_recycle=1800,
            connect_args={"server_settings": {"synchronous_commit": "off"}},
        ).execution_options(isolation_level="AUTOCOMMIT")
        return SqlStore(engine, counters)
    return SqlStore(engine)


if TYPE_CHECKING:

    def _implements_protocol(store: SqlStore) -> Store:
        return store  # mypy checks every method signature against the Protocol here


__all__ = ("SqlStore", "open_store")
