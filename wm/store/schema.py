"""The schema: Alembic migrations (``wm db upgrade``) and where the database stands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wm.config import Settings
from wm.errors import StoreUnavailable
from wm.store.db import database_errors, engine_for, safe_url

_MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(settings: Settings) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", settings.database_url.replace("%", "%%"))
    config.attributes["settings"] = settings
    return config


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (``wm db upgrade``)."""
    from alembic import command
    from alembic.util.exc import CommandError

    engine_for(settings)  # a URL no engine can be made for is refused here, before Alembic
    with database_errors(settings):
        try:
            command.upgrade(alembic_config(settings), revision)
        except CommandError as exc:  # the database is at a revision these migrations lack
            raise StoreUnavailable(
                f"database {safe_url(settings)} cannot be migrated to {revision} ({exc}); was "
                "it migrated by a newer WorkManager?"
            ) from exc


def current_revision(settings: Settings) -> str | None:
    """The revision the database is at, or None if it was never migrated."""
    from alembic.runtime.migration import MigrationContext

    with database_errors(settings), engine_for(settings).connect() as conn:
        rev: str | None = MigrationContext.configure(conn).get_current_revision()
        return rev


def head_revision(settings: Settings) -> str | None:
    from alembic.script import ScriptDirectory

    head: str | None = ScriptDirectory.from_config(alembic_config(settings)).get_current_head()
    return head
