"""exec jobs and instance heartbeats

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 00:00:00

Only adds: two new tables and their indexes (see 0001 for why types are spelled out).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "exec_jobs",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("sandbox_name", sa.Text(), nullable=False),
        sa.Column("digest", sa.Text(), nullable=True),
        sa.Column("fingerprint", sa.Text(), nullable=True),
        sa.Column("command", sa.Text(), nullable=False),
        sa.Column("timeout", sa.Float(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("stdout", sa.Text(), nullable=False),
        sa.Column("stderr", sa.Text(), nullable=False),
        sa.Column("stdout_truncated", sa.Boolean(), nullable=False),
        sa.Column("stderr_truncated", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_exec_jobs"),
        # NULL digests (jobs without a key) never collide: NULLs are distinct on both backends
        sa.UniqueConstraint("tenant_id", "digest", name="uq_exec_jobs_tenant_id_digest"),
    )
    op.create_index(
        "ix_exec_jobs_sandbox_name_created_at", "exec_jobs", ["sandbox_name", "created_at"]
    )
    op.create_index("ix_exec_jobs_state_updated_at", "exec_jobs", ["state", "updated_at"])
    op.create_table(
        "instances",
        sa.Column("node_url", sa.Text(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("node_url", name="pk_instances"),
    )


def downgrade() -> None:
    # Migrations only add (DESIGN.md): there is no downgrade that drops data.
    raise NotImplementedError("sandgate migrations only add; restore a backup instead")
