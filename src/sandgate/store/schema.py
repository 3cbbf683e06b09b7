"""The store's tables, as SQLAlchemy Core.

This module is what the code reads and writes. The database itself is built by the
Alembic migrations in `migrations/versions/` (explicit `op.create_table` calls, never
`create_all`); `tests/unit/test_migrations_only_add.py` fails when the two drift apart.
Changing a table here therefore always means adding a migration too, and migrations
only add.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Final

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Dialect,
    Float,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.types import TypeDecorator

# Names for constraints and indexes not named explicitly (every one below is; this is for
# future migrations). Read-only: nothing in this module is process state.
NAMING_CONVENTION: Final[Mapping[str, str]] = MappingProxyType(
    {
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class UTCDateTime(TypeDecorator[datetime]):
    """An aware datetime that always comes back as an aware UTC datetime.

    PostgreSQL: `timestamp with time zone`. SQLite has no time zones: the value is
    converted to UTC and stored without an offset (so stored strings sort and compare
    in time order), and UTC is attached again on the way out. Naive datetimes are
    refused: the store never guesses what zone a naive time meant.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime, got {type(value).__name__}")
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError("naive datetime given to the store; use an aware UTC datetime")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


metadata = MetaData(naming_convention=dict(NAMING_CONVENTION))

