"""The fleet: workers and what they host, tunnel owners, and the API instances' heartbeats.

`hold_worker_slot` is the placement check inside the create transaction
(`sandboxes.Sandboxes.insert_sandbox`): it locks the worker's row and counts what it hosts.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from sqlalchemy import bindparam, case, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from sandgate.core import placement
from sandgate.errors import CapacityConflictError
from sandgate.store.base import Sandbox, TenantId, Worker, WorkerName, WorkerUsage
from sandgate.store.ops import store_op
from sandgate.store.schema import instances, sandboxes, tunnel_owners, worker_usage, workers
from sandgate.store.sql import rows
from sandgate.store.sql.engine import Database, PerDialect, dialect_insert
from sandgate.store.sql.rows import LIVE_STATES

# --- workers and what they host
_GUARD_WORKER = (
    update(workers).where(workers.c.name == bindparam("b_name")).values(capacity=workers.c.capacity)
)
# what a worker's live sandboxes hold: its row of `worker_usage`, which the database's
# triggers keep in the transaction of every change to a sandbox (migration 0007). A create
# reads it twice (placement, then the insert's check); summing the worker's sandboxes instead
# grew each read with them (0.8 ms at 1,000 on SQLite).
_WORKER_USAGE = select(
    worker_usage.c.live, *(worker_usage.c[name] for name in placement.BUDGETED)
).where(worker_usage.c.worker == bindparam("b_worker"))


def _usage_of(row: Any) -> WorkerUsage:
    if row is None:  # the worker never held a sandbox
        return WorkerUsage(0, placement.usage(()))
    return WorkerUsage(
        int(row.live), {name: int(getattr(row, name)) for name in placement.BUDGETED}
    )


# tenant-scoped views (GET /api/v1/workers)
_LIVE_PER_WORKER = (
    select(sandboxes.c.worker, func.count().label("live"))
    .where(sandboxes.c.worker.is_not(None), sandboxes.c.state.in_(LIVE_STATES))
    .group_by(sandboxes.c.worker)
)
_TENANT_LIVE_PER_WORKER = _LIVE_PER_WORKER.where(sandboxes.c.tenant_id == bindparam("b_tenant_id"))
_SET_WORKER_CONNECTED = (
    update(workers)
    .where(workers.c.name == bindparam("b_name"))
    .values(connected=bindparam("b_connected"), last_seen_at=bindparam("b_now"))
)
_SELECT_WORKERS = select(workers).order_by(workers.c.name)

# --- tunnel owners
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
_SELECT_TUNNEL = select(tunnel_owners.c.node_url, tunnel_owners.c.updated_at).where(
    tunnel_owners.c.tunnel_key == bindparam("b_key")
)


class _Upserts:
    """The fleet's statements whose ON CONFLICT clause differs per dialect."""

    def __init__(self, dialect: str) -> None:
        worker_ins = dialect_insert(dialect, workers)
        self.upsert_worker: Final = worker_ins.on_conflict_do_update(
            index_elements=[workers.c.name],
            set_={
                "capacity": worker_ins.excluded.capacity,
                "features": worker_ins.excluded.features,
                "connected": worker_ins.excluded.connected,
                "node_url": worker_ins.excluded.node_url,
                "last_seen_at": worker_ins.excluded.last_seen_at,
            },
        )
        tunnel_ins = dialect_insert(dialect, tunnel_owners)
        self.claim_tunnel: Final = tunnel_ins.on_conflict_do_update(
            index_elements=[tunnel_owners.c.tunnel_key],
            set_={
                "node_url": tunnel_ins.excluded.node_url,
                "updated_at": tunnel_ins.excluded.updated_at,
            },
        )
        instance_ins = dialect_insert(dialect, instances)
        self.heartbeat_instance: Final = instance_ins.on_conflict_do_update(
            index_elements=[instances.c.node_url],
            set_={"heartbeat_at": instance_ins.excluded.heartbeat_at},
        )
        # /readyz: the heartbeat moved forward, never back. It must change the row: SQLite
        # writes nothing (and so cannot fail) for an UPDATE that leaves a row as it was.
        self.probe_write: Final = instance_ins.on_conflict_do_update(
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


_UPSERTS: Final = PerDialect(_Upserts)


async def hold_worker_slot(
    conn: AsyncConnection, sandbox: Sandbox, capacity: int, budget: Mapping[str, int]
) -> None:
    """Lock the worker's row and count what it already hosts, slots and (with a budget)
    the memory and disk granted: placement is exact even when two instances pick the
    same worker's last free slot or its last free GiB."""
    worker = sandbox.worker
    if (await conn.execute(_GUARD_WORKER, {"b_name": worker})).rowcount != 1:
        return  # an unknown worker: delivery will fail it
    usage = _usage_of((await conn.execute(_WORKER_USAGE, {"b_worker": worker})).one_or_none())
    if (held := usage.sandboxes) >= capacity:
        raise CapacityConflictError(f"worker {worker} hosts {held} of {capacity} already")
    used = usage.granted
    if (short := placement.short_of(sandbox.resources, used, budget)) is not None:
        raise CapacityConflictError(
            f"worker {worker} has {budget[short] - used[short]} {short} left"
        )


class Fleet:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._upserts = _UPSERTS.of(db)

    # --- workers

    @store_op
    async def upsert_worker(self, worker: Worker) -> None:
        await self._db.write(
            self._upserts.upsert_worker,
            {
                "name": worker.name,
                "capacity": worker.capacity,
                "features": worker.features,
                "connected": worker.connected,
                "node_url": worker.node_url,
                "last_seen_at": worker.last_seen_at,
            },
        )

    @store_op
    async def set_worker_connected(self, name: WorkerName, connected: bool, now: datetime) -> None:
        await self._db.write(
            _SET_WORKER_CONNECTED, {"b_name": name, "b_connected": connected, "b_now": now}
        )

    @store_op
    async def list_workers(self) -> list[Worker]:
        return [rows.worker(r) for r in await self._db.fetch_all(_SELECT_WORKERS, {})]

    @store_op
    async def worker_usage(self, worker: WorkerName) -> WorkerUsage:
        return _usage_of(await self._db.fetch_one(_WORKER_USAGE, {"b_worker": worker}))

    @store_op
    async def count_live_sandboxes(self, worker: WorkerName) -> int:
        return (await self.worker_usage(worker)).sandboxes

    @store_op
    async def live_sandboxes_per_worker(
        self, tenant_id: TenantId | None = None
    ) -> dict[WorkerName, int]:
        if tenant_id is None:
            found = await self._db.fetch_all(_LIVE_PER_WORKER, {})
        else:
            found = await self._db.fetch_all(_TENANT_LIVE_PER_WORKER, {"b_tenant_id": tenant_id})
        return {WorkerName(r.worker): int(r.live) for r in found}

    # --- tunnel ownership

    @store_op
    async def renew_tunnel(self, tunnel_key: str, node_url: str, now: datetime) -> bool:
        """Renew ownership only if this node still holds it: never steal it back."""
        params = {"b_key": tunnel_key, "b_node_url": node_url, "b_now": now}
        return await self._db.write(_RENEW_TUNNEL, params) == 1

    @store_op
    async def claim_tunnel(self, tunnel_key: str, node_url: str, now: datetime) -> None:
        await self._db.write(
            self._upserts.claim_tunnel,
            {"tunnel_key": tunnel_key, "node_url": node_url, "updated_at": now},
        )

    @store_op
    async def release_tunnel(self, tunnel_key: str, node_url: str) -> None:
        await self._db.write(_RELEASE_TUNNEL, {"b_key": tunnel_key, "b_node_url": node_url})

    @store_op
    async def release_node_tunnels(self, node_url: str) -> int:
        return await self._db.write(_RELEASE_NODE_TUNNELS, {"b_node_url": node_url})

    @store_op
    async def tunnel_owner(self, tunnel_key: str) -> tuple[str, datetime] | None:
        row = await self._db.fetch_one(_SELECT_TUNNEL, {"b_key": tunnel_key})
        return None if row is None else (row.node_url, row.updated_at)

    # --- instances and readiness

    @store_op
    async def heartbeat_instance(self, node_url: str, now: datetime) -> None:
        await self._db.write(
            self._upserts.heartbeat_instance, {"node_url": node_url, "heartbeat_at": now}
        )

    @store_op
    async def probe_write(self, node_url: str, now: datetime) -> None:
        await self._db.write(self._upserts.probe_write, {"node_url": node_url, "heartbeat_at": now})
