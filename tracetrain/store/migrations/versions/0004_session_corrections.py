"""Corrections and the console's session list: a session can be excluded from training and its reward
overridden, each such action kept in `session_actions`; sessions carry what the list filters and sorts
on (first model, call and token counts, the reward the trainer uses), filled in here for existing rows,
with indexes for the sorts.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_INDEXED = ("created_at", "updated_at", "model", "calls", "tokens", "reward")


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:  # batch: SQLite cannot add NOT NULL columns otherwise
        batch.add_column(sa.Column("model", sa.String(length=256), nullable=True))
        batch.add_column(sa.Column("calls", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("tokens", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("reward", sa.Float(), nullable=True))
        batch.add_column(sa.Column("reward_override", sa.Float(), nullable=True))
        batch.add_column(sa.Column("excluded", sa.Boolean(), nullable=False, server_default="0"))
    # Existing sessions: the same figures the gateway keeps for new ones.
    op.execute("UPDATE sessions SET "
               "model = (SELECT c.model FROM calls c WHERE c.session_id = sessions.id ORDER BY c.seq, c.choice_index "
               "LIMIT 1), "
               "calls = (SELECT count(*) FROM calls c WHERE c.session_id = sessions.id), "
               "tokens = COALESCE((SELECT sum(CASE WHEN c.choice_index = 0 THEN c.prompt_tokens - c.prefix_len "
               "ELSE 0 END + c.completion_tokens) FROM calls c "
               "WHERE c.session_id = sessions.id), 0), "
               "reward = (SELECT sum(r.value) FROM rewards r WHERE r.session_id = sessions.id)")
    for column in _INDEXED:
        op.create_index(op.f(f"ix_sessions_{column}"), "sessions", [column], unique=False)
    op.create_table(
        "session_actions",
        sa.Column("session_id", sa.String(length=256), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=True),
        sa.Column("note", sa.String(), nullable=False),
        sa.Column("old_value", sa.JSON(), nullable=False),
        sa.Column("new_value", sa.JSON(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_session_actions_session_id"), "session_actions", ["session_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_session_actions_session_id"), table_name="session_actions")
    op.drop_table("session_actions")
    for column in _INDEXED:
        op.drop_index(op.f(f"ix_sessions_{column}"), table_name="sessions")
    with op.batch_alter_table("sessions") as batch:
        for column in ("excluded", "reward_override", "reward", "tokens", "calls", "model"):
            batch.drop_column(column)
