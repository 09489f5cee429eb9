"""The persistent model (SQLAlchemy 2.0). PostgreSQL is the source of truth; Redis only
holds state that can be rebuilt from these tables."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    Uuid,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from wm.names import DEFAULT_TENANT, MAX_TENANT_CHARS
from wm.text import MAX_TEXT_CHARS, storable

_NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class FreeText(TypeDecorator[str]):
    """A ``TEXT`` column of text from outside (error messages, reasons, request paths,
    envelopes): made :func:`~wm.text.storable` on the way in, so no value can fail its
    write (and be retried for ever), bounded by ``limit`` (None: a whole message, kept as
    it came)."""

    impl = Text
    cache_ok = True

    def __init__(self, *, limit: int | None = MAX_TEXT_CHARS) -> None:
        super().__init__()
        self.limit = limit

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else storable(value, self.limit)


class FreeString(TypeDecorator[str]):
    """A ``VARCHAR(length)`` column of text from outside (an event id, an error type):
    :func:`~wm.text.storable` and cut to the column's length on the way in."""

    impl = String
    cache_ok = True

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.limit = length

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else storable(value, self.limit)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=_NAMING)


def tenant_column() -> Mapped[str]:
    """The tenant a row belongs to (``wm.names.check_tenant``); rows written by code that
    names none, and every row of earlier releases, are in the default tenant."""
    return mapped_column(
        String(MAX_TENANT_CHARS),
        default=DEFAULT_TENANT,
        server_default=DEFAULT_TENANT,
        index=True,
    )


