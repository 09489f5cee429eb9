"""After a committed change: lifecycle events leave the outbox and nodes forget what they
cached of the worker. Also the data plane's own change, a worker that cannot run here."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.dataplane.bus import Bus
from wm.dataplane.shares import leaving_queue
from wm.errors import BrokerUnavailable, Unavailable
from wm.events import decode, in_tenant
from wm.lifecycle import Status
from wm.names import split_route_topic
from wm.state.directory import Directory
from wm.store import records
from wm.store.models import OutboxEvent

logger = logging.getLogger(__name__)
#: Outbox rows published per flush (the rest wait for the next one).
FLUSH_BATCH = 500
#: An outbox row: its id, route topic and encoded event.
_Row = tuple[int, str, Any]


def flush(settings: Settings, bus: Bus, topics: list[str] | None = None) -> int:
    """Publish lifecycle events written by committed changes; returns how many were sent
    (and adds the topic of each to ``topics`` when given).

    Rows are locked with SKIP LOCKED, so concurrent flushes never send one event twice.
    SQLite has no row locks: there each row is deleted before it is sent, and a flush whose
    delete finds the row gone leaves it to the flush that took it (the first delete holds
    the database's write lock until it commits). A broker or database outage leaves the
    rest for the next flush.
    """
    try:
        with store.session_scope(settings) as session:
            rows = session.execute(
                select(OutboxEvent.id, OutboxEvent.topic, OutboxEvent.payload)
                .order_by(OutboxEvent.id)
                .limit(FLUSH_BATCH)
                .with_for_update(skip_locked=True)
            ).all()
            if not rows:
                return 0
            taken = _take(session, rows)
            bus.publish_many(
                [
                    (in_tenant(decode(payload), split_route_topic(topic)[0]), topic)
                    for _, topic, payload in taken
                ]
            )
    except Unavailable as exc:
        logger.warning("lifecycle events stay in the outbox for the next try: %s", exc)
        return 0
    if topics is not None:
        topics.extend(topic for _, topic, _ in taken)
    return len(taken)


def _take(session: Session, rows: Sequence[_Row]) -> Sequence[_Row]:
    """Delete ``rows`` in this transaction: those this flush took. PostgreSQL locked them
    for it (one statement takes all, however many); SQLite has no row locks, so each is
    deleted on its own and one another flush deleted first is left to that flush."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(delete(OutboxEvent).where(OutboxEvent.id.in_([r[0] for r in rows])))
        return rows
    return [row for row in rows if _deleted(session, row[0])]


def _deleted(session: Session, row_id: int) -> bool:
    result = session.execute(delete(OutboxEvent).where(OutboxEvent.id == row_id))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def changed(settings: Settings, bus: Bus, wid: uuid.UUID) -> None:
    """After a commit: nodes re-read the worker, lifecycle events go out."""
    try:
        Directory(settings).invalidate(str(wid))
    except BrokerUnavailable as exc:
        logger.warning("nodes will see worker %s change after their reconcile: %s", wid, exc)
    flush(settings, bus)


def record_failure(
    settings: Settings,
    bus: Bus,
    wid: uuid.UUID,
    error_type: str,
    error_message: str,
    *,
    fail: bool = False,
) -> None:
    """Publish ``worker.error``; with ``fail`` also move the worker to ``failed``, which
    stops consumption (its queue keeps the messages until it is started again)."""

    def record(session: Session) -> str | None:
        worker = records.lock_worker(session, wid)
        data = {"error_type": error_type, "error_message": error_message}
        records.add_outbox(session, "error", worker, data, reason=error_message)
        if fail and worker.status in (Status.STARTING, Status.RUNNING):
            reason = f"{error_type}: {error_message}"
            records.move(session, worker, Status.FAILED, reason, actor="node")
            return leaving_queue(session, worker)
        return None

    failed_queue = records.transaction(settings, record)
    changed(settings, bus, wid)
    if failed_queue:
        bus.broadcast_cancel(failed_queue)


def leave_running(
    settings: Settings, bus: Bus, wid: uuid.UUID, target: Status, reason: str, *, actor: str
) -> bool:
    """``running → target`` if the worker still runs, then every node stops consuming its
    queue (which keeps what arrives; a shared group's only once no member runs); False when
    it no longer ran."""

    def leave(session: Session) -> tuple[str | None] | None:
        worker = records.lock_worker(session, wid)
        if worker.status != Status.RUNNING:
            return None
        records.move(session, worker, target, reason, actor=actor)
        return (leaving_queue(session, worker),)

    left = records.transaction(settings, leave)
    changed(settings, bus, wid)
    if left is not None and left[0] is not None:
        bus.broadcast_cancel(left[0])
    return left is not None
