"""The models and the migrations agree, on PostgreSQL and on SQLite."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from alembic import command
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
    assert store.current_revision(settings) == store.head_revision(settings) == "0006_tenant_limits"


def test_tenants_migration_puts_existing_rows_in_the_default_tenant(settings: Settings) -> None:
    """0005 on a database of 0004 with rows in every table it changes: each row lands in the
    default tenant, and names become unique per tenant."""
    command.downgrade(store.alembic_config(settings), "0004")
    sqlite = settings.database_url.startswith("sqlite")
    wid, now = uuid.uuid4(), datetime.now(UTC)
    engine = store.engine_for(settings)
    meta = sa.MetaData()
    meta.reflect(engine)
    rows = {
        "workers": dict(
            id=wid, name="orders", topic="in", mime_type="text/x-python", status="running",
            current_version=1, settings={}, created_at=now, updated_at=now, row_version=1,
        ),
        "worker_versions": dict(
            worker_id=wid, version=1, source_kind="inline", sha256="0" * 64, size=1,
            code=b"x", created_at=now,
        ),
        "subscriptions": dict(topic="in", queue=f"in::{wid}", worker_id=wid, created_at=now),
        "schedules": dict(
            id="s1", worker_id=wid, timezone="UTC", every_s=1.0, event_type="tick",
            missed="skip", max_catch_up=1, created_at=now,
        ),
        "dead_letters": dict(
            id="d1", topic="in", worker_id=wid, envelope="{}", error_type="E",
            error_message="m", attempts=1, first_failure_at=now, last_failure_at=now,
            replay_count=0,
        ),
        "api_tokens": dict(
            id="t1", name="ci", role="admin", secret_sha256="0" * 64, created_at=now
        ),
        "audit_log": dict(at=now, method="POST", path="/v1/workers"),
    }  # fmt: skip
    with engine.begin() as conn:
        for table, row in rows.items():
            raw = {k: v.hex if sqlite and isinstance(v, uuid.UUID) else v for k, v in row.items()}
            conn.execute(meta.tables[table].insert().values(**raw))
    store.dispose_engines()
    store.upgrade(settings)
    with store.engine_for(settings).begin() as conn:
        for table in rows:
            found = conn.execute(sa.text(f"SELECT tenant FROM {table}")).scalars().all()
            assert found == ["default"], table
        assert conn.execute(sa.text("SELECT name FROM tenants")).scalars().all() == ["default"]
        insert = sa.text(
            "INSERT INTO workers (id, tenant, name, topic, mime_type, status, current_version,"
            " settings, created_at, updated_at, row_version) VALUES (:id, :tenant, 'orders',"
            " 'in', 'text/x-python', 'running', 1, '{}', :now, :now, 1)"
        )
        first, second = uuid.uuid4(), uuid.uuid4()
        conn.execute(insert, {"id": first.hex if sqlite else first, "tenant": "acme", "now": now})
    with pytest.raises(sa.exc.IntegrityError), store.engine_for(settings).begin() as conn:
        # one "orders" per tenant: a second in acme is refused
        conn.execute(insert, {"id": second.hex if sqlite else second, "tenant": "acme", "now": now})
