"""The models and the migrations agree, on PostgreSQL and on SQLite."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from wm import Settings, store
from wm.store.models import Base


def test_models_and_migrations_agree(settings: Settings) -> None:
    assert store.current_revision(settings) == store.head_revision(settings)
    with store.engine_for(settings).connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_upgrade_is_idempotent_and_downgrade_works(settings: Settings) -> None:
    store.upgrade(settings)
    from alembic import command

    command.downgrade(store.alembic_config(settings), "0001")
    assert store.current_revision(settings) == "0001"
    command.downgrade(store.alembic_config(settings), "base")
    assert store.current_revision(settings) is None
    store.upgrade(settings)
    assert store.current_revision(settings) == store.head_revision(settings) == "0004"
