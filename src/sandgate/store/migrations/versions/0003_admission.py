"""admission: tenant limits, rate buckets, the create queue and the scheduling breaker

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 00:00:00

Only adds: new tables, their indexes, the two rows the admission code locks, and a nullable
`exec_jobs.deadline_at` (set when a job starts).
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_limits",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("rps", sa.Float(), nullable=True),
        sa.Column("burst", sa.Integer(), nullable=True),
        sa.Column("max_sandboxes", sa.Integer(), nullable=True),
        sa.Column("max_exec_jobs", sa.Integer(), nullable=True),
        sa.Column("guard", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", name="pk_tenant_limits"),
    )
    op.create_table(
        "rate_buckets",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("tokens", sa.Float(), nullable=False),
        sa.Column("refilled_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", name="pk_rate_buckets"),
    )
    op.create_table(
        "admission_tickets",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("node_url", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_admission_tickets"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_admission_tickets_expires_at", "admission_tickets", ["expires_at"])
    locks = op.create_table(
        "admission_locks",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("touched", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_admission_locks"),
    )
    breakers = op.create_table(
        "breakers",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("open_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("trial", sa.Text(), nullable=True),
        sa.Column("trial_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_breakers"),
    )
    op.create_table(
        "scheduling_timeouts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sandbox_name", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("node_url", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_scheduling_timeouts"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_scheduling_timeouts_at", "scheduling_timeouts", ["at"])
    op.add_column("exec_jobs", sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True))
    assert locks is not None and breakers is not None
    op.bulk_insert(locks, [{"name": "queue", "touched": 0}])
    # SQLite stores times without an offset, in UTC (see schema.UTCDateTime)
    now = datetime.now(UTC)
    stamp = now.replace(tzinfo=None) if op.get_context().dialect.name == "sqlite" else now
    op.bulk_insert(breakers, [{"name": "scheduling", "state": "closed", "updated_at": stamp}])


def downgrade() -> None:
    # Migrations only add (DESIGN.md): there is no downgrade that drops data.
    raise NotImplementedError("sandgate migrations only add; restore a backup instead")
