"""A process's PostgreSQL connections: closed when it lets its engines go, and left to the
parent by a pool process just forked (``wm.store.dispose_engines``)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.helpers import eventually
from wm import Settings, store


@pytest.fixture
def no_collection() -> Iterator[None]:
    """A dropped connection closes when the garbage collector finds it: not during the test."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _backend(settings: Settings) -> int:
    with store.engine_for(settings).connect() as conn:
        return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def _open(settings: Settings, backend: int) -> bool:
    admin = sa.create_engine(settings.database_url, poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid")
        found = conn.execute(query, {"pid": backend}).scalar_one()
    admin.dispose()
    return bool(found)


def test_letting_the_engines_go_closes_their_connections(
    pg_settings: Settings, no_collection: None
) -> None:
    backend = _backend(pg_settings)
    assert _open(pg_settings, backend)  # idle in the pool
    store.dispose_engines()
    eventually(lambda: not _open(pg_settings, backend), timeout_s=10)


def test_a_forked_pool_process_leaves_its_parents_connections_open(
    pg_settings: Settings, no_collection: None
) -> None:
    backend = _backend(pg_settings)
    child = os.fork()
    if child == 0:  # what a pool process does first (wm.dataplane.node.on_process_init)
        try:
            store.dispose_engines(close=False)
            gc.collect()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert _backend(pg_settings) == backend  # the same connection, still open
