"""Holds on new generations live in the store, so that every gateway process on it obeys a trainer's
hold, not just the one the trainer asked.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "generation_holds",
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("holder"),
    )


def downgrade() -> None:
    op.drop_table("generation_holds")
