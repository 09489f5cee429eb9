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

What reaching the threshold does is the worker's ``recovery`` strategy (seed 004's decision
tree, :data:`STRATEGIES`): ``retry`` (the default) is the breaker above; ``stop`` moves the
worker to ``stopped`` (the failing delivery stays queued for its next start); ``degrade``
keeps it consuming — retries and dead letters as usual — and publishes the lifecycle event
``recovery`` once per run of failures (its health shows the failures); ``replace`` unloads
its engine in every process, so the next delivery loads the pinned version afresh (a new
sandbox, helper or context), once per run of failures, and goes on consuming.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.dataplane import enginecontrol, outbox
from wm.dataplane.bus import Bus
from wm.dataplane.queues import DEFAULT_QUEUE, worker_queue_name
from wm.lifecycle import Status
from wm.state.breaker import Breaker, backoff_s
from wm.state.connection import redis_errors, redis_for
from wm.state.directory import WorkerMeta
from wm.state.ledger import Ledger
from wm.store import records
from wm.store.models import Worker
from wm.views import aware

logger = logging.getLogger(__name__)
#: Name of the task that ends a back-off, and of the one that ends a delayed start's wait.
RETRY_TASK = "wm.breaker_retry"
START_TASK = "wm.start_due"
DEFAULT_FAILURE_THRESHOLD = 5
DEFAULT_BASE_DELAY_S = 2.0
DEFAULT_MAX_DELAY_S = 120.0


#: Recovery strategies; the first is the default.
STRATEGIES = ("retry", "degrade", "stop", "replace")
#: Strategies under which the failing delivery goes back to the queue (nothing is parked).
PAUSING = frozenset({"retry", "stop"})


def strategy(meta: WorkerMeta) -> str:
    return str(meta.settings.get("recovery", STRATEGIES[0]))


def threshold(meta: WorkerMeta | dict[str, Any]) -> int:
    settings = meta.settings if isinstance(meta, WorkerMeta) else meta
    return int(settings.get("failure_threshold", DEFAULT_FAILURE_THRESHOLD))


def delay_s(settings: dict[str, Any], trips: int) -> float:
    base = float(settings.get("breaker_base_delay_s", DEFAULT_BASE_DELAY_S))
    ceiling = float(settings.get("breaker_max_delay_s", DEFAULT_MAX_DELAY_S))
    return backoff_s(trips, base, ceiling)


def trip(
    settings: Settings, bus: Bus, app: Celery, meta: WorkerMeta, trips: int, last_error: str
) -> None:
    """The worker reached its ``failure_threshold``: apply its recovery strategy."""
    how = strategy(meta)
    if how == "retry":
        open_breaker(settings, bus, app, meta, trips, last_error)
        return
    failures = f"{threshold(meta)} consecutive failed deliveries (last: {last_error})"
    wid = uuid.UUID(meta.id)
    if how == "stop":
        reason = f"recovery 'stop' after {failures}; start it again once fixed"
        if outbox.leave_running(settings, bus, wid, Status.STOPPED, reason, actor="breaker"):
            enginecontrol.send(settings, enginecontrol.UNLOAD, meta.id)
            logger.warning("worker %s stopped by its recovery strategy", meta.id)
        return
    if how == "replace":
        enginecontrol.send(settings, enginecontrol.UNLOAD, meta.id)
        action = "its engine is loaded afresh from the pinned version on every node"
    else:
        action = "it goes on consuming, degraded"
    reason = f"recovery {how!r} after {failures}: {action}"
    logger.warning("worker %s: %s", meta.id, reason)
    data = {"strategy": how, "failures": threshold(meta), "last_error": last_error}
    records.transaction(settings, lambda s: _recovery_event(s, wid, data, reason))
    outbox.flush(settings, bus)


def _recovery_event(session: Session, wid: uuid.UUID, data: dict[str, Any], reason: str) -> None:
    worker = records.lock_worker(session, wid)
    records.add_outbox(session, "recovery", worker, data, reason=reason)


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
    reason = "circuit breaker half-open: deliveries run again; one more failure reopens it"
    if not leave_pending(settings, bus, worker_id, reason, "breaker", breaker.half_open):
        return False
    logger.info("worker %s half-open after its circuit breaker's back-off", worker_id)
    return True


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

    def start(session: Session) -> tuple[str, int] | None:
        worker = records.lock_worker(session, wid)
        if worker.status != Status.PENDING:
            return None
        records.move(session, worker, Status.STARTING, reason, actor=actor)
        records.move(session, worker, Status.RUNNING, "started", actor=actor)
        return worker_queue_name(worker.topic, worker_id), threshold(dict(worker.settings))

    started = records.transaction(settings, start)
    if started is None:
        return False
    queue, limit = started
    forget_delayed_start(settings, worker_id)
    Ledger(settings).restart_clocks(worker_id)  # time spent pending is no broker's loss
    if prepare is not None:
        prepare(worker_id, limit)
    outbox.changed(settings, bus, wid)
    bus.broadcast_consume(queue)
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
        pause = timedelta(seconds=delay_s(dict(worker_settings or {}), trips) + slack_s)
        if since is None or now - aware(since) > pause:
            opened += half_open(settings, bus, str(wid))
    return opened
