"""Retention and erasure: each session says whether its content was purged (`retention`) or deleted (an
erasure request) and when; `audit_log` records who exported, purged or deleted what, and when
(store/retention.py, store/audit.py).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("purged", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("purged_at", sa.DateTime(), nullable=True))
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=True),
        sa.Column("session_id", sa.String(length=256), nullable=True),
        sa.Column("sessions", sa.Integer(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
    )
    op.create_index("ix_audit_log_created_at", "audit_log", ["created_at"])
    op.create_index("ix_audit_log_action", "audit_log", ["action"])
    op.create_index("ix_audit_log_session_id", "audit_log", ["session_id"])


def downgrade() -> None:
    op.drop_table("audit_log")
    # Plain DROP COLUMN (SQLite 3.35+), not a batch copy: recreating `sessions` on SQLite trips the foreign
    # key from `calls` (as in 0006 and 0010).
    op.drop_column("sessions", "purged_at")
    op.drop_column("sessions", "purged")
