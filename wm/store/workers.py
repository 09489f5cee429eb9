"""The control plane's statements on the worker tables: finding workers, their versions and
transitions, and adding workers and versions. Each takes the caller's session, so a change
stays one transaction (``records.transaction``); which state or version to move to is the
caller's decision, and ``records`` writes the transition and its outbox row."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from wm.lifecycle import Status
from wm.store import records
from wm.store.models import Subscription, Worker, WorkerTransition, WorkerVersion
from wm.views import TransitionInfo, VersionInfo, WorkerInfo

#: Every worker but the deleted ones.
LIVE = Worker.status != Status.DELETED.value


# -- finding workers -----------------------------------------------------------------------


def live_mime_types(session: Session) -> set[str]:
    """The MIME types of the workers that are not deleted."""
    return set(session.scalars(select(Worker.mime_type).where(LIVE).distinct()))


def info(session: Session, wid: uuid.UUID) -> WorkerInfo | None:
    """The worker with its current version's facts, or None if there is none."""
    worker = session.get(Worker, wid)
    if worker is None:
        return None
    version = session.get(WorkerVersion, (wid, worker.current_version))
    assert version is not None
    return records.worker_info(worker, version)


def find(
    session: Session,
    *,
    tenant: str,
    topic: str | None,
    group: str | None,
    status: Status | None,
) -> list[WorkerInfo]:
    """The tenant's workers matching every filter given (``topic``: a route topic; live ones
    without ``status``), oldest first."""
    query = select(Worker, WorkerVersion).join(
        WorkerVersion,
        (WorkerVersion.worker_id == Worker.id) & (WorkerVersion.version == Worker.current_version),
    )
    query = query.where(Worker.tenant == tenant)
    if topic is not None:
        query = query.where(Worker.topic == topic)
    if group is not None:
        query = query.where(Worker.group == group)
    query = query.where(LIVE if status is None else Worker.status == status.value)
    rows = session.execute(query.order_by(Worker.created_at, Worker.id)).all()
    return [records.worker_info(w, v) for w, v in rows]


def names(
    session: Session, wanted: Iterable[uuid.UUID], tenant: str | None = None
) -> dict[str, str | None]:
    """Each worker's name (None if it has none) by its id as text, deleted workers too; of
    ``tenant``'s workers only when given (another's is left out, as a missing one)."""
    query = select(Worker.id, Worker.name).where(Worker.id.in_(set(wanted)))
    if tenant is not None:
        query = query.where(Worker.tenant == tenant)
    return {str(worker_id): name for worker_id, name in session.execute(query)}


def tenant_of(session: Session, wid: uuid.UUID) -> str | None:
    """The tenant of the worker with this id (None: no such worker)."""
    found: str | None = session.scalar(select(Worker.tenant).where(Worker.id == wid))
    return found


def live_named(session: Session, tenant: str, name: str) -> uuid.UUID | None:
    """The tenant's live worker with this name."""
    query = select(Worker.id).where(Worker.tenant == tenant, Worker.name == name, LIVE)
    found: uuid.UUID | None = session.scalar(query)
    return found


def by_short_id(session: Session, tenant: str, prefix: str, *, deleted: bool) -> uuid.UUID | None:
    """The tenant's live worker (any worker, with ``deleted``) whose id starts with
    ``prefix``."""
    where = (Worker.tenant == tenant, *(() if deleted else (LIVE,)))
    found = records.by_prefix(session, Worker.id, prefix, "worker", *where)
    return None if found is None else uuid.UUID(str(found))


def deleted_named(session: Session, tenant: str, name: str) -> list[uuid.UUID]:
    """The tenant's deleted workers that had this name."""
    query = select(Worker.id).where(
        Worker.tenant == tenant, Worker.name == name, Worker.status == Status.DELETED.value
    )
    return list(session.scalars(query).all())


def versions(session: Session, wid: uuid.UUID) -> list[VersionInfo]:
    """Every code version of the worker, oldest first."""
    query = select(WorkerVersion).where(WorkerVersion.worker_id == wid)
    rows = session.scalars(query.order_by(WorkerVersion.version)).all()
    return [records.version_info(v) for v in rows]


def transitions(session: Session, wid: uuid.UUID) -> list[TransitionInfo]:
    """Every transition of the worker, oldest first."""
    query = select(WorkerTransition).where(WorkerTransition.worker_id == wid)
    rows = session.scalars(query.order_by(WorkerTransition.id)).all()
    return [records.transition_info(t) for t in rows]


class TransitionTally(NamedTuple):
    """Transitions of one ``from → to`` with their time in ``from`` in one bucket: the
    bucket's index in the bounds (``len(bounds)`` past the last; -1 for no duration)."""

    source: str | None
    target: str
    bucket: int
    moves: int
    total_ms: float


