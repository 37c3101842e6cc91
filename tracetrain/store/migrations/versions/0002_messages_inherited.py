"""Calls store only the request messages they added: `calls.messages_inherited` counts the leading
messages taken from the parent call instead. Existing rows keep all their messages (0).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:  # batch: SQLite cannot add a NOT NULL column otherwise
        batch.add_column(sa.Column("messages_inherited", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("messages_inherited")
