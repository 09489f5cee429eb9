"""Alembic migrations of the worker store (PostgreSQL is the reference; SQLite must migrate)."""