def tally_transitions(
    session: Session, after_id: int, bounds_ms: Sequence[float], before: datetime
) -> tuple[int, list[TransitionTally]]:
    """The transitions recorded after ``after_id`` and before ``before``, counted by
    ``from``, ``to`` and duration bucket in the database (one aggregate on the primary key's
    range), and the last id counted. ``before`` leaves out the newest rows, so that one of a
    transaction still open (its id taken, not yet committed) is not skipped for good."""
    newest = select(func.max(WorkerTransition.id)).where(
        WorkerTransition.id > after_id, WorkerTransition.at < before
    )
    last = session.scalar(newest) or 0
    if last <= after_id:
        return after_id, []
    ms = WorkerTransition.duration_ms
    whens = [(ms <= bound, index) for index, bound in enumerate(bounds_ms)]
    rows = (
        select(
            WorkerTransition.from_status.label("source"),
            WorkerTransition.to_status.label("target"),
            case((ms.is_(None), -1), *whens, else_=len(bounds_ms)).label("bucket"),
            ms.label("ms"),
        )
        .where(WorkerTransition.id > after_id, WorkerTransition.id <= last)
        .subquery()
    )
    keys = (rows.c.source, rows.c.target, rows.c.bucket)
    found = session.execute(
        select(*keys, func.count(), func.coalesce(func.sum(rows.c.ms), 0)).group_by(*keys)
    ).all()
    return last, [TransitionTally(f, t, int(b), int(n), float(s)) for f, t, b, n, s in found]


def code(session: Session, wid: uuid.UUID, version: int) -> bytes | None:
    """The code of one version, or None if the worker has no such version."""
    row = session.get(WorkerVersion, (wid, version))
    return None if row is None else bytes(row.code)


def has_version(session: Session, wid: uuid.UUID, version: int) -> bool:
    return session.get(WorkerVersion, (wid, version)) is not None


def latest_version(session: Session, wid: uuid.UUID) -> int:
    """The highest version the worker has (0 for none)."""
    query = select(func.max(WorkerVersion.version)).where(WorkerVersion.worker_id == wid)
    return int(session.scalar(query) or 0)


# -- adding and removing -------------------------------------------------------------------


def insert_worker(
    session: Session,
    wid: uuid.UUID,
    *,
    tenant: str,
    name: str | None,
    topic: str,
    group: str | None,
    mime_type: str,
    settings: Mapping[str, Any],
    queue: str,
) -> Worker:
    """A new worker of ``tenant`` in ``created`` at version 1, subscribed to ``topic`` (a
    route topic) through ``queue`` (its first version is the caller's to add)."""
    worker = Worker(
        id=wid,
        tenant=tenant,
        name=name,
        topic=topic,
        group=group,
        mime_type=mime_type,
        status=Status.CREATED,
        current_version=1,
        settings=dict(settings),
    )
    session.add(worker)
    session.flush()
    session.add(Subscription(tenant=tenant, topic=topic, queue=queue, worker_id=wid))
    return worker


def insert_version(
    session: Session,
    wid: uuid.UUID,
    version: int,
    *,
    code: bytes,
    sha256: str,
    size: int,
    source_kind: str,
    url: str | None,
    note: str | None,
) -> None:
    """A new code version row (versions are never rewritten), in its worker's tenant."""
    worker = session.get(Worker, wid)
    assert worker is not None
    session.add(
        WorkerVersion(
            worker_id=wid,
            tenant=worker.tenant,
            version=version,
            source_kind=source_kind,
            url=url,
            sha256=sha256,
            size=size,
            code=code,
            note=note,
        )
    )


def remove_subscriptions(session: Session, wid: uuid.UUID) -> list[tuple[str, str]]:
    """Delete the worker's subscriptions; returns each one's topic and queue."""
    subs = session.scalars(select(Subscription).where(Subscription.worker_id == wid)).all()
    removed = [(sub.topic, sub.queue) for sub in subs]
    for sub in subs:
        session.delete(sub)
    return removed


# -- what the status views read ------------------------------------------------------------


class LiveRow(NamedTuple):
    id: uuid.UUID
    name: str | None
    topic: str
    status: str
    settings: dict[str, Any] | None
    status_since: datetime | None
    group: str | None


def live(session: Session, tenant: str | None = None) -> list[LiveRow]:
    """What the status views need of every live worker (of ``tenant`` unless None), oldest
    first."""
    query = select(
        Worker.id,
        Worker.name,
        Worker.topic,
        Worker.status,
        Worker.settings,
        Worker.status_since,
        Worker.group,
    )
    if tenant is not None:
        query = query.where(Worker.tenant == tenant)
    rows = session.execute(query.where(LIVE).order_by(Worker.created_at, Worker.id)).all()
    return [LiveRow(*row) for row in rows]


def paused_by_breaker(session: Session, pending: list[str]) -> set[str]:
    """Of these pending workers (ids as text), those paused by their breaker (not a delayed
    start): the breaker moved them to ``pending`` last."""
    if not pending:
        return set()
    rows = session.execute(
        select(WorkerTransition.worker_id, WorkerTransition.actor)
        .where(
            WorkerTransition.worker_id.in_([uuid.UUID(w) for w in pending]),
            WorkerTransition.to_status == Status.PENDING.value,
        )
        .order_by(WorkerTransition.id)
    ).all()
    last = {str(wid): actor for wid, actor in rows}
    return {wid for wid, actor in last.items() if actor == "breaker"}


def newest_move(
    session: Session, wid: uuid.UUID, *, to: Iterable[str], by_breaker_to: Iterable[str]
) -> TransitionInfo | None:
    """The worker's newest transition to a status in ``to``, or made by its breaker to one
    in ``by_breaker_to``."""
    by_breaker = (WorkerTransition.actor == "breaker") & WorkerTransition.to_status.in_(
        list(by_breaker_to)
    )
    query = select(WorkerTransition).where(
        WorkerTransition.worker_id == wid, WorkerTransition.to_status.in_(list(to)) | by_breaker
    )
    found = session.scalars(query.order_by(WorkerTransition.id.desc()).limit(1)).first()
    return None if found is None else records.transition_info(found)
