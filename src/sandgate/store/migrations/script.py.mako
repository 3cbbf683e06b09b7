"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}

Migrations only add (DESIGN.md): new tables, new nullable columns (or columns with a
server default), new indexes. No drops, renames, type changes or NOT NULL on existing
columns; tests/unit/test_migrations_only_add.py enforces it. Spell types out here
rather than importing them from sandgate.store.schema.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
${imports if imports else ""}

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    raise NotImplementedError("sandgate migrations only add; restore a backup instead")
