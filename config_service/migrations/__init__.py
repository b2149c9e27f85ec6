"""Alembic migrations of the config store (run programmatically by config_service.store.migrate)."""
