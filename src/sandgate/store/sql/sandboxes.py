"""Sandboxes: the create transaction, the tenant-scoped reads, and the conditional state moves.

The create path writes the idempotency record, the sandbox and its create job in one
transaction; the unique (tenant, digest) key decides races across instances, the tenant's
limits row its quota (`admission`), the worker's row its slots (`fleet.hold_worker_slot`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, Final, cast

from sqlalchemy import (
    ColumnElement,
    bindparam,
    delete,
    exists,
    func,
    insert,
    literal,
    select,
    update,
)

from sandgate.errors import IdempotencyConflictError, StoreError
from sandgate.store.base import (
    IdempotencyRecord,
    Job,
    Sandbox,
    SandboxFilter,
    SandboxName,
    SandboxState,
    TenantId,
    WorkerName,
)
from sandgate.store.ops import store_op
from sandgate.store.schema import idempotency_keys, jobs, sandboxes
from sandgate.store.sql import rows
from sandgate.store.sql.admission import check_quota, lock_tenant_limits
from sandgate.store.sql.engine import Database, PerDialect, dialect_insert
from sandgate.store.sql.fleet import hold_worker_slot

# (key, value) -> the SQL condition "the sandbox's metadata has key = value"
MetadataCondition = Callable[[str, str], ColumnElement[bool]]

# Metadata keys that are safe inside an SQLite JSON path label `$."..."`. Any other key
# (quotes, backslashes, empty, ...) is matched through json_each() instead, which takes
# the key as a plain bound value.
_SQLITE_PATH_SAFE_KEY = re.compile(r"[A-Za-z0-9_\-.:/@ ]+")

# --- create
_INSERT_SANDBOX = insert(sandboxes)
_COUNT_BY_STATE = select(sandboxes.c.state, func.count().label("n")).group_by(sandboxes.c.state)
_INSERT_JOB = insert(jobs)
_SELECT_IDEMPOTENCY = select(idempotency_keys).where(
    idempotency_keys.c.tenant_id == bindparam("b_tenant_id"),
    idempotency_keys.c.digest == bindparam("b_digest"),
)
_RELEASE_IDEMPOTENCY = delete(idempotency_keys).where(
    idempotency_keys.c.tenant_id == bindparam("b_tenant_id"),
    idempotency_keys.c.sandbox_name == bindparam("b_sandbox_name"),
)
_INSERT_IDEMPOTENCY: Final = PerDialect(
    lambda dialect: dialect_insert(dialect, idempotency_keys).on_conflict_do_nothing(
        index_elements=[idempotency_keys.c.tenant_id, idempotency_keys.c.digest]
    )
)

# --- reads
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
_SELECT_STALE_PENDING = (
    select(sandboxes)
    .where(sandboxes.c.state == "pending", sandboxes.c.created_at < bindparam("b_before"))
    .order_by(sandboxes.c.created_at, sandboxes.c.name)
    .limit(bindparam("b_limit"))
)

# --- conditional state moves
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
_SET_EXPIRY = (
    update(sandboxes)
    .where(sandboxes.c.name == bindparam("b_name"), sandboxes.c.state == "running")
    .values(expires_at=bindparam("b_expires_at"), updated_at=bindparam("b_now"))
)
_SET_NETWORK = (
    update(sandboxes)
    .where(sandboxes.c.name == bindparam("b_name"), sandboxes.c.state == "running")
    .values(
        network=bindparam("b_network"),
        network_policy=bindparam("b_policy"),
        updated_at=bindparam("b_now"),
    )
)
_ASSIGN_WORKER = (
    update(sandboxes)
    .where(sandboxes.c.name == bindparam("b_name"), sandboxes.c.state == "pending")
    .values(worker=bindparam("b_worker"), updated_at=bindparam("b_now"))
)


def _state_ok(state: str, states: tuple[SandboxState, ...]) -> bool:
    return state in states if states else state != "deleted"


def _sandbox_matches(sb: Sandbox, tenant_id: TenantId, where: SandboxFilter) -> bool:
    if sb.tenant_id != tenant_id or not _state_ok(sb.state, where.states):
        return False
    meta = sb.metadata if isinstance(sb.metadata, dict) else {}
    return all(meta.get(k) == v for k, v in where.metadata.items())


def _json_metadata_condition(key: str, value: str) -> ColumnElement[bool]:
    return cast(ColumnElement[bool], sandboxes.c.metadata[key].as_string() == value)


def _sqlite_metadata_condition(key: str, value: str) -> ColumnElement[bool]:
    if _SQLITE_PATH_SAFE_KEY.fullmatch(key):
        return _json_metadata_condition(key, value)
    pairs = func.json_each(sandboxes.c.metadata).table_valued("key", "value")
    return exists(
        select(literal(1)).select_from(pairs).where(pairs.c.key == key, pairs.c.value == value)
    )


class Sandboxes:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._insert_idempotency = _INSERT_IDEMPOTENCY.of(db)
        # an attribute, not a method: the contract tests replace it (through
        # `SqlStore._metadata_condition`) to show that the Python re-check holds on its own
        self.metadata_condition: MetadataCondition = (
            _sqlite_metadata_condition if db.sqlite else _json_metadata_condition
        )

    # --- create

    @store_op
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
        async with self._db.begin() as conn:
            quota = max_live is not None and await lock_tenant_limits(conn, sandbox.tenant_id)
            if idempotency is not None:
                # On PostgreSQL a concurrent insert of the same key waits here for the other
                # transaction, then does nothing: the key decides before any quota counts.
                result = await conn.execute(
                    self._insert_idempotency,
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
                await hold_worker_slot(conn, sandbox, worker_capacity, worker_budget or {})
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
                    "network_policy": sandbox.network_policy,
                    "workspaces": sandbox.workspaces,
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

    @store_op
    async def find_idempotency(self, tenant_id: TenantId, digest: str) -> IdempotencyRecord | None:
        row = await self._db.fetch_one(
            _SELECT_IDEMPOTENCY, {"b_tenant_id": tenant_id, "b_digest": digest}
        )
        if row is None or row.tenant_id != tenant_id or row.digest != digest:
            return None
        return rows.idempotency(row)

    @store_op
    async def release_idempotency(self, tenant_id: TenantId, sandbox_name: SandboxName) -> bool:
        params = {"b_tenant_id": tenant_id, "b_sandbox_name": sandbox_name}
        return await self._db.write(_RELEASE_IDEMPOTENCY, params) >= 1

    # --- reads

    @store_op
    async def get_sandbox(self, name: SandboxName) -> Sandbox | None:
        row = await self._db.fetch_one(_SELECT_SANDBOX, {"b_name": name})
        return None if row is None else rows.sandbox(row)

    @store_op
    async def get_tenant_sandbox(self, tenant_id: TenantId, name: SandboxName) -> Sandbox | None:
        row = await self._db.fetch_one(
            _SELECT_TENANT_SANDBOX, {"b_name": name, "b_tenant_id": tenant_id}
        )
        if row is None or row.tenant_id != tenant_id:
            return None
        return rows.sandbox(row)

    @store_op
    async def list_sandboxes(self, tenant_id: TenantId, where: SandboxFilter) -> list[Sandbox]:
        if where.limit <= 0:
            return []
        conditions: list[ColumnElement[bool]] = [sandboxes.c.tenant_id == tenant_id]
        if where.states:
            conditions.append(sandboxes.c.state.in_(where.states))
        else:
            conditions.append(sandboxes.c.state != "deleted")
        conditions.extend(self.metadata_condition(k, v) for k, v in where.metadata.items())
        base = select(sandboxes).where(*conditions).order_by(sandboxes.c.name)

        found: list[Sandbox] = []
        cursor = where.after
        async with self._db.connect() as conn:
            while len(found) < where.limit:
                want = where.limit - len(found)
                stmt = base if cursor is None else base.where(sandboxes.c.name > cursor)
                page = (await conn.execute(stmt.limit(want))).all()
                for row in page:
                    sb = rows.sandbox(row)
                    if _sandbox_matches(sb, tenant_id, where):
                        found.append(sb)
                if len(page) < want:
                    break
                # Some row failed the re-check: keep scanning after the last one seen so a
                # short page never falsely signals the end of the listing.
                cursor = SandboxName(page[-1].name)
        return found

    @store_op
    async def list_worker_sandboxes(
        self, worker: WorkerName, states: tuple[SandboxState, ...]
    ) -> list[Sandbox]:
        wanted: Iterable[str] = states or ("pending", "running", "stopped", "error")
        found = await self._db.fetch_all(
            _SELECT_WORKER_SANDBOXES, {"b_worker": worker, "b_states": list(wanted)}
        )
        out = [rows.sandbox(r) for r in found]
        return [sb for sb in out if sb.worker == worker and _state_ok(sb.state, states)]

    @store_op
    async def list_stale_pending(self, before: datetime, limit: int) -> list[Sandbox]:
        if limit <= 0:
            return []
        params = {"b_before": before, "b_limit": limit}
        found = [rows.sandbox(r) for r in await self._db.fetch_all(_SELECT_STALE_PENDING, params)]
        return [sb for sb in found if sb.state == "pending" and sb.created_at < before]

    @store_op
    async def count_sandboxes_by_state(self) -> dict[str, int]:
        """How many sandboxes of the deployment are in each state (for /metrics)."""
        found = await self._db.fetch_all(_COUNT_BY_STATE, {})
        return {str(r.state): int(r.n) for r in found}

    @store_op
    async def list_expired(self, now: datetime, limit: int) -> list[Sandbox]:
        if limit <= 0:
            return []
        params = {"b_now": now, "b_limit": limit}
        out = [rows.sandbox(r) for r in await self._db.fetch_all(_SELECT_EXPIRED, params)]
        return [
            sb
            for sb in out
            if sb.state == "running" and sb.expires_at is not None and sb.expires_at <= now
        ]

    # --- conditional state moves

    @store_op
    async def mark_running(
        self, name: SandboxName, worker: WorkerName, started_at: datetime, expires_at: datetime
    ) -> bool:
        moved = await self._db.write(
            _MARK_RUNNING,
            {
                "b_name": name,
                "b_worker": worker,
                "b_started_at": started_at,
                "b_expires_at": expires_at,
            },
        )
        return moved == 1

    @store_op
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
        return await self._db.write(stmt, params) == 1

    @store_op
    async def set_expiry(self, name: SandboxName, expires_at: datetime, now: datetime) -> bool:
        """Only while running: a TTL means nothing for a sandbox that is not."""
        moved = await self._db.write(
            _SET_EXPIRY, {"b_name": name, "b_expires_at": expires_at, "b_now": now}
        )
        return moved == 1

    @store_op
    async def set_network(
        self,
        name: SandboxName,
        network: bool,
        policy: dict[str, list[str]] | None,
        now: datetime,
    ) -> bool:
        moved = await self._db.write(
            _SET_NETWORK,
            {"b_name": name, "b_network": network, "b_policy": policy, "b_now": now},
        )
        return moved == 1

    @store_op
    async def assign_worker(self, name: SandboxName, worker: WorkerName, now: datetime) -> None:
        """Only while pending: a running sandbox lives on the worker that started it."""
        await self._db.write(_ASSIGN_WORKER, {"b_name": name, "b_worker": worker, "b_now": now})
