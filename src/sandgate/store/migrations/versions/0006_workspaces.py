"""workspaces: a tenant's persistent trees with a git history, and the sandboxes' mounts

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 00:00:00

Only adds: the `workspaces` table and the nullable `sandboxes.workspaces`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workspaces",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("quota_mb", sa.Integer(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("fence", sa.BigInteger(), nullable=False),
        sa.Column("head", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_workspaces"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_workspaces_tenant_id_name"),
    )
    op.add_column("sandboxes", sa.Column("workspaces", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Migrations only add (DESIGN.md): there is no downgrade that drops data.
    raise NotImplementedError("sandgate migrations only add; restore a backup instead")
