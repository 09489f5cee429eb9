"""Per-tenant limits: ``max_concurrency`` (deliveries running at once across the cluster),
``rate_limit`` (deliveries begun per second across the cluster) and ``max_workers`` (live
workers) on ``tenants``; NULL is unlimited, so every tenant already there, the default one
included, keeps running as before.

Revision ID: 0006_tenant_limits
Revises: 0005
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_tenant_limits"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("max_concurrency", sa.Integer()),
    ("rate_limit", sa.Float()),
    ("max_workers", sa.Integer()),
)


def upgrade() -> None:
    for name, kind in COLUMNS:
        op.add_column("tenants", sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:  # SQLite: drop a column by a copy
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
