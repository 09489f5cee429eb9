"""Database access: engines, sessions and Alembic migrations for PostgreSQL and SQLite."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from wm.config import Settings
from wm.errors import DatabaseError

_MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


#: Fragments of driver messages that mean "try again": SQLite busy, PostgreSQL conflicts.
_TRANSIENT = ("database is locked", "could not serialize", "deadlock detected")


def engine_for(settings: Settings) -> Engine:
    """One pooled engine per database URL and process (recreated after fork by SQLAlchemy)."""
    url = settings.database_url
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _create_engine(url)
            _engines[url] = engine
        return engine


def _create_engine(url: str) -> Engine:
    parsed = sa.make_url(url)
    kwargs: dict[str, Any] = {"future": True}
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:":
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"timeout": 30}
    else:
        kwargs["pool_pre_ping"] = True
    engine = sa.create_engine(parsed, **kwargs)
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def dispose_engines() -> None:
    """Drop pooled connections (after fork, or in tests)."""
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose(close=False)
        _engines.clear()


@contextmanager
def session_scope(settings: Settings) -> Iterator[Session]:
    """A transaction: committed on success, rolled back on any error."""
    factory = sessionmaker(engine_for(settings), expire_on_commit=False)
    session = factory()
    try:
        yield session
        session.commit()
    except (sa.exc.OperationalError, sa.exc.ProgrammingError, sa.exc.InterfaceError) as exc:
        session.rollback()
        raise translate(settings, exc) from exc
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def translate(settings: Settings, exc: SQLAlchemyError) -> DatabaseError:
    """The operator's view of a driver error: what failed and what to check."""
    text = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
    if any(fragment in text for fragment in _TRANSIENT):
        return DatabaseError(f"database busy: {text}", transient=True)
    return DatabaseError(
        f"database {_safe_url(settings)} refused the operation ({text}); check "
        "WM_DATABASE_URL and run `wm db upgrade`"
    )


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

    try:
        command.upgrade(alembic_config(settings), revision)
    except SQLAlchemyError as exc:
        raise DatabaseError(f"migrating {_safe_url(settings)} failed: {exc}") from exc


def current_revision(settings: Settings) -> str | None:
    """The revision the database is at, or None if it was never migrated."""
    from alembic.runtime.migration import MigrationContext

    try:
        with engine_for(settings).connect() as conn:
            rev: str | None = MigrationContext.configure(conn).get_current_revision()
            return rev
    except SQLAlchemyError as exc:
        raise DatabaseError(f"cannot read {_safe_url(settings)}: {exc}") from exc


def head_revision(settings: Settings) -> str | None:
    from alembic.script import ScriptDirectory

    head: str | None = ScriptDirectory.from_config(alembic_config(settings)).get_current_head()
    return head


def _safe_url(settings: Settings) -> str:
    return sa.make_url(settings.database_url).render_as_string(hide_password=True)
