"""Versions per named policy: `policies` gains `line` and is keyed by (line, version), so each named policy
numbers its own versions from 0 (its base model). Every version a store held before is the default line's.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import sqlalchemy as sa
from alembic import op
from sqlalchemy import exc as sa_exc

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


@contextlib.contextmanager
def _new_key_over_old() -> Iterator[None]:
    """The copied table's reflected columns still carry the old primary key, which the new one replaces, as
    meant; SQLAlchemy warns of exactly that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Table '_alembic_tmp_policies' specifies columns",
                                category=sa_exc.SAWarning)
        yield


def upgrade() -> None:
    # Batch mode: SQLite cannot change a primary key in place, so the table is copied (no foreign key
    # points at `policies`, so the copy trips none); PostgreSQL alters it.
    with _new_key_over_old(), op.batch_alter_table("policies", recreate="always") as batch:
        batch.add_column(sa.Column("line", sa.String(length=64), nullable=False, server_default="default"))
        batch.create_primary_key("pk_policies", ["line", "version"])


def downgrade() -> None:
    # Only the default line's versions fit a table keyed by version alone.
    op.execute("DELETE FROM policies WHERE line <> 'default'")
    with _new_key_over_old(), op.batch_alter_table("policies", recreate="always") as batch:
        batch.drop_column("line")
        batch.create_primary_key("pk_policies", ["version"])
