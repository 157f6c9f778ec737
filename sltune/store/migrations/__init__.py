"""Alembic migrations of sltune's own tables."""
