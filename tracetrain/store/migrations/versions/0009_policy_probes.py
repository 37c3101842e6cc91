"""On each version's row: the publish probe's figures per replica (engines/probe.py: which replicas
proved they serve the trainer's weights, by how much their logprobs differed, and which did not), and
when a gateway first served a call with it.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("probes", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("first_call_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.drop_column("first_call_at")
        batch.drop_column("probes")
