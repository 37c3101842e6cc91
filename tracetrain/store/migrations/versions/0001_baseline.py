"""Baseline: the schema of tracetrain 0.1 (sessions, calls, rewards, policies).

Stores created by 0.1 (by `create_all`, without Alembic) have exactly these tables; `tracetrain db
upgrade` checks that and stamps them with this revision before applying later ones.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('policies',
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('checkpoint', sa.String(length=1024), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('published_at', sa.DateTime(), nullable=True),
    sa.Column('publish_error', sa.String(), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('version')
    )
    op.create_table('rewards',
    sa.Column('session_id', sa.String(length=256), nullable=False),
    sa.Column('call_id', sa.String(length=128), nullable=True),
    sa.Column('value', sa.Float(), nullable=False),
    sa.Column('components', sa.JSON(), nullable=True),
    sa.Column('final', sa.Boolean(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=256), nullable=True),
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('session_id', 'idempotency_key', name='uq_reward_idempotency')
    )
    op.create_index(op.f('ix_rewards_session_id'), 'rewards', ['session_id'], unique=False)
    op.create_table('sessions',
    sa.Column('id', sa.String(length=256), nullable=False),
    sa.Column('group_id', sa.String(length=256), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.Column('lease_owner', sa.String(length=64), nullable=True),
    sa.Column('lease_until', sa.DateTime(), nullable=True),
    sa.Column('trained_version', sa.Integer(), nullable=True),
    sa.Column('skip_reason', sa.String(length=32), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_sessions_group_id'), 'sessions', ['group_id'], unique=False)
    op.create_index(op.f('ix_sessions_owner'), 'sessions', ['owner'], unique=False)
    op.create_index(op.f('ix_sessions_trained_version'), 'sessions', ['trained_version'], unique=False)
    op.create_table('calls',
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('completion_id', sa.String(length=128), nullable=False),
    sa.Column('choice_index', sa.Integer(), nullable=False),
    sa.Column('session_id', sa.String(length=256), nullable=False),
    sa.Column('group_id', sa.String(length=256), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('parent_id', sa.String(length=128), nullable=True),
    sa.Column('link', sa.String(length=32), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('finish_reason', sa.String(length=32), nullable=True),
    sa.Column('prefix_len', sa.Integer(), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('latency_ms', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=True),
    sa.Column('state_hash', sa.String(length=64), nullable=False),
    sa.Column('prompt_ids', sa.LargeBinary(), nullable=False),
    sa.Column('completion_ids', sa.LargeBinary(), nullable=False),
    sa.Column('completion_logprobs', sa.LargeBinary(), nullable=False),
    sa.Column('messages', sa.JSON(), nullable=False),
    sa.Column('response_message', sa.JSON(), nullable=False),
    sa.Column('request_params', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_calls_completion_id'), 'calls', ['completion_id'], unique=False)
    op.create_index(op.f('ix_calls_session_id'), 'calls', ['session_id'], unique=False)
    op.create_index(op.f('ix_calls_state_hash'), 'calls', ['state_hash'], unique=False)


def downgrade() -> None:
    for table in ("calls", "sessions", "rewards", "policies"):
        op.drop_table(table)
