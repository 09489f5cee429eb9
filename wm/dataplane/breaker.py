"""The circuit breaker (issue 14): a worker whose deliveries keep failing pauses itself.

``failure_threshold`` consecutive failed attempts (per-worker setting, default
:data:`DEFAULT_FAILURE_THRESHOLD`; 0 turns the breaker off) move the worker from ``running``
to ``pending``: every node stops consuming its queue, the attempt that tripped it goes back
to the queue, and nothing is dead-lettered while it waits (deliveries already fetched find it
not running and go back too). After a back-off (``breaker_base_delay_s`` doubling to
``breaker_max_delay_s``, default 2 s to 2 min) it goes ``pending → starting → running``
half-open: one more failure opens it again with the next back-off, a success closes it.

The back-off ends by a task sent with a countdown (:data:`RETRY_TASK`); should that task be
lost with its node, the maintaining node's sweep (:func:`sweep_overdue`) ends it instead.
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.dataplane import outbox
from wm.dataplane.bus import Bus
from wm.dataplane.queues import DEFAULT_QUEUE, worker_queue_name
from wm.lifecycle import Status
from wm.state.breaker import Breaker, backoff_s
from wm.state.directory import WorkerMeta
from wm.store import records
from wm.store.models import Worker

logger = logging.getLogger(__name__)
#: Name of the task that ends a back-off.
RETRY_TASK = "wm.breaker_retry"
DEFAULT_FAILURE_THRESHOLD = 5
DEFAULT_BASE_DELAY_S = 2.0
DEFAULT_MAX_DELAY_S = 120.0


def threshold(meta: WorkerMeta | dict[str, Any]) -> int:
    settings = meta.settings if isinstance(meta, WorkerMeta) else meta
    return int(settings.get("failure_threshold", DEFAULT_FAILURE_THRESHOLD))


def delay_s(settings: dict[str, Any], trips: int) -> float:
    base = float(settings.get("breaker_base_delay_s", DEFAULT_BASE_DELAY_S))
    ceiling = float(settings.get("breaker_max_delay_s", DEFAULT_MAX_DELAY_S))
    return backoff_s(trips, base, ceiling)


def open_breaker(
    settings: Settings, bus: Bus, app: Celery, meta: WorkerMeta, trips: int, last_error: str
) -> None:
    """``running → pending`` (if still running), consumers cancelled, the back-off's end sent."""
    pause = delay_s(meta.settings, trips)
    reason = (
        f"circuit breaker opened after {threshold(meta)} consecutive failed deliveries "
        f"(last: {last_error}); trying again in {pause:g} s"
    )
    wid = uuid.UUID(meta.id)
    if not outbox.leave_running(settings, bus, wid, Status.PENDING, reason, actor="breaker"):
        return
    logger.warning("worker %s paused by its circuit breaker for %g s", meta.id, pause)
    app.send_task(RETRY_TASK, args=[meta.id, trips], countdown=pause, queue=DEFAULT_QUEUE)


def half_open(settings: Settings, bus: Bus, worker_id: str, trips: int | None = None) -> bool:
    """End the back-off: ``pending → starting → running``, one failure away from opening
    again. ``trips`` names the opening this ends; a later one (or none) is left alone."""
    breaker = Breaker(settings)
    if trips is not None and breaker.trips(worker_id) != trips:
        return False
    wid = uuid.UUID(worker_id)

    def start(session: Session) -> tuple[str, int] | None:
        worker = records.lock_worker(session, wid)
        if worker.status != Status.PENDING:
            return None
        reason = "circuit breaker half-open: deliveries run again; one more failure reopens it"
        records.move(session, worker, Status.STARTING, reason, actor="breaker")
        records.move(session, worker, Status.RUNNING, "started", actor="breaker")
        return worker_queue_name(worker.topic, worker_id), threshold(dict(worker.settings))

    started = records.transaction(settings, start)
    if started is None:
        return False
    queue, limit = started
    breaker.half_open(worker_id, limit)
    outbox.changed(settings, bus, wid)
    bus.broadcast_consume(queue)
    logger.info("worker %s half-open after its circuit breaker's back-off", worker_id)
    return True


def sweep_overdue(settings: Settings, bus: Bus, slack_s: float) -> int:
    """Half-open every pending worker whose back-off ended more than ``slack_s`` ago (its
    retry task was lost); returns how many."""
    now = datetime.now(UTC)
    with store.session_scope(settings) as session:
        rows = session.execute(
            select(Worker.id, Worker.settings, Worker.status_since).where(
                Worker.status == Status.PENDING.value
            )
        ).all()
    breaker, opened = Breaker(settings), 0
    for wid, worker_settings, since in rows:
        trips = max(1, breaker.trips(str(wid)))
        pause = timedelta(seconds=delay_s(dict(worker_settings or {}), trips) + slack_s)
        if since is None or now - records.aware(since) > pause:
            opened += half_open(settings, bus, str(wid))
    return opened
