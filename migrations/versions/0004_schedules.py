"""Schedules: cron expressions or intervals that send events to a worker.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("worker_id", sa.Uuid(), nullable=False),
        sa.Column("cron", sa.String(200), nullable=True),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("every_s", sa.Float(), nullable=True),
        sa.Column("event_type", sa.String(255), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.Column("missed", sa.String(10), nullable=False),
        sa.Column("max_catch_up", sa.Integer(), nullable=False),
        sa.Column("until", _TS, nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("last_fired_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_schedules_worker_id_workers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedules")),
    )
    op.create_index(op.f("ix_schedules_worker_id"), "schedules", ["worker_id"])


def downgrade() -> None:
    op.drop_table("schedules")