class Tenant(Base):
    """A tenant: workers, subscriptions, schedules and dead letters of one tenant never meet
    another's (``wm.names.route_topic``). The default tenant always exists."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(MAX_TENANT_CHARS), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    #: The tenant's limits (``wm.tenantlimits``; NULL: unlimited): deliveries running at
    #: once and begun per second across the cluster, and live workers.
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    rate_limit: Mapped[float | None] = mapped_column(Float)
    max_workers: Mapped[int | None] = mapped_column(Integer)


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = tenant_column()
    name: Mapped[str | None] = mapped_column(String(200))
    #: The route topic (``wm.names.route_topic``): ``<tenant>::<topic>`` outside the default
    #: tenant, so routing, queues and shared groups never meet another tenant's.
    topic: Mapped[str] = mapped_column(String(255), index=True)
    group: Mapped[str | None] = mapped_column(String(255), index=True)
    mime_type: Mapped[str] = mapped_column(String(100))
    status: Mapped[str] = mapped_column(String(20), index=True)
    current_version: Mapped[int] = mapped_column(Integer)
    settings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )
    #: When it last entered ``running``, and when it entered its current state.
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    status_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    row_version: Mapped[int] = mapped_column(Integer, nullable=False)

    __mapper_args__ = {"version_id_col": row_version}
    __table_args__ = (
        # Names are unique among a tenant's live workers; a deleted worker's name may be reused.
        Index(
            "uq_workers_live_name",
            "tenant",
            "name",
            unique=True,
            postgresql_where=text("status <> 'deleted'"),
            sqlite_where=text("status <> 'deleted'"),
        ),
    )


class WorkerVersion(Base):
    __tablename__ = "worker_versions"

    worker_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("workers.id"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant: Mapped[str] = tenant_column()
    source_kind: Mapped[str] = mapped_column(String(10))
    url: Mapped[str | None] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(Integer)
    code: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    note: Mapped[str | None] = mapped_column(FreeText())


class WorkerTransition(Base):
    __tablename__ = "worker_transitions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    worker_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("workers.id"), index=True)
    from_status: Mapped[str | None] = mapped_column(String(20))
    to_status: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str] = mapped_column(FreeText(), default="")
    version: Mapped[int | None] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    #: Who asked (``wm.lifecycle.ACTORS``), and how long the worker was in ``from_status``.
    actor: Mapped[str | None] = mapped_column(String(20))
    duration_ms: Mapped[int | None] = mapped_column(BigInteger)


class Subscription(Base):
    """A durable queue fed by a topic: one per worker, plus plain named subscriptions."""

    __tablename__ = "subscriptions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = tenant_column()
    #: The route topic (``wm.names.route_topic``).
    topic: Mapped[str] = mapped_column(String(255), index=True)
    queue: Mapped[str] = mapped_column(String(512), unique=True)
    worker_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("workers.id"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class OutboxEvent(Base):
    """A lifecycle event written in the transaction of its state change, sent after commit."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    topic: Mapped[str] = mapped_column(String(255))
    payload: Mapped[str] = mapped_column(FreeText(limit=None))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DeadLetter(Base):
    """A delivery that exhausted its retries or could not be processed at all."""

    __tablename__ = "dead_letters"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = tenant_column()
    #: The route topic (``wm.names.route_topic``).
    topic: Mapped[str] = mapped_column(String(255), index=True)
    worker_id: Mapped[uuid.UUID | None] = mapped_column(Uuid, index=True)
    event_id: Mapped[str | None] = mapped_column(FreeString(255))
    envelope: Mapped[str] = mapped_column(FreeText(limit=None))
    error_type: Mapped[str] = mapped_column(FreeString(255), index=True)
    error_message: Mapped[str] = mapped_column(FreeText())
    attempts: Mapped[int] = mapped_column(Integer)
    version: Mapped[int | None] = mapped_column(Integer)
    sha256: Mapped[str | None] = mapped_column(String(64))
    fence: Mapped[int | None] = mapped_column(Integer)
    first_failure_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_failure_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    replay_count: Mapped[int] = mapped_column(Integer, default=0)
    replayed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ApiToken(Base):
    """A bearer token of the admin HTTP API; only the SHA-256 of its secret is kept."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    #: The one tenant its calls work in, or ``*`` (``wm.store.access.ALL_TENANTS``): a
    #: deployment-wide admin token (``wm.control.access``).
    tenant: Mapped[str] = tenant_column()
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(20))
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        # Names are unique among tokens in force; a revoked token's name may be reused.
        Index(
            "uq_api_tokens_live_name",
            "name",
            unique=True,
            postgresql_where=text("revoked_at IS NULL"),
            sqlite_where=text("revoked_at IS NULL"),
        ),
    )


class AuditEntry(Base):
    """One mutating call of the admin HTTP API: who, what, when, and how it ended.

    Written before the call runs (``status_code`` null) and completed after it, so no change
    is made through the API without its row."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    tenant: Mapped[str] = tenant_column()
    token_id: Mapped[str | None] = mapped_column(String(32), index=True)
    token_name: Mapped[str | None] = mapped_column(String(200))
    role: Mapped[str | None] = mapped_column(String(20))
    remote: Mapped[str | None] = mapped_column(FreeString(100))
    method: Mapped[str] = mapped_column(String(10))
    path: Mapped[str] = mapped_column(FreeText())
    action: Mapped[str | None] = mapped_column(FreeText())
    status_code: Mapped[int | None] = mapped_column(Integer)
    result: Mapped[str | None] = mapped_column(FreeText())
    duration_ms: Mapped[float | None] = mapped_column(Float)


class Schedule(Base):
    """A worker's schedule: a cron expression (in a time zone) or an interval, and the event
    each firing sends to the worker (``wm.schedules``, ``wm.dataplane.beat``)."""

    __tablename__ = "schedules"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant: Mapped[str] = tenant_column()
    worker_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("workers.id"), index=True)
    cron: Mapped[str | None] = mapped_column(String(200))
    timezone: Mapped[str] = mapped_column(String(64))
    every_s: Mapped[float | None] = mapped_column(Float)
    event_type: Mapped[str] = mapped_column(String(255))
    data: Mapped[Any] = mapped_column(JSON, nullable=True)
    missed: Mapped[str] = mapped_column(String(10))
    max_catch_up: Mapped[int] = mapped_column(Integer)
    until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    #: The nominal time of the last firing sent (or skipped); firings after it are due.
    last_fired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
