"""Named policies: the registry of policy lines (`policy_lines`, with the built-in `default`), and the policy
of each session. Every session a store held before is in the default policy.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A server default fills the column for every existing row in one statement (no batch copy of the table).
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("policy", sa.String(length=64), nullable=False, server_default="default"))
    op.create_index("ix_sessions_policy", "sessions", ["policy"])
    lines = op.create_table(
        "policy_lines",
        sa.Column("name", sa.String(length=64), primary_key=True),
        sa.Column("training", sa.String(length=16), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
    )
    op.bulk_insert(lines, [{"name": "default", "training": "lora", "settings": {},
                            "created_at": datetime.now(UTC).replace(tzinfo=None), "source": "builtin"}])


def downgrade() -> None:
    op.drop_table("policy_lines")
    # Plain DROP COLUMN (SQLite 3.35+), not a batch copy: recreating `sessions` on SQLite trips the foreign
    # key from `calls` (as in 0006, 0010 and 0011).
    op.drop_index("ix_sessions_policy", table_name="sessions")
    op.drop_column("sessions", "policy")
