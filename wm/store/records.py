"""The writes every change is made of, shared by the admin facade and the data plane: one
transaction retried when a concurrent writer won a race, the worker row locked for update,
a state move checked against the lifecycle table, the transition recorded, and its lifecycle
event written to the outbox (published after commit by ``wm.dataplane.outbox``). Also the
views the API returns, built from rows."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import String, Uuid, cast, func, select
from sqlalchemy import event as orm_events
from sqlalchemy.exc import IntegrityError as SAIntegrityError
from sqlalchemy.orm import InstrumentedAttribute, Session
from sqlalchemy.orm.exc import StaleDataError

from wm.config import Settings
from wm.errors import (
    AmbiguousReference,
    ConcurrencyConflict,
    IllegalTransition,
    InvalidArgument,
    StoreUnavailable,
    WorkerNotFound,
)
from wm.events import LIFECYCLE_TOPIC, encode, lifecycle_event, tenant_fields
from wm.lifecycle import EVENT_ON_ENTER, Status, check_transition
from wm.names import DEFAULT_TENANT, bare_group, route_topic, split_route_topic
from wm.store.db import session_scope
from wm.store.models import (
    DeadLetter,
    OutboxEvent,
    Schedule,
    Worker,
    WorkerTransition,
    WorkerVersion,
)
from wm.text import storable_data
from wm.views import (
    DeadLetterInfo,
    ScheduleInfo,
    TransitionInfo,
    VersionInfo,
    WorkerInfo,
    aware,
)

T = TypeVar("T")
logger = logging.getLogger(__name__)
#: How often a change is retried when a concurrent writer got there first.
CONFLICT_RETRIES = 8


#: Transitions of a session's transaction, logged once it commits (a rolled-back one never
#: happened): seed 004 logs every transition.
_LOGGED = "wm_transitions"


@orm_events.listens_for(Session, "after_commit")
def _log_transitions(session: Session) -> None:
    for line in session.info.pop(_LOGGED, ()):
        logger.info("%s", line)


@orm_events.listens_for(Session, "after_rollback")
def _forget_transitions(session: Session) -> None:
    session.info.pop(_LOGGED, None)


def transaction(
    settings: Settings, change: Callable[[Session], T], *, name_hint: str | None = None
) -> T:
    """Run ``change`` in a transaction, retrying when a concurrent writer won a race.

    ``name_hint`` is the worker name being written, so a unique-name violation is reported
    as such instead of being retried.
    """
    last: Exception | None = None
    for _ in range(CONFLICT_RETRIES):
        try:
            with session_scope(settings) as session:
                return change(session)
        except StaleDataError as exc:
            last = exc
        except StoreUnavailable as exc:
            if not exc.transient:
                raise
            last = exc
        except SAIntegrityError as exc:
            if name_hint is not None and "name" in str(exc.orig).lower():
                raise InvalidArgument(f"a live worker is already named {name_hint!r}") from exc
            last = exc
    raise ConcurrencyConflict(
        f"the change was not applied: the worker kept changing under it ({last}); retry"
    ) from last


def lock_worker(session: Session, wid: uuid.UUID, *, live: bool = False) -> Worker:
    """The worker row, locked for update (PostgreSQL); ``live`` refuses deleted workers."""
    worker = session.scalars(select(Worker).where(Worker.id == wid).with_for_update()).one_or_none()
    if worker is None:
        raise WorkerNotFound(f"no worker with id {wid}")
    if live and worker.status == Status.DELETED:
        raise IllegalTransition(f"worker {wid} is deleted; its code can no longer change")
    return worker


def move(
    session: Session, worker: Worker, target: Status, reason: str, *, actor: str | None = None
) -> None:
    """Change the worker's state if the lifecycle allows it, and record the transition."""
    source = worker.status
    worker.status = check_transition(str(worker.id), source, target).value
    record_transition(
        session, worker, source, target, reason, version=worker.current_version, actor=actor
    )


def record_transition(
    session: Session,
    worker: Worker,
    source: str | None,
    target: Status | str,
    reason: str,
    *,
    version: int | None = None,
    event: str | None = None,
    extra: Mapping[str, Any] | None = None,
    actor: str | None = None,
) -> None:
    """Add the transition to the audit trail and its lifecycle event (if any) to the outbox.

    A change of state also records how long the worker was in the state it left, and
    restarts that clock (``status_since``; ``started_at`` on entering ``running``)."""
    now = datetime.now(UTC)
    duration_ms = _restart_clock(worker, source, target, now)
    session.add(
        WorkerTransition(
            worker_id=worker.id,
            from_status=source,
            to_status=str(target),
            reason=reason,
            version=version,
            at=now,
            actor=actor,
            duration_ms=duration_ms,
        )
    )
    by = f" by {actor}" if actor else ""
    session.info.setdefault(_LOGGED, []).append(
        f"worker {worker.name or worker.id} ({worker.id}): {source or 'new'} → {target}{by}: "
        f"{reason}"
    )
    kind = event or EVENT_ON_ENTER.get(Status(target))
    if kind is None:
        return
    data = {"from_state": source, "to_state": str(target), **(extra or {})}
    add_outbox(session, kind, worker, data, reason=reason, version=version)


