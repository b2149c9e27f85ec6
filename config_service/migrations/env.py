"""Alembic environment: migrations run on the connection config_service.store passes in."""

from __future__ import annotations

from alembic import context

from config_service.store import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
