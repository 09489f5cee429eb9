"""Initial schema: workers, versions, transitions, subscriptions, outbox, dead letters.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)
_LIVE = sa.text("status <> 'deleted'")


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(200), nullable=True),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("group", sa.String(255), nullable=True),
        sa.Column("mime_type", sa.String(100), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("current_version", sa.Integer(), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("row_version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    op.create_index(op.f("ix_workers_group"), "workers", ["group"])
    op.create_index(op.f("ix_workers_status"), "workers", ["status"])
    op.create_index(op.f("ix_workers_topic"), "workers", ["topic"])
    op.create_index(
        "uq_workers_live_name",
        "workers",
        ["name"],
        unique=True,
        postgresql_where=_LIVE,
        sqlite_where=_LIVE,
    )
    op.create_table(
        "worker_versions",
        sa.Column("worker_id", sa.Uuid(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("source_kind", sa.String(10), nullable=False),
        sa.Column("url", sa.Text(), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("code", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_worker_versions_worker_id_workers")
        ),
        sa.PrimaryKeyConstraint("worker_id", "version", name=op.f("pk_worker_versions")),
    )
    op.create_table(
        "worker_transitions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("worker_id", sa.Uuid(), nullable=False),
        sa.Column("from_status", sa.String(20), nullable=True),
        sa.Column("to_status", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_worker_transitions_worker_id_workers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_worker_transitions")),
    )
    op.create_index(op.f("ix_worker_transitions_worker_id"), "worker_transitions", ["worker_id"])
    op.create_table(
        "subscriptions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("queue", sa.String(512), nullable=False),
        sa.Column("worker_id", sa.Uuid(), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["worker_id"], ["workers.id"], name=op.f("fk_subscriptions_worker_id_workers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_subscriptions")),
        sa.UniqueConstraint("queue", name=op.f("uq_subscriptions_queue")),
    )
    op.create_index(op.f("ix_subscriptions_topic"), "subscriptions", ["topic"])
    op.create_table(
        "outbox",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
    )
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("worker_id", sa.Uuid(), nullable=True),
        sa.Column("event_id", sa.String(255), nullable=True),
        sa.Column("envelope", sa.Text(), nullable=False),
        sa.Column("error_type", sa.String(255), nullable=False),
        sa.Column("error_message", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("fence", sa.Integer(), nullable=True),
        sa.Column("first_failure_at", _TS, nullable=False),
        sa.Column("last_failure_at", _TS, nullable=False),
        sa.Column("replay_count", sa.Integer(), nullable=False),
        sa.Column("replayed_at", _TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dead_letters")),
    )
    op.create_index(op.f("ix_dead_letters_error_type"), "dead_letters", ["error_type"])
    op.create_index(op.f("ix_dead_letters_topic"), "dead_letters", ["topic"])
    op.create_index(op.f("ix_dead_letters_worker_id"), "dead_letters", ["worker_id"])


def downgrade() -> None:
    for table in (
        "dead_letters",
        "outbox",
        "subscriptions",
        "worker_transitions",
        "worker_versions",
        "workers",
    ):
        op.drop_table(table)
