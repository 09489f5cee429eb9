"""Immutable views of workers, versions, transitions, dead letters, recoveries, admin API
tokens, audit entries and the status read models returned by the API (never ORM rows;
``wm.store`` builds them from rows). :func:`from_json` reads one back from the JSON its
``to_json`` (or the HTTP API) wrote, for the command line's reads through the API."""

from __future__ import annotations

import functools
import json
import types
import typing
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from datetime import UTC, datetime
from enum import Enum, StrEnum
from typing import Any, TypeVar, overload

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


# -- read models: the cluster at a glance, one worker in detail ------------------------------


@dataclass(frozen=True)
class QueueDepth:
    worker_id: str
    name: str | None
    topic: str
    queue: str
    depth: int


@dataclass(frozen=True)
class BreakerInfo:
    worker_id: str
    name: str | None
    status: str
    state: str
    #: What reaching the threshold does (the worker's ``recovery`` setting).
    strategy: str
    consecutive_failures: int
    threshold: int
    #: Times it opened in a row (sets the next back-off); 0 once a delivery succeeds.
    trips: int
    #: When an open breaker half-opens (its back-off ends); None in any other state.
    retry_at: datetime | None = None


@dataclass(frozen=True)
class Recovery:
    #: Seconds left of the recovery leader lease while a starting node recovers, else None.
    leader_lease_s: float | None
    #: The node that maintains the cluster (routing table, sweeps, health) when known.
    maintaining_node: str | None
    #: Breakers of live workers that are not closed, or that count failures in a row.
    breakers: list[BreakerInfo]


@dataclass(frozen=True)
class Overview:
    at: datetime
    #: Nodes that answered the ping, by name; None when the broker is unavailable.
    nodes: list[str] | None
    #: Live workers (not deleted), and how many are in each status and health (and
    #: ``paused``: running but paused while unhealthy, when any is).
    workers: int
    by_status: dict[str, int]
    by_health: dict[str, int] | None
    #: Messages waiting in every worker queue, and the deepest non-empty queues.
    queued: int | None
    deepest_queues: list[QueueDepth] | None
    #: Dead letters not replayed, per topic.
    dead_letters: dict[str, int]
    recovery: Recovery | None
    #: Service → why the parts that need it are None.
    unavailable: dict[str, str]
    #: Every tenant (with a tenant: its own) with its limits and, where it has a delivery
    #: limit, its use.
    tenants: list[TenantUse] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = jsonable(asdict(self))
        return data


@dataclass(frozen=True)
class TenantUse:
    """A tenant's limits and use: deliveries running now and begun in the last whole second,
    across the cluster; None where the tenant has no ``max_concurrency`` or ``rate_limit``
    (only a limited tenant's deliveries are counted: the others pay nothing), or Redis does
    not answer."""

    name: str
    workers: int
    limits: TenantLimits
    in_flight: int | None = None
    rate: int | None = None


@dataclass(frozen=True)
class DeliveryCounts:
    """Delivery attempts of a worker counted since ``since`` (Redis keeps them per clock
    minute, so a window starts at a minute's start)."""

    since: datetime
    ok: int
    failed: int


@dataclass(frozen=True)
class LastError:
    at: datetime
    #: Where it was recorded: ``dead letter``, ``transition`` or ``probe``.
    source: str
    message: str
    error_type: str | None = None


@dataclass(frozen=True)
class WorkerDetails:
    worker: WorkerInfo
    queue: str
    #: Messages waiting in the queue; None when the broker is unavailable.
    queue_depth: int | None
    #: Dead letters of the worker not replayed.
    dead_letters: int
    last_error: LastError | None
    #: Deliveries since the previous clock minute began, and within the health window.
    deliveries_last_minute: DeliveryCounts | None
    deliveries_window: DeliveryCounts | None
    breaker: BreakerInfo | None
    unavailable: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        """The worker's own fields, then these."""
        extras = jsonable({k: v for k, v in asdict(self).items() if k != "worker"})
        return {**self.worker.to_json(), **extras}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkerDetails:
        """What :meth:`to_json` wrote, the worker's fields among the others."""
        own = {f.name for f in fields(cls)}
        worker = from_json(WorkerInfo, {k: v for k, v in data.items() if k not in own})
        return from_json(cls, {**data, "worker": worker})


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


def field_errors(errors: Iterable[Mapping[str, Any]]) -> str:
    """A 422's detail (each field the API refused, and why) in one line, as the API
    records it and the command line says it: ``body.topic: msg; query.limit: msg``."""
    return "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in errors)


V = TypeVar("V")


def from_json(kind: type[V], data: Mapping[str, Any]) -> V:
    """A view of ``kind`` (a dataclass of this module) from the JSON its ``to_json`` wrote:
    times, ids, roles and nested views as their types; a field the JSON lacks keeps its
    default (an older server's answer), and one it has beyond them is ignored (a newer
    one's)."""
    hints = _hints(kind)  # type: ignore[arg-type]
    names = [f.name for f in fields(kind) if f.name in data]  # type: ignore[arg-type]
    return kind(**{name: _typed(hints[name], data[name]) for name in names})


@functools.cache
def _hints(kind: type) -> dict[str, Any]:
    return typing.get_type_hints(kind)


def _typed(hint: Any, value: Any) -> Any:
    if value is None or hint is Any:
        return value
    if isinstance(hint, types.UnionType):
        kinds = [k for k in typing.get_args(hint) if k is not type(None)]
        return _typed(kinds[0], value) if len(kinds) == 1 else value
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return [_typed(item, v) for v in value]
    if hint is datetime:
        return datetime.fromisoformat(value)
    if hint is uuid.UUID:
        return uuid.UUID(value)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(value)
    if isinstance(hint, type) and is_dataclass(hint):
        return value if isinstance(value, hint) else from_json(hint, value)
    return value


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return {key: jsonable(value) for key, value in data.items()}
