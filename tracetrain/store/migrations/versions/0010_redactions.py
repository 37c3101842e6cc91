"""What redaction found: counts by type on each session, and on each call its counts and the token
ranges it masked (tracetrain/redaction/).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("redactions", sa.JSON(), nullable=True))
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("redactions", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+), not a batch copy: recreating `sessions` on SQLite trips the foreign
    # key from `calls` (as in 0006).
    op.drop_column("calls", "redactions")
    op.drop_column("sessions", "redactions")
