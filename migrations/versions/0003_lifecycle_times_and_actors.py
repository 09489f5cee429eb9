"""Supervision: when a worker started and entered its state; who asked for each transition
and how long the worker had been in the state it left.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("started_at", _TS, nullable=True))
        batch.add_column(sa.Column("status_since", _TS, nullable=True))
    with op.batch_alter_table("worker_transitions") as batch:
        batch.add_column(sa.Column("actor", sa.String(20), nullable=True))
        batch.add_column(sa.Column("duration_ms", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("worker_transitions") as batch:
        batch.drop_column("duration_ms")
        batch.drop_column("actor")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("status_since")
        batch.drop_column("started_at")
