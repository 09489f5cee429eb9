"""``pending``: a worker that waits to run, and its ways out (issue 14).

Two things park a worker in ``pending``: its circuit breaker (``wm.dataplane.features.
breaker`` opens it; :func:`half_open` ends the back-off by the task :data:`RETRY_TASK`) and a
start that must wait (:func:`delay_start`; :func:`start_due` by :data:`START_TASK`). Either
task may be lost with its node: the maintaining node's :func:`sweep_overdue` ends the wait
instead. Leaving is ``pending → starting → running``, then every node consumes the queue.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.dataplane import outbox
from wm.dataplane.bus import Bus
from wm.dataplane.queues import DEFAULT_QUEUE
from wm.dataplane.routes import Route, route_of
from wm.lifecycle import Status
from wm.state.breaker import Breaker
from wm.state.connection import redis_errors, redis_for
from wm.state.ledger import Ledger
from wm.store import records
from wm.store.models import Worker
from wm.views import aware
from wm.workersettings import WorkerSettings

logger = logging.getLogger(__name__)
#: Name of the task that ends a back-off, and of the one that ends a delayed start's wait.
RETRY_TASK = "wm.breaker_retry"
START_TASK = "wm.start_due"


def half_open(settings: Settings, bus: Bus, worker_id: str, trips: int | None = None) -> bool:
    """End the back-off: ``pending → starting → running``, one failure away from opening
    again. ``trips`` names the opening this ends; a later one (or none) is left alone."""
    breaker = Breaker(settings)
    if trips is not None and breaker.trips(worker_id) != trips:
        return False
    reason = "circuit breaker half-open: deliveries run again; one more failure reopens it"
    if not leave_pending(settings, bus, worker_id, reason, "breaker", breaker.half_open):
        return False
    logger.info("worker %s half-open after its circuit breaker's back-off", worker_id)
    return True


#: The longest a start may be delayed: a year (Celery's countdown and Redis' expiry of the
#: due time would overflow long before a float does).
MAX_START_DELAY_S = 365 * 86400


def delay_start(
    settings: Settings, bus: Bus, app: Celery, wid: uuid.UUID, delay_s: float, actor: str
) -> bool:
    """A start that must wait: ``→ pending`` now, ``→ starting → running`` in ``delay_s``
    (:data:`START_TASK`). False when the worker runs, or waits, already."""

    def wait(session: Session) -> bool:
        worker = records.lock_worker(session, wid)
        if worker.status in (Status.STARTING, Status.RUNNING, Status.PENDING):
            return False
        reason = f"start requested in {delay_s:g} s"
        records.move(session, worker, Status.PENDING, reason, actor=actor)
        return True

    waiting = records.transaction(settings, wait)
    outbox.changed(settings, bus, wid)
    if waiting:  # a sweep in between takes it for a breaker's pause, seconds long at least
        due = time.time() + delay_s
        with redis_errors(settings):
            redis_for(settings).set(_start_at_key(str(wid)), repr(due), ex=int(delay_s) + 86400)
        app.send_task(
            START_TASK, args=[str(wid), actor, due], countdown=delay_s, queue=DEFAULT_QUEUE
        )
    return waiting


def start_due(settings: Settings, bus: Bus, worker_id: str, actor: str, due: float | None) -> bool:
    """A delayed start's time came: ``pending → starting → running`` if the worker still
    waits for this start (``due``; None: whichever)."""
    with redis_errors(settings):
        stored = redis_for(settings).get(_start_at_key(worker_id))
    if stored is None or (due is not None and float(stored) != due):
        return False  # started, stopped or delayed again meanwhile
    return leave_pending(settings, bus, worker_id, "its delayed start came", actor)


def forget_delayed_start(settings: Settings, worker_id: str) -> None:
    """The worker was started or stopped by request: its delayed start, if any, is void."""
    with redis_errors(settings):
        redis_for(settings).delete(_start_at_key(worker_id))


def _start_at_key(worker_id: str) -> str:
    """When a pending worker's delayed start is due (absent: it waits for its breaker)."""
    return f"wm:start-at:{{{worker_id}}}"


def leave_pending(
    settings: Settings,
    bus: Bus,
    worker_id: str,
    reason: str,
    actor: str,
    prepare: Callable[[str, int], None] | None = None,
) -> bool:
    """``pending → starting → running`` (if still pending), then every node consumes the
    worker's queue; ``prepare(worker id, failure_threshold)`` runs before they do."""
    wid = uuid.UUID(worker_id)

    def start(session: Session) -> tuple[Route, int] | None:
        worker = records.lock_worker(session, wid)
        if worker.status != Status.PENDING:
            return None
        records.move(session, worker, Status.STARTING, reason, actor=actor)
        records.move(session, worker, Status.RUNNING, "started", actor=actor)
        threshold = WorkerSettings.of(worker.settings).failure_threshold
        return route_of(worker), threshold

    started = records.transaction(settings, start)
    if started is None:
        return False
    route, limit = started
    forget_delayed_start(settings, worker_id)
    Ledger(settings).restart_clocks(str(route.worker_id))  # time pending is no broker's loss
    if prepare is not None:
        prepare(worker_id, limit)
    outbox.changed(settings, bus, wid)
    bus.broadcast_consume(route.queue)
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
        with redis_errors(settings):
            start_at = redis_for(settings).get(_start_at_key(str(wid)))
        if start_at is not None:  # a delayed start, not a breaker
            if time.time() > float(start_at) + slack_s:
                opened += start_due(settings, bus, str(wid), "node", None)
            continue
        trips = max(1, breaker.trips(str(wid)))
        pause_s = WorkerSettings.of(worker_settings).breaker_delay_s(trips)
        pause = timedelta(seconds=pause_s + slack_s)
        if since is None or now - aware(since) > pause:
            opened += half_open(settings, bus, str(wid))
    return opened
