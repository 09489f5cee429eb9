"""Tenants: a ``tenants`` table (with the default tenant) and a tenant on every worker,
version, schedule, subscription, dead letter, token and audit row, ``default`` for the rows
already there. Worker names become unique per tenant.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT = "default"
TABLES = (
    "workers",
    "worker_versions",
    "schedules",
    "subscriptions",
    "dead_letters",
    "api_tokens",
    "audit_log",
)
_LIVE = sa.text("status <> 'deleted'")


def upgrade() -> None:
    tenants = op.create_table(
        "tenants",
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_tenants")),
    )
    op.bulk_insert(tenants, [{"name": DEFAULT, "created_at": datetime.now(UTC)}])
    for table in TABLES:
        op.add_column(
            table,
            sa.Column("tenant", sa.String(63), nullable=False, server_default=DEFAULT),
        )
        op.create_index(op.f(f"ix_{table}_tenant"), table, ["tenant"])
    op.drop_index("uq_workers_live_name", table_name="workers")
    _live_name_index(["tenant", "name"])


def downgrade() -> None:
    op.drop_index("uq_workers_live_name", table_name="workers")
    _live_name_index(["name"])
    for table in TABLES:
        op.drop_index(op.f(f"ix_{table}_tenant"), table_name=table)
        with op.batch_alter_table(table) as batch:  # SQLite: drop a column by a copy
            batch.drop_column("tenant")
    op.drop_table("tenants")


def _live_name_index(columns: list[str]) -> None:
    op.create_index(
        "uq_workers_live_name",
        "workers",
        columns,
        unique=True,
        postgresql_where=_LIVE,
        sqlite_where=_LIVE,
    )
