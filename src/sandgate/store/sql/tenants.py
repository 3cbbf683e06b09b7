"""Tenants and API keys (the keys are stored as hashes only)."""

from __future__ import annotations

import uuid
from typing import Final

from sqlalchemy import bindparam, insert, or_, select, update

from sandgate.core.clock import utcnow
from sandgate.errors import StoreError
from sandgate.store.base import ApiKey, Tenant, TenantId
from sandgate.store.ops import store_op
from sandgate.store.schema import api_keys, tenants
from sandgate.store.sql import rows
from sandgate.store.sql.engine import Database, PerDialect, dialect_insert

# Bound-parameter names in WHERE clauses carry a b_ prefix: SQLAlchemy reserves the bare
# column names for the SET/VALUES clause of the same statement.
_SELECT_TENANT = select(tenants).where(tenants.c.id == bindparam("b_id"))
_SELECT_TENANT_BY_NAME = select(tenants).where(tenants.c.name == bindparam("b_name"))
_INSERT_API_KEY = insert(api_keys)
_SELECT_API_KEY = select(api_keys).where(api_keys.c.key_hash == bindparam("b_key_hash"))
_BIND_WORKER_KEY = (
    update(api_keys)
    .where(
        api_keys.c.key_hash == bindparam("b_key_hash"),
        api_keys.c.kind == "worker",
        or_(api_keys.c.label == "", api_keys.c.label == bindparam("b_name")),
    )
    .values(label=bindparam("b_name"))
)
_INSERT_TENANT: Final = PerDialect(
    lambda dialect: dialect_insert(dialect, tenants).on_conflict_do_nothing(
        index_elements=[tenants.c.name]
    )
)


class Tenants:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._insert_tenant = _INSERT_TENANT.of(db)

    @store_op
    async def ensure_tenant(self, name: str) -> Tenant:
        async with self._db.begin() as conn:
            # Insert first, then read: two instances ensuring the same tenant both end up
            # with the one row, and on SQLite the transaction starts with its write.
            await conn.execute(
                self._insert_tenant,
                {"id": uuid.uuid4().hex, "name": name, "created_at": utcnow()},
            )
            row = (await conn.execute(_SELECT_TENANT_BY_NAME, {"b_name": name})).first()
        if row is None:  # pragma: no cover - the row was just written or already there
            raise StoreError("tenant vanished while being ensured")
        return rows.tenant(row)

    @store_op
    async def get_tenant(self, tenant_id: TenantId) -> Tenant | None:
        row = await self._db.fetch_one(_SELECT_TENANT, {"b_id": tenant_id})
        return None if row is None else rows.tenant(row)

    @store_op
    async def add_api_key(self, key: ApiKey) -> None:
        await self._db.write(
            _INSERT_API_KEY,
            {
                "key_hash": key.key_hash,
                "kind": key.kind,
                "tenant_id": key.tenant_id,
                "label": key.label,
                "created_at": key.created_at,
            },
        )

    @store_op
    async def find_api_key(self, key_hash: str) -> ApiKey | None:
        row = await self._db.fetch_one(_SELECT_API_KEY, {"b_key_hash": key_hash})
        if row is None or row.key_hash != key_hash:
            return None
        return rows.api_key(row)

    @store_op
    async def bind_worker_key(self, key_hash: str, name: str) -> bool:
        """Tie a worker token to the first worker name it registers; later names are refused."""
        params = {"b_key_hash": key_hash, "b_name": name}
        return await self._db.write(_BIND_WORKER_KEY, params) == 1