def _restart_clock(
    worker: Worker, source: str | None, target: Status | str, now: datetime
) -> int | None:
    """How long the worker was in the state it leaves (ms; None: it stays), its clocks
    restarted."""
    if source == str(target):
        return None
    left = worker.status_since
    worker.status_since = now
    if str(target) == Status.RUNNING:
        worker.started_at = now
    return None if left is None else int((now - aware(left)).total_seconds() * 1000)


def add_outbox(
    session: Session,
    kind: str,
    worker: Worker,
    data: Mapping[str, Any],
    *,
    reason: str,
    version: int | None = None,
) -> None:
    """Write the lifecycle event ``kind`` of ``worker`` to the outbox, in this transaction."""
    payload = {
        "group": bare_group(worker.group),
        "topic": split_route_topic(worker.topic)[1],
        "name": worker.name,
        "version": version or worker.current_version,
        "reason": reason,
        **data,
        **tenant_fields(worker.tenant),
    }
    event = lifecycle_event(kind, str(worker.id), storable_data(payload))
    session.add(OutboxEvent(topic=LIFECYCLE_TOPIC, payload=encode(event)))
    if worker.tenant != DEFAULT_TENANT:  # and to the tenant's own, which its users can read
        tenants_own = route_topic(worker.tenant, LIFECYCLE_TOPIC)
        session.add(OutboxEvent(topic=tenants_own, payload=encode(event)))


# -- views -----------------------------------------------------------------------------------


def worker_info(worker: Worker, version: WorkerVersion) -> WorkerInfo:
    return WorkerInfo(
        id=worker.id,
        name=worker.name,
        topic=split_route_topic(worker.topic)[1],
        group=bare_group(worker.group),
        mime_type=worker.mime_type,
        status=worker.status,
        current_version=worker.current_version,
        sha256=version.sha256,
        size=version.size,
        settings=dict(worker.settings or {}),
        created_at=worker.created_at,
        updated_at=worker.updated_at,
        started_at=worker.started_at,
        status_since=worker.status_since,
        tenant=worker.tenant,
    )


def version_info(row: WorkerVersion) -> VersionInfo:
    return VersionInfo(
        row.worker_id,
        row.version,
        row.source_kind,
        row.url,
        row.sha256,
        row.size,
        row.created_at,
        row.note,
    )


def transition_info(row: WorkerTransition) -> TransitionInfo:
    return TransitionInfo(
        row.worker_id,
        row.from_status,
        row.to_status,
        row.reason,
        row.version,
        row.at,
        row.actor,
        row.duration_ms,
    )


def dead_letter_info(row: DeadLetter) -> DeadLetterInfo:
    return DeadLetterInfo(
        row.id,
        split_route_topic(row.topic)[1],
        str(row.worker_id) if row.worker_id else None,
        row.event_id,
        row.error_type,
        row.error_message,
        row.attempts,
        row.version,
        row.sha256,
        row.fence,
        row.first_failure_at,
        row.last_failure_at,
        row.replay_count,
        row.replayed_at,
        row.envelope,
    )


def schedule_info(row: Schedule) -> ScheduleInfo:
    from wm.schedules import Timing  # croniter: only where a schedule is read

    created, last, until = aware(row.created_at), aware(row.last_fired_at), aware(row.until)
    upcoming = Timing(row.cron, row.timezone, row.every_s).next_until(
        max(last or created, datetime.now(UTC)), created, until
    )
    return ScheduleInfo(
        row.id,
        row.worker_id,
        row.cron,
        row.timezone,
        row.every_s,
        row.event_type,
        row.data,
        row.missed,
        row.max_catch_up,
        until,
        created,
        last,
        upcoming,
    )


#: Characters a short id needs at least (git-style).
MIN_PREFIX = 6
#: Candidates an ambiguous short id's error lists at most.
_SHOWN = 5


def by_prefix(
    session: Session,
    column: InstrumentedAttribute[Any],
    given: str,
    kind: str,
    *conditions: Any,
    show: Callable[[Any], str] = str,
) -> Any | None:
    """The one value of ``column`` (an id) that starts with ``given``: a short id of at least
    :data:`MIN_PREFIX` characters (a UUID's hyphens may be left out). None when none does
    (or ``given`` is too short to be one); :class:`AmbiguousReference` listing the
    candidates (each as ``show`` gives it) when several do."""
    if len(given) < MIN_PREFIX:
        return None
    if isinstance(column.type, Uuid):
        pattern = given.replace("-", "").lower()
        if pattern.strip("0123456789abcdef"):
            return None
        expr: Any = func.replace(func.lower(cast(column, String)), "-", "")
    else:
        pattern, expr = given, column
    like = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    found = session.scalars(
        select(column).where(expr.like(like, escape="\\"), *conditions).limit(_SHOWN + 1)
    ).all()
    if len(found) > 1:
        shown = ", ".join(show(value) for value in found[:_SHOWN])
        more = ", …" if len(found) > _SHOWN else ""
        raise AmbiguousReference(
            f"{kind} id {given!r} is ambiguous: it starts {shown}{more}; give more characters"
        )
    return found[0] if found else None
