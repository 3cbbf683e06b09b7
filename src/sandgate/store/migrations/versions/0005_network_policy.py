"""network policy: a sandbox's allow_out/deny_out rules

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 00:00:00

Only adds: the nullable `sandboxes.network_policy` (null: `network` says it all).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sandboxes", sa.Column("network_policy", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Migrations only add (DESIGN.md): there is no downgrade that drops data.
    raise NotImplementedError("sandgate migrations only add; restore a backup instead")
