"""Canary promotion: the version each session started on, and each version's promotion state with the
decision's numbers. Existing sessions get the version of their first call; existing published
versions count as promoted at once (`immediate`).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("policy_version", sa.Integer(), nullable=True))
    op.execute("UPDATE sessions SET policy_version = (SELECT c.policy_version FROM calls c "
               "WHERE c.session_id = sessions.id ORDER BY c.seq, c.choice_index LIMIT 1)")
    op.create_index(op.f("ix_sessions_policy_version"), "sessions", ["policy_version"], unique=False)
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("promotion", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("canary_since", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("decided_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("decision", sa.JSON(), nullable=True))
    op.execute("UPDATE policies SET promotion = 'immediate' WHERE published_at IS NOT NULL")


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+), not a batch copy: recreating `sessions` on SQLite trips the foreign
    # key from `calls`.
    for column in ("decision", "decided_at", "canary_since", "promotion"):
        op.drop_column("policies", column)
    op.drop_index(op.f("ix_sessions_policy_version"), table_name="sessions")
    op.drop_column("sessions", "policy_version")
