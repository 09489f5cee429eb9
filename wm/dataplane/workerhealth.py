"""Judging every live worker's health, once per reconcile period on the maintaining node
(``wm.state.health``). A change moves the worker's ``updated_at`` and is published as the
lifecycle event ``health_changed``, with the delivery counts, whether the worker is paused
(``wm.dataplane.features.pause``) and, when its code has a probe, the last probe's facts.
Into or out of ``unhealthy``, every node is told at once to stop or resume consuming its
queue (their reconcile is the safety net)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.dataplane import outbox
from wm.dataplane.bus import Bus
from wm.dataplane.routes import worker_route
from wm.lifecycle import Status
from wm.state.health import UNHEALTHY, Verdict, WorkerHealth
from wm.state.ledger import Ledger
from wm.store import records
from wm.store.models import Worker, utcnow
from wm.workersettings import WorkerSettings

#: Worker rows one query locks when many change health at once.
LOCKED_PER_QUERY = 500


#: What judging a worker reads of its row (1,000 whole rows built as objects took 35 ms a
#: period on SQLite, these columns 24 ms).
_JUDGED = select(
    Worker.id, Worker.status, Worker.settings, Worker.topic, Worker.group, Worker.name
).where(Worker.status != Status.DELETED.value)


def judge_all(settings: Settings, bus: Bus) -> int:
    """Judge every live worker; returns how many changed health."""
    with store.session_scope(settings) as session:
        rows = session.execute(_JUDGED).all()
    found = {str(row.id): (dict(row.settings or {}), _pausable(row)) for row in rows}
    verdicts = WorkerHealth(settings).judge_all({w: s for w, (s, _) in found.items()})
    changed = [(w, v, old) for w, (v, old) in verdicts.items() if v.health != old]
    if changed:  # one transaction: a thousand workers changing at once took one each
        records.transaction(settings, _events(changed, {w: q for w, (_, q) in found.items()}))
        outbox.flush(settings, bus)
    for worker_id, verdict, old in changed:
        _pause_or_resume(settings, bus, worker_id, found[worker_id][1], verdict.health, old)
    return len(changed)


def _pausable(row: Any) -> str | None:
    """The queue a pause would stop: a running worker's own (a shared group's queue is
    every member's), when it pauses while unhealthy; else None. ``row``: :data:`_JUDGED`'s."""
    if row.status != Status.RUNNING or not WorkerSettings.of(row.settings).pause_when_unhealthy:
        return None
    route = worker_route(str(row.id), row.topic, row.group, row.settings, row.name)
    return None if route.share is not None else route.queue


def _pause_or_resume(
    settings: Settings, bus: Bus, worker_id: str, queue: str | None, health: str, old: str
) -> None:
    if queue is None or UNHEALTHY not in (health, old):
        return
    if health == UNHEALTHY:
        bus.broadcast_cancel(queue)
        return
    Ledger(settings).restart_clocks(worker_id)  # time paused is no broker's loss
    bus.broadcast_consume(queue)


def _events(changed: list[tuple[str, Verdict, str]], queues: dict[str, str | None]) -> Any:
    """The write of every changed worker's ``health_changed`` event (their rows locked in
    id order); ``queues``: what a pause would stop, by worker (:func:`_pausable`)."""

    def write(session: Session) -> None:
        wids = sorted(uuid.UUID(worker_id) for worker_id, _, _ in changed)
        workers: dict[str, Worker] = {}
        for start in range(0, len(wids), LOCKED_PER_QUERY):  # an old SQLite takes 999 values
            some = wids[start : start + LOCKED_PER_QUERY]
            query = select(Worker).where(Worker.id.in_(some)).order_by(Worker.id)
            workers.update((str(w.id), w) for w in session.scalars(query.with_for_update()))
        now = utcnow()
        for worker_id, verdict, old in changed:
            worker = workers.get(worker_id)
            if worker is None:  # gone since it was judged: nothing to tell
                continue
            worker.updated_at = now
            data = {
                "from_health": old,
                "to_health": verdict.health,
                "paused": queues[worker_id] is not None and verdict.health == UNHEALTHY,
                "error_rate": verdict.error_rate,
                "deliveries": verdict.deliveries,
                "consecutive_failures": verdict.consecutive_failures,
                **(verdict.probe.to_json() if verdict.probe is not None else {}),
            }
            records.add_outbox(session, "health_changed", worker, data, reason=verdict.reason)

    return write
