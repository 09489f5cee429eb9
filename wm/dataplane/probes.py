"""Health probes (issue 14, point 2(b)): the optional ``probe`` of a worker's code, run every
``probe_interval_s`` (worker setting, default 30) on one node at a time.

The maintaining node, once per reconcile period, sends the task ``wm.probe`` to the default
queue for each running worker whose probe is due (:func:`send_due`); whichever node takes it
runs the probe in its pool process's engine (:meth:`wm.engine.Engine.probe`, loaded and
cached as for deliveries, within the worker's ``timeout_s``) and records what it found
(``wm.state.health.Probes``), which the next judgement counts (``wm.dataplane.workerhealth``).
Probes go on while a worker is paused as unhealthy: a passing one ends the pause. The probe
that brings the failures in a row to ``max_probe_failures`` runs the worker's
``recovery_on_health`` strategy (:func:`recover_at_limit`).

One probe per worker is outstanding at a time: claiming it keeps the worker's probe-due key
for the probe's whole possible life (:func:`lease_s`), recording sets it to the interval, so
the next is due ``probe_interval_s`` after the last ended. A claimed probe that never ran
(its node died) frees the worker when its lease ends, and its message, expired by then, is
discarded unrun. A version whose code has no probe is remembered and not asked again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Task, shared_task
from sqlalchemy import select

from wm import store
from wm.config import Settings
from wm.dataplane import strategies
from wm.dataplane.app import broker_errors
from wm.dataplane.bus import Bus
from wm.dataplane.observe import notify
from wm.dataplane.queues import DEFAULT_QUEUE
from wm.dataplane.runtime import Runtime, runtime
from wm.errors import Unavailable
from wm.lifecycle import Status
from wm.state.directory import WorkerMeta
from wm.state.health import ProbeFacts, Probes
from wm.store.models import Worker
from wm.workersettings import WorkerSettings

logger = logging.getLogger(__name__)

PROBE_TASK = "wm.probe"
#: seconds a claimed probe may spend waiting in the queue and loading its worker's engine,
#: beyond its interval and time limit, before another may be sent.
PROBE_SLACK_S = 30.0


def probe_interval_s(worker_settings: dict[str, Any]) -> float:
    return WorkerSettings.of(worker_settings).probe_interval_s


def probe_timeout_s(settings: Settings, worker_settings: dict[str, Any]) -> float:
    """A probe's time limit: the worker's per-message one (``timeout_s``)."""
    return WorkerSettings.of(worker_settings).timeout_s_on(settings)


def lease_s(settings: Settings, worker_settings: dict[str, Any]) -> float:
    """How long a claimed probe keeps the worker from being probed again, unless it ends."""
    interval_s = probe_interval_s(worker_settings)
    return interval_s + probe_timeout_s(settings, worker_settings) + PROBE_SLACK_S


def send_due(settings: Settings, bus: Bus) -> int:
    """Send ``wm.probe`` for every running worker whose probe is due; returns how many.
    Called once per reconcile period by the maintaining node."""
    with store.session_scope(settings) as session:
        rows = session.execute(
            select(Worker.id, Worker.current_version, Worker.settings).where(
                Worker.status == Status.RUNNING.value
            )
        ).all()
    leases = {str(w): (int(v), lease_s(settings, dict(s or {}))) for w, v, s in rows}
    due = Probes(settings).claim_due(leases)
    if not due:
        return 0
    with broker_errors(settings), bus.app.producer_or_acquire() as producer:
        for worker_id in due:
            bus.app.send_task(
                PROBE_TASK,
                args=[worker_id],
                queue=DEFAULT_QUEUE,
                expires=leases[worker_id][1],
                producer=producer,
            )
    return len(due)


@shared_task(bind=True, name=PROBE_TASK, acks_late=True, reject_on_worker_lost=True)
def probe(self: Task, worker_id: str) -> None:
    """Run one worker's probe here and record it. Redis or the database down: nothing is
    recorded, and the worker is probed again once its claim ends."""
    try:
        run_probe(runtime(self), worker_id)
    except Unavailable as exc:
        logger.warning("could not probe worker %s (%s); it is probed again later", worker_id, exc)


def run_probe(rt: Runtime, worker_id: str) -> ProbeFacts | None:
    """Probe the worker's current version and record the result; None when it does not run
    or its code has no probe (remembered for that version)."""
    probes = Probes(rt.settings)
    meta = rt.directory.get(worker_id)
    if meta is None or meta.status != Status.RUNNING:
        probes.release(worker_id)
        return None
    started = time.monotonic()
    try:
        answer = _ask(rt, meta)
    except Unavailable:
        raise
    except Exception as exc:  # it raised, outlived its time limit, crashed, or cannot load
        error: str | None = str(exc) or type(exc).__name__
    else:
        if answer is None:
            probes.no_probe(meta.id, meta.version)
            logger.info("worker %s v%d has no probe", meta.id, meta.version)
            return None
        error = None if answer else "the probe answered that the worker is not healthy"
    facts = probes.record(meta.id, meta.version, error, probe_interval_s(meta.settings))
    notify("probe", meta, time.monotonic() - started)  # first: a scrape never sees fewer
    notify("probe_passed" if error is None else "probe_failed", meta)
    if error is not None:
        logger.warning(
            "probe of worker %s v%d failed (%d in a row): %s",
            meta.id,
            meta.version,
            facts.failures,
            error,
        )
        recover_at_limit(rt, meta, facts)
    return facts


def recover_at_limit(rt: Runtime, meta: WorkerMeta, facts: ProbeFacts) -> bool:
    """The probe that brings the failures in a row to ``max_probe_failures`` runs the
    worker's ``recovery_on_health`` strategy (``wm.dataplane.strategies``): once per run of
    failures, as the count passes the limit only once. Taken out of service (``stop``,
    ``remove``), its probe facts are forgotten: started again, it is judged afresh."""
    limit = meta.worker_settings.max_probe_failures
    if not limit or facts.failures != limit:
        return False
    failures = f"{limit} failed probes in a row"
    done = strategies.apply(
        rt.settings, rt.bus, meta, "health", failures, limit, facts.error, "health"
    )
    if done and meta.worker_settings.strategy_for("health") in ("stop", "remove"):
        Probes(rt.settings).forget(meta.id)
    return done


def _ask(rt: Runtime, meta: WorkerMeta) -> bool | None:
    engine, temporary = rt.engines.engine(meta, meta.version)
    try:
        return engine.probe(probe_timeout_s(rt.settings, meta.settings))
    finally:
        if temporary:
            engine.close()
