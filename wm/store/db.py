"""Database access: one pooled engine per URL and process, transactions, and the one
translation of database errors (PostgreSQL, or SQLite for the embedded default)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from wm.config import Settings, masked
from wm.errors import ConfigurationError, MissingDependency, StoreUnavailable
from wm.extras import install_hint

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


#: What PostgreSQL says at a connection limit: the server's, a role's, a database's, the
#: slots it keeps for superusers (SQLSTATE 53300, which psycopg does not give for a refused
#: connection).
_NO_FREE_CONNECTION = (
    "too many clients already",
    "too many connections for",
    "remaining connection slots are reserved",
)

#: Fragments of driver messages that mean "try again": SQLite busy, PostgreSQL conflicts.
_TRANSIENT = ("database is locked", "could not serialize", "deadlock detected")


def engine_for(settings: Settings) -> Engine:
    """One pooled engine per database URL and process (recreated after fork by SQLAlchemy).

    A URL that names no database this installation can open raises
    :class:`~wm.errors.ConfigurationError`, or :class:`~wm.errors.MissingDependency` when
    its driver is not installed."""
    url = settings.database_url
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            with _url_errors(url):
                engine = _create_engine(url)
            _engines[url] = engine
        return engine


@contextmanager
def _url_errors(url: str) -> Iterator[None]:
    """Translate what building an engine for ``url`` raises: a malformed URL or an unknown
    dialect, a driver that is not installed, a SQLite directory that cannot be made."""
    try:
        yield
    except sa.exc.ArgumentError as exc:
        raise ConfigurationError(
            f"{_where(url)} names no database WorkManager can use ({exc})"
        ) from exc
    except ImportError as exc:
        raise MissingDependency(
            f"{_where(url)} needs the driver module {exc.name!r}, which is not installed: "
            f"{_install_hint(url, exc.name)}"
        ) from exc
    except OSError as exc:
        raise ConfigurationError(
            f"{_where(url)}: the SQLite file's directory cannot be made ({exc}); fix the setting"
        ) from exc


def _where(url: str) -> str:
    """The setting and its URL, password masked (kombu's parser: only when an error needs
    it)."""
    return f"WM_DATABASE_URL={masked(url)}"


#: The driver WorkManager's ``[postgres]`` extra installs, and its URL scheme.
_POSTGRES_DRIVER, _POSTGRES_SCHEME = "psycopg", "postgresql+psycopg://"


def _install_hint(url: str, module: str | None) -> str:
    if not url.startswith("postgres"):
        return f"install it, or use {_POSTGRES_SCHEME} or sqlite:///"
    if module == _POSTGRES_DRIVER:
        return f"{install_hint('postgres')} installs it"
    return (
        f"install it, or use {_POSTGRES_SCHEME}, whose driver {install_hint('postgres')} installs"
    )


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


def dispose_engines(*, close: bool = True) -> None:
    """Close this process's pooled connections and forget its engines. After a fork, the
    child passes ``close=False``: the connections it inherited are its parent's, which
    closing would end; dropping them leaves the parent's untouched. (Dropped, not closed,
    a connection stays open on the server until the garbage collector finds it.)"""
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose(close=close)
        _engines.clear()


@contextmanager
def session_scope(settings: Settings) -> Iterator[Session]:
    """A transaction: committed on success, rolled back on any error."""
    factory = sessionmaker(engine_for(settings), expire_on_commit=False)
    session = factory()
    try:
        with database_errors(settings):
            yield session
            session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


@contextmanager
def database_errors(settings: Settings) -> Iterator[None]:
    """Turn a driver error raised inside the block into :class:`StoreUnavailable`.

    A constraint violation passes through: the caller knows which constraint means what.
    """
    try:
        yield
    except sa.exc.IntegrityError:
        raise
    except sa.exc.DBAPIError as exc:
        raise translate(settings, exc) from exc


def translate(settings: Settings, exc: sa.exc.DBAPIError) -> StoreUnavailable:
    """The operator's view of a driver error: what failed and what to check."""
    text = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
    if any(fragment in text for fragment in _NO_FREE_CONNECTION):
        return StoreUnavailable(
            f"database {safe_url(settings)} has no free connection ({text}): each WorkManager "
            "process keeps up to 5 idle and opens up to 15; raise PostgreSQL's max_connections "
            "(or the role's or database's CONNECTION LIMIT), or put a pooler such as PgBouncer "
            "in front of it"
        )
    if any(fragment in text for fragment in _TRANSIENT):
        return StoreUnavailable(f"database busy: {text}", transient=True)
    if text.startswith("no such table"):  # SQLite: an empty file, often a relative path
        return StoreUnavailable(
            f"database {safe_url(settings)} has no WorkManager tables ({text}): "
            f"{_sqlite_place(settings.database_url)}check WM_DATABASE_URL (`wm up` writes "
            "it to .wm/env), or run `wm db upgrade` to make a new database there"
        )
    return StoreUnavailable(
        f"database {safe_url(settings)} refused the operation ({text}); check "
        "WM_DATABASE_URL and that `wm db upgrade` ran"
    )


def _sqlite_place(url: str) -> str:
    """Where a relative SQLite path led, for an error: it depends on the working directory."""
    database = sa.make_url(url).database or ""
    if not database or database == ":memory:" or Path(database).is_absolute():
        return ""
    return f"the path is relative, and from here it is the file {Path(database).resolve()}; "


def absolute_sqlite(url: str) -> str:
    """``url`` with a relative SQLite path made absolute (from the working directory), so a
    URL written down (``.wm/env``) names the same file from any directory."""
    parsed = sa.make_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return url
    if Path(database).expanduser().is_absolute():
        return url
    absolute = parsed.set(database=str(Path(database).expanduser().resolve()))
    return absolute.render_as_string(hide_password=False)


def safe_url(settings: Settings) -> str:
    return sa.make_url(settings.database_url).render_as_string(hide_password=True)