tenants = Table(
    "tenants",
    metadata,
    Column("id", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("id", name="pk_tenants"),
    UniqueConstraint("name", name="uq_tenants_name"),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_hash", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("tenant_id", Text, nullable=True),
    Column("label", Text, nullable=False, server_default=text("''")),
    Column("created_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("key_hash", name="pk_api_keys"),
    ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants"),
)

sandboxes = Table(
    "sandboxes",
    metadata,
    Column("name", Text, nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("template", Text, nullable=False),
    Column("timeout", Float, nullable=False),
    Column("metadata", JSON, nullable=False),
    Column("env", JSON, nullable=False),
    Column("network", Boolean, nullable=False),
    Column("resources", JSON, nullable=False),
    Column("worker", Text, nullable=True),
    Column("error", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Column("started_at", UTCDateTime, nullable=True),
    Column("expires_at", UTCDateTime, nullable=True),
    # the rules of a network that has some ({allow_out, deny_out}); null: `network` says all
    Column("network_policy", JSON, nullable=True),
    # the workspaces it mounts ([{id, name, path, owner}], core/workspaces); null: none
    Column("workspaces", JSON, nullable=True),
    PrimaryKeyConstraint("name", name="pk_sandboxes"),
    Index("ix_sandboxes_tenant_id_name", "tenant_id", "name"),
    Index("ix_sandboxes_state_expires_at", "state", "expires_at"),
    Index("ix_sandboxes_worker_state", "worker", "state"),
)

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("digest", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("sandbox_name", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    # The unique (tenant, digest) index is what makes create idempotency exact across
    # instances: the primary key is that index.
    PrimaryKeyConstraint("tenant_id", "digest", name="pk_idempotency_keys"),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("sandbox_name", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("request", JSON, nullable=False),
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    Column("claimed_by", Text, nullable=True),
    Column("error", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("id", name="pk_jobs"),
    Index("ix_jobs_state_updated_at", "state", "updated_at"),
    Index("ix_jobs_sandbox_name", "sandbox_name"),
)

workers = Table(
    "workers",
    metadata,
    Column("name", Text, nullable=False),
    Column("capacity", Integer, nullable=False),
    Column("features", JSON, nullable=False),
    Column("connected", Boolean, nullable=False),
    Column("node_url", Text, nullable=True),
    Column("last_seen_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("name", name="pk_workers"),
)

# What each worker's live (pending or running) sandboxes hold: how many, and the memory_mb
# and disk_mb they were granted (core.placement.BUDGETED). Kept by triggers on `sandboxes`
# (migration 0007) in the transaction of every change to a sandbox, so that placement and the
# create's exact check read one row instead of summing the worker's sandboxes.
worker_usage = Table(
    "worker_usage",
    metadata,
    Column("worker", Text, nullable=False),
    Column("live", BigInteger, nullable=False, server_default=text("0")),
    Column("memory_mb", BigInteger, nullable=False, server_default=text("0")),
    Column("disk_mb", BigInteger, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("worker", name="pk_worker_usage"),
)

tunnel_owners = Table(
    "tunnel_owners",
    metadata,
    Column("tunnel_key", Text, nullable=False),
    Column("node_url", Text, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("tunnel_key", name="pk_tunnel_owners"),
)

# Exec jobs: a command run once in a sandbox, in the background, by the instance that
# accepted it. The unique (tenant, digest) constraint makes the Idempotency-Key exact across
# instances; a job without a key has a NULL digest, and NULLs never collide in a unique
# constraint (SQLite and PostgreSQL alike).
exec_jobs = Table(
    "exec_jobs",
    metadata,
    Column("id", Text, nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column("sandbox_name", Text, nullable=False),
    Column("digest", Text, nullable=True),
    Column("fingerprint", Text, nullable=True),
    Column("command", Text, nullable=False),
    Column("timeout", Float, nullable=False),
    Column("state", Text, nullable=False),
    Column("exit_code", Integer, nullable=True),
    Column("stdout", Text, nullable=False),
    Column("stderr", Text, nullable=False),
    Column("stdout_truncated", Boolean, nullable=False),
    Column("stderr_truncated", Boolean, nullable=False),
    Column("error", Text, nullable=True),
    Column("claimed_by", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("started_at", UTCDateTime, nullable=True),
    Column("finished_at", UTCDateTime, nullable=True),
    Column("updated_at", UTCDateTime, nullable=False),
    # started_at + timeout (schema 0003): past it, and a grace, a running job is stuck
    Column("deadline_at", UTCDateTime, nullable=True),
    PrimaryKeyConstraint("id", name="pk_exec_jobs"),
    UniqueConstraint("tenant_id", "digest", name="uq_exec_jobs_tenant_id_digest"),
    Index("ix_exec_jobs_sandbox_name_created_at", "sandbox_name", "created_at"),
    Index("ix_exec_jobs_state_updated_at", "state", "updated_at"),
)

# Every API instance upserts its row on every recovery tick: an instance whose heartbeat is
# old has died, and the exec jobs it was running are failed (never re-run).
instances = Table(
    "instances",
    metadata,
    Column("node_url", Text, nullable=False),
    Column("heartbeat_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("node_url", name="pk_instances"),
)

# --- admission: counted here, once for the whole deployment (sandgate.control.admission)

# Limits an operator set for a tenant (NULL: no limit). `guard` is bumped as the first
# statement of a create or exec-job transaction that checks a quota: the row lock serializes
# those checks across instances (and takes SQLite's write lock first).
tenant_limits = Table(
    "tenant_limits",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("rps", Float, nullable=True),
    Column("burst", Integer, nullable=True),
    Column("max_sandboxes", Integer, nullable=True),
    Column("max_exec_jobs", Integer, nullable=True),
    Column("guard", Integer, nullable=False, server_default=text("0")),
    Column("updated_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("tenant_id", name="pk_tenant_limits"),
)

# A token bucket per rate-limited tenant, refilled inside the one UPDATE that takes a token.
# `refilled_at` is seconds since the epoch (arithmetic stays plain on both backends).
rate_buckets = Table(
    "rate_buckets",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("tokens", Float, nullable=False),
    Column("refilled_at", Float, nullable=False),
    PrimaryKeyConstraint("tenant_id", name="pk_rate_buckets"),
)

# Creates waiting for worker capacity, FIFO by id. A ticket is a lease its waiting request
# renews; one whose instance died expires and stops counting.
admission_tickets = Table(
    "admission_tickets",
    metadata,
    Column("id", Integer, nullable=False, autoincrement=True),
    Column("tenant_id", Text, nullable=False),
    Column("node_url", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("id", name="pk_admission_tickets"),
    Index("ix_admission_tickets_expires_at", "expires_at"),
    sqlite_autoincrement=True,
)

# Rows whose lock serializes a check-and-take (first statement of its transaction).
admission_locks = Table(
    "admission_locks",
    metadata,
    Column("name", Text, nullable=False),
    Column("touched", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("name", name="pk_admission_locks"),
)

# The scheduling breaker (sandgate.core.breaker); its row is its lock.
breakers = Table(
    "breakers",
    metadata,
    Column("name", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("reason", Text, nullable=True),
    Column("opened_at", UTCDateTime, nullable=True),
    Column("open_until", UTCDateTime, nullable=True),
    Column("trial", Text, nullable=True),
    Column("trial_at", UTCDateTime, nullable=True),
    Column("closed_at", UTCDateTime, nullable=True),
    Column("updated_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("name", name="pk_breakers"),
)

scheduling_timeouts = Table(
    "scheduling_timeouts",
    metadata,
    Column("id", Integer, nullable=False, autoincrement=True),
    Column("at", UTCDateTime, nullable=False),
    Column("sandbox_name", Text, nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column("node_url", Text, nullable=False),
    Column("reason", Text, nullable=False),
    PrimaryKeyConstraint("id", name="pk_scheduling_timeouts"),
    Index("ix_scheduling_timeouts_at", "at"),
    sqlite_autoincrement=True,
)

# Templates: named root file systems, one row per (owner, name); owner is a tenant id or
# PUBLIC_OWNER. `image` holds the layers (digests, sizes, media types, bottom first) and the
# image config; the layers' bytes are content-addressed blobs, each stored once in chunks.
templates = Table(
    "templates",
    metadata,
    Column("owner", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("digest", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("image", JSON, nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("owner", "name", name="pk_templates"),
)

# persistent workspaces (control/workspaces.py): a tenant's tree with a git history, stored on
# the workers' shared workspace root; `worker` is the one whose host last had it mounted
# (operations go there first); `fence` counts the holders of its advisory lock
workspaces = Table(
    "workspaces",
    metadata,
    Column("id", Text, nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("quota_mb", Integer, nullable=False),
    Column("state", Text, nullable=False),  # creating | ready | deleting
    Column("worker", Text, nullable=True),
    Column("fence", BigInteger, nullable=False),
    Column("head", Text, nullable=True),  # the sha of its last commit, as last seen
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("id", name="pk_workspaces"),
    UniqueConstraint("tenant_id", "name", name="uq_workspaces_tenant_id_name"),
)

blobs = Table(
    "blobs",
    metadata,
    Column("digest", Text, nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("complete", Boolean, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("digest", name="pk_blobs"),
)

blob_chunks = Table(
    "blob_chunks",
    metadata,
    Column("digest", Text, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("data", LargeBinary, nullable=False),
    PrimaryKeyConstraint("digest", "seq", name="pk_blob_chunks"),
)

# Template builds: one row per build, its log kept (capped) to be read after it ended; and the
# per-owner step cache: a step's key (core/build_spec.step_key) -> the layer it made (null:
# it changed nothing).
template_builds = Table(
    "template_builds",
    metadata,
    Column("id", Text, nullable=False),
    Column("owner", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("log", Text, nullable=False),
    Column("error", Text, nullable=True),
    Column("digest", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime, nullable=True),
    PrimaryKeyConstraint("id", name="pk_template_builds"),
    Index("ix_template_builds_owner_created_at", "owner", "created_at"),
)

build_cache = Table(
    "build_cache",
    metadata,
    Column("owner", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("layer", JSON, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("owner", "key", name="pk_build_cache"),
)

__all__ = (
    "NAMING_CONVENTION",
    "UTCDateTime",
    "admission_locks",
    "admission_tickets",
    "api_keys",
    "blob_chunks",
    "blobs",
    "breakers",
    "build_cache",
    "exec_jobs",
    "idempotency_keys",
    "instances",
    "jobs",
    "metadata",
    "rate_buckets",
    "sandboxes",
    "scheduling_timeouts",
    "templates",
    "tenant_limits",
    "tenants",
    "tunnel_owners",
    "workers",
)
