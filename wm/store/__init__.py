"""PostgreSQL, the source of truth: sessions and error translation (``db``), the schema and
its migrations (``schema``), the tables (``models``), and the writes every change is made of
(``records``: transactions, transitions, outbox rows)."""

from wm.store.db import database_errors, dispose_engines, engine_for, safe_url, session_scope
from wm.store.schema import alembic_config, current_revision, head_revision, upgrade

__all__ = [
    "alembic_config",
    "current_revision",
    "database_errors",
    "dispose_engines",
    "engine_for",
    "head_revision",
    "safe_url",
    "session_scope",
    "upgrade",
]
