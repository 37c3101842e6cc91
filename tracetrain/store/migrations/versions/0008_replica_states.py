"""Full-weight reloads with several gateway processes: the weights each vLLM replica holds, the reload
under way (claimed under a lease), the processes alive on the store and their acknowledgements that they
stopped sending to a replica being reloaded.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gateway_processes",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "replica_states",
        sa.Column("url", sa.String(length=512), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("checkpoint", sa.String(length=1024), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("reloading_to", sa.Integer(), nullable=True),
        sa.Column("owner", sa.String(length=128), nullable=True),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.Column("failure", sa.String(length=2048), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("url"),
    )
    op.create_table(
        "replica_acks",
        sa.Column("url", sa.String(length=512), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("process", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("url", "epoch", "process"),
    )


def downgrade() -> None:
    op.drop_table("replica_acks")
    op.drop_table("replica_states")
    op.drop_table("gateway_processes")
