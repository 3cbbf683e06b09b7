"""initial schema

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00

Types are spelled out here on purpose (not imported from `sandgate.store.schema`):
a migration is a frozen record of what it did. `UTCDateTime` in schema.py is a
Python-side wrapper over `DateTime(timezone=True)`, so the column type is the same.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("key_hash", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=True),
        sa.Column("label", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key_hash", name="pk_api_keys"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants"
        ),
    )
    op.create_table(
        "sandboxes",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("template", sa.Text(), nullable=False),
        sa.Column("timeout", sa.Float(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("network", sa.Boolean(), nullable=False),
        sa.Column("resources", sa.JSON(), nullable=False),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_sandboxes"),
    )
    op.create_index("ix_sandboxes_tenant_id_name", "sandboxes", ["tenant_id", "name"])
    op.create_index("ix_sandboxes_state_expires_at", "sandboxes", ["state", "expires_at"])
    op.create_index("ix_sandboxes_worker_state", "sandboxes", ["worker", "state"])
    op.create_table(
        "idempotency_keys",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("digest", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.Text(), nullable=False),
        sa.Column("sandbox_name", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "digest", name="pk_idempotency_keys"),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("sandbox_name", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_index("ix_jobs_state_updated_at", "jobs", ["state", "updated_at"])
    op.create_index("ix_jobs_sandbox_name", "jobs", ["sandbox_name"])
    op.create_table(
        "workers",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("features", sa.JSON(), nullable=False),
        sa.Column("connected", sa.Boolean(), nullable=False),
        sa.Column("node_url", sa.Text(), nullable=True),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_workers"),
    )
    op.create_table(
        "tunnel_owners",
        sa.Column("tunnel_key", sa.Text(), nullable=False),
        sa.Column("node_url", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tunnel_key", name="pk_tunnel_owners"),
    )


def downgrade() -> None:
    # Migrations only add (DESIGN.md): there is no downgrade that drops data.
    # Roll back by restoring a backup taken before `sandgate migrate`.
    raise NotImplementedError("sandgate migrations only add; restore a backup instead")
