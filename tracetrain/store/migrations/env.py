"""Alembic's environment for the store: always run from code (`tracetrain.store.schema`) on a
connection it hands over, never from an ini file."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import tracetrain.store.models  # noqa: F401  (the tables, for comparisons)

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=SQLModel.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
