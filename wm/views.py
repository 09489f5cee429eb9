"""Immutable views of workers, versions, transitions, dead letters, recoveries, admin API
tokens and audit entries returned by the API (never ORM rows; ``wm.store`` builds them from
rows)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, overload

from wm.names import DEFAULT_TENANT
from wm.tenantlimits import TenantLimits


@dataclass(frozen=True)
class WorkerInfo:
    id: uuid.UUID
    name: str | None
    topic: str
    group: str | None
    mime_type: str
    status: str
    current_version: int
    sha256: str
    size: int
    settings: Mapping[str, Any]
    created_at: datetime
    updated_at: datetime
    #: When it last entered ``running``, and when it entered its current status.
    started_at: datetime | None = None
    status_since: datetime | None = None
    #: healthy, degraded, unhealthy or unknown (``wm.state.health``), beside the status.
    health: str = "unknown"
    #: The tenant it belongs to; ``topic`` is the topic as its tenant names it.
    tenant: str = DEFAULT_TENANT
    #: Why no node consumes its queue though it runs: ``unhealthy`` while its health pauses
    #: it (``pause_when_unhealthy``); None when it is not paused.
    paused: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class SessionInfo:
    """A session's binding to an engine instance (``wm session show``;
    docs/guides/session-affinity.md): the instance (``host:pid``) and the seconds it has left,
    None when unbound."""

    worker_id: uuid.UUID
    session: str
    instance: str | None
    expires_in_s: float | None

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class TenantInfo:
    """A tenant (``wm tenant list``), how many live workers it has and its limits."""

    name: str
    created_at: datetime
    workers: int = 0
    limits: TenantLimits = field(default_factory=TenantLimits)

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class VersionInfo:
    worker_id: uuid.UUID
    version: int
    source_kind: str
    url: str | None
    sha256: str
    size: int
    created_at: datetime
    note: str | None

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class TransitionInfo:
    worker_id: uuid.UUID
    from_status: str | None
    to_status: str
    reason: str
    version: int | None
    at: datetime
    #: Who asked (``wm.lifecycle.ACTORS``; None for rows written before it was recorded),
    #: and how long the worker had been in ``from_status`` (None when the status stayed).
    actor: str | None = None
    duration_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class DeadLetterInfo:
    id: str
    topic: str
    worker_id: str | None
    event_id: str | None
    error_type: str
    error_message: str
    attempts: int
    version: int | None
    sha256: str | None
    fence: int | None
    first_failure_at: datetime
    last_failure_at: datetime
    replay_count: int
    replayed_at: datetime | None
    envelope: str

    def to_json(self, *, envelope: bool = True) -> dict[str, Any]:
        """The fields as JSON, the envelope (the event as it failed) as the JSON object it
        is, not JSON in a string; an envelope that is no JSON object stays its text."""
        data = _jsonable(asdict(self))
        if envelope:
            data["envelope"] = _json_object_or_text(self.envelope)
        else:
            data.pop("envelope")
        return data


def _json_object_or_text(text: str) -> Any:
    """``text`` parsed when it is a JSON object or array: any other text (cut, malformed, a
    bare JSON string or number) is kept as it is, so a reader never mistakes one for the
    other."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if isinstance(parsed, dict | list) else text


@dataclass(frozen=True)
class ScheduleInfo:
    id: str
    worker_id: uuid.UUID
    cron: str | None
    timezone: str
    every_s: float | None
    event_type: str
    data: Any
    missed: str
    max_catch_up: int
    until: datetime | None
    created_at: datetime
    last_fired_at: datetime | None
    #: When it fires next (None once ``until`` has passed).
    next_fire_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class RecoveryFailure:
    """A worker (or a plain subscription) that recovery could not bring back; recovery goes
    on with the others, and delivery to this one fails until the cause is fixed."""

    worker_id: uuid.UUID | None
    name: str | None
    queue: str
    reason: str


@dataclass(frozen=True)
class RecoveryReport:
    """What one recovery did (``wm recover``, ``POST /v1/recover``, a node's log)."""

    #: Who led it: a node's name, or who asked (``cli@host``, ``api@host``).
    holder: str
    #: Routing-table entries added or removed to match the database.
    routes_repaired: int
    #: Queues (re-)declared on the broker, one per subscription queue.
    queues_declared: int
    #: Running workers whose code and engine were checked.
    workers_checked: int
    #: Lifecycle events left in the outbox, published now.
    events_published: int
    failures: list[RecoveryFailure]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return list(Role).index(self)

    def allows(self, needed: Role) -> bool:
        return self.rank >= needed.rank


@dataclass(frozen=True)
class TokenInfo:
    id: str
    name: str
    role: Role
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None
    #: The one tenant it works in, or None: a deployment-wide admin token, which may name
    #: any tenant (``WM-Tenant``; ``wm.control.access``).
    tenant: str | None = DEFAULT_TENANT

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass(frozen=True)
class AuditInfo:
    id: int
    at: datetime
    token_id: str | None
    token_name: str | None
    role: str | None
    remote: str | None
    method: str
    path: str
    action: str | None
    status_code: int | None
    result: str | None
    duration_ms: float | None
    #: The tenant the call worked in.
    tenant: str = DEFAULT_TENANT

    def to_json(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@overload
def aware(at: datetime) -> datetime: ...
@overload
def aware(at: None) -> None: ...
def aware(at: datetime | None) -> datetime | None:
    """``at`` with its zone: SQLite hands back naive datetimes, and WorkManager writes UTC."""
    return at.replace(tzinfo=UTC) if at is not None and at.tzinfo is None else at


def jsonable(value: Any) -> Any:
    """``value`` ready for JSON at any depth: times in RFC 3339 with their zone, ids as
    text (the Python API's objects, the HTTP API and ``wm --json`` show the same)."""
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, datetime):
        return aware(value).isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return {key: jsonable(value) for key, value in data.items()}
