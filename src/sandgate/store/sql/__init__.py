"""The Store Protocol on SQLAlchemy Core, for SQLite and PostgreSQL: `SqlStore`, `open_store`.

One implementation for both backends; the differences are confined to `engine` (driver,
pool, SQLite pragmas) and the dialect-specific INSERTs used for upserts (`PerDialect`).

Layout, one module per domain, each holding its statements beside the methods that run them:

- `engine`: `open_engines` (engine set-up) and `Database`, the engine helper every domain
  shares (one-statement reads and writes, transactions, the statement counter).
- `rows`: row -> record mappers (`sandgate.store.base`), shared by the domains.
- `tenants` (tenants, API keys), `sandboxes` (the create transaction, reads, state moves),
  `jobs` (create jobs), `fleet` (workers, tunnel owners, instance heartbeats),
  `exec_jobs`, `admission` (limits, quotas, rate buckets, the create queue), `breaker` (the
  scheduling breaker), `retention` (the sweepers and `STORE_GROWTH`).
- `store`: `SqlStore`, which composes them.

How the domains share the engine: each domain is a small class constructed with the one
`Database` of its `SqlStore` (no mixins, no shared `self`); a create transaction that spans
domains calls plain module functions on the open connection (`admission.lock_tenant_limits`
and `check_quota`, `fleet.hold_worker_slot`). `SqlStore` binds each Protocol method to the
domain object that owns it.

Rules the domains keep:
- Every tenant-facing read filters by tenant in SQL and checks the rows again in
  Python before returning them (never trust a filter you did not apply yourself).
- State moves are single conditional UPDATEs (`... WHERE name = ? AND state IN (...)`)
  and report whether exactly one row moved.
- The create path writes the idempotency record, the sandbox and its job in one
  transaction; the unique (tenant, digest) key decides races across instances.
- Statements are module-level constructs with bound parameters, so SQLAlchemy's
  compiled cache (and asyncpg's prepared statements) serve the hot paths. Bound-parameter
  names in WHERE clauses carry a b_ prefix: SQLAlchemy reserves the bare column names for
  the SET/VALUES clause of the same statement.
- Driver failures surface as `StoreError` (message safe to show; cause chained), through
  `sandgate.store.ops.store_op` on every domain method.
"""

from sandgate.store.sql.store import SqlStore, open_store

__all__ = ("SqlStore", "open_store")
