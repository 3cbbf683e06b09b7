"""Workspaces: one row each, per tenant and name (the tree and its history are on the
workers' shared root, `worker/workspaces.py`). The fence counts the holders of a workspace's
advisory lock (`store/workspace_lock.py`): each takes the next one, and the worker stops an
operation of a holder whose fence is no longer the highest."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

from sqlalchemy import Row, and_, bindparam, delete, select, update

from sandgate.store.base import SandboxName, WorkspaceRecord
from sandgate.store.ops import store_op
from sandgate.store.schema import sandboxes, workspaces
from sandgate.store.sql.engine import Database, PerDialect, dialect_insert

_INSERT: Final = PerDialect(
    lambda dialect: dialect_insert(dialect, workspaces).on_conflict_do_nothing(
        index_elements=[workspaces.c.tenant_id, workspaces.c.name]
    )
)
_BY_NAME = select(workspaces).where(
    workspaces.c.tenant_id == bindparam("b_tenant"), workspaces.c.name == bindparam("b_name")
)
_BY_ID = select(workspaces).where(workspaces.c.id == bindparam("b_id"))
_LIST = (
    select(workspaces)
    .where(workspaces.c.tenant_id == bindparam("b_tenant"))
    .order_by(workspaces.c.name)
)
_SET_STATE = (
    update(workspaces)
    .where(
        workspaces.c.id == bindparam("b_id"),
        workspaces.c.state.in_(bindparam("b_from", expanding=True)),
    )
    .values(state=bindparam("state"), updated_at=bindparam("now"))
)
_MOVE = (
    update(workspaces)
    .where(workspaces.c.id == bindparam("b_id"))
    .values(worker=bindparam("worker"), updated_at=bindparam("now"))
)
_MOVE_FROM = _MOVE.where(workspaces.c.worker == bindparam("b_expected"))
_MOVE_FROM_NONE = _MOVE.where(workspaces.c.worker.is_(None))
_NEXT_FENCE = (
    update(workspaces)
    .where(workspaces.c.id == bindparam("b_id"))
    .values(fence=workspaces.c.fence + 1)
    .returning(workspaces.c.fence)
)
_SET_HEAD = (
    update(workspaces)
    .where(workspaces.c.id == bindparam("b_id"))
    .values(head=bindparam("head"), updated_at=bindparam("now"))
)
_DELETE = delete(workspaces).where(workspaces.c.id == bindparam("b_id"))
_USERS = select(sandboxes.c.name, sandboxes.c.workspaces).where(
    and_(
        sandboxes.c.tenant_id == bindparam("b_tenant"),
        sandboxes.c.state.in_(("pending", "running")),
        sandboxes.c.workspaces.is_not(None),
    )
)


def _record(row: Row[Any]) -> WorkspaceRecord:
    return WorkspaceRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        name=row.name,
        quota_mb=int(row.quota_mb),
        state=row.state,
        worker=row.worker,
        fence=int(row.fence),
        head=row.head,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


class Workspaces:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._insert = _INSERT.of(db)

    @store_op
    async def insert_workspace(self, record: WorkspaceRecord) -> bool:
        """Record a new workspace; False when the tenant has one of that name already."""
        done = await self._db.write(
            self._insert,
            {
                "id": record.id,
                "tenant_id": record.tenant_id,
                "name": record.name,
                "quota_mb": record.quota_mb,
                "state": record.state,
                "worker": record.worker,
                "fence": record.fence,
                "head": record.head,
                "created_at": record.created_at,
                "updated_at": record.updated_at,
            },
        )
        return done == 1

    @store_op
    async def get_workspace(self, tenant_id: str, name: str) -> WorkspaceRecord | None:
        row = await self._db.fetch_one(_BY_NAME, {"b_tenant": tenant_id, "b_name": name})
        return None if row is None else _record(row)

    @store_op
    async def get_workspace_by_id(self, ws_id: str) -> WorkspaceRecord | None:
        row = await self._db.fetch_one(_BY_ID, {"b_id": ws_id})
        return None if row is None else _record(row)

    @store_op
    async def list_workspaces(self, tenant_id: str) -> list[WorkspaceRecord]:
        return [_record(r) for r in await self._db.fetch_all(_LIST, {"b_tenant": tenant_id})]

    @store_op
    async def set_workspace_state(
        self, ws_id: str, state: str, *, from_states: tuple[str, ...], now: datetime
    ) -> bool:
        params = {"b_id": ws_id, "b_from": list(from_states), "state": state, "now": now}
        return await self._db.write(_SET_STATE, params) == 1

    @store_op
    async def move_workspace(
        self, ws_id: str, worker: str, *, expected: str | None, now: datetime
    ) -> bool:
        """Record `worker` as the workspace's, if it still is `expected`'s (compare-and-swap:
        of two instances moving it at once, one wins)."""
        stmt = _MOVE_FROM_NONE if expected is None else _MOVE_FROM
        params: dict[str, Any] = {"b_id": ws_id, "worker": worker, "now": now}
        if expected is not None:
            params["b_expected"] = expected
        return await self._db.write(stmt, params) == 1

    @store_op
    async def next_workspace_fence(self, ws_id: str) -> int | None:
        async with self._db.begin() as conn:
            row = (await conn.execute(_NEXT_FENCE, {"b_id": ws_id})).first()
        return None if row is None else int(row[0])

    @store_op
    async def set_workspace_head(self, ws_id: str, head: str, now: datetime) -> None:
        await self._db.write(_SET_HEAD, {"b_id": ws_id, "head": head, "now": now})

    @store_op
    async def delete_workspace(self, ws_id: str) -> bool:
        return await self._db.write(_DELETE, {"b_id": ws_id}) == 1

    @store_op
    async def workspace_users(self, tenant_id: str, ws_id: str) -> list[SandboxName]:
        """The tenant's pending and running sandboxes that mount the workspace."""
        rows = await self._db.fetch_all(_USERS, {"b_tenant": tenant_id})
        return [
            SandboxName(r.name)
            for r in rows
            if any(isinstance(m, dict) and m.get("id") == ws_id for m in r.workspaces or ())
        ]
