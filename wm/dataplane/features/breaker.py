"""The circuit breaker (issue 14): a worker whose deliveries keep failing pauses itself.

``failure_threshold`` consecutive failed attempts (0 turns the breaker off) trip it; what
that does is the worker's ``recovery`` strategy (seed 004's decision tree,
:data:`~wm.workersettings.STRATEGIES`):

- ``retry`` (the default) opens the breaker: ``running → pending``, every node stops
  consuming the queue, the attempt that tripped it goes back to the queue, and nothing is
  dead-lettered while it waits (deliveries already fetched find it not running and go back
  too). After a back-off (``breaker_base_delay_s`` doubling to ``breaker_max_delay_s``)
  it runs again half-open (``wm.dataplane.pending``): one more failure opens it with the
  next back-off, a success closes it;
- ``stop`` moves the worker to ``stopped`` (the failing delivery stays queued for its next
  start);
- ``degrade`` keeps it consuming — retries and dead letters as usual — and publishes the
  lifecycle event ``recovery`` once per run of failures (its health shows the failures);
- ``replace`` unloads its engine in every process, so the next delivery loads the pinned
  version afresh (a new sandbox, helper or context), once per run of failures, and goes on
  consuming.

The count lives in Redis (``wm.state.breaker``) and is read in the delivery's first round
trip, so a success costs nothing more unless there were failures to forget. A write refused
under a lost lease is no failure of the worker's.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from wm.config import Settings
from wm.dataplane import enginecontrol, outbox
from wm.dataplane.bus import Bus
from wm.dataplane.delivery import Delivery, reported_type
from wm.dataplane.observe import notify
from wm.dataplane.pending import RETRY_TASK
from wm.dataplane.pipeline import Feature
from wm.dataplane.queues import DEFAULT_QUEUE
from wm.dataplane.verdicts import Done, Requeue, Verdict
from wm.errors import FenceRejected
from wm.lifecycle import Status
from wm.state.breaker import Breaker as Counts
from wm.state.breaker import failures_key
from wm.state.directory import WorkerMeta
from wm.store import records
from wm.workersettings import PAUSING

logger = logging.getLogger(__name__)


class Breaker(Feature):
    owns = ("failure_threshold", "breaker_base_delay_s", "breaker_max_delay_s", "recovery")

    def facts(self, worker_id: str) -> Sequence[str]:
        return (failures_key(worker_id),)

    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        if isinstance(error, FenceRejected):
            return None
        meta, settings = delivery.meta, delivery.rt.settings
        threshold = delivery.worker_settings.failure_threshold
        is_open, trips = Counts(settings).failed(meta.id, threshold)
        if trips:
            notify("breaker_opened", meta)
            trip(settings, delivery.rt.bus, meta, trips, f"{reported_type(error)}: {error}")
        if is_open and delivery.worker_settings.recovery in PAUSING:
            # kept for after the back-off (or the next start): nothing is retried or parked
            return Requeue(f"worker {meta.id} paused by its circuit breaker")
        return None

    def ended(self, delivery: Delivery, verdict: Verdict) -> None:
        if isinstance(verdict, Done) and delivery.facts.get(failures_key(delivery.meta.id)):
            Counts(delivery.rt.settings).succeeded(delivery.meta.id)  # closed: count anew


def trip(settings: Settings, bus: Bus, meta: WorkerMeta, trips: int, last_error: str) -> None:
    """The worker reached its ``failure_threshold``: apply its recovery strategy."""
    how = meta.worker_settings.recovery
    if how == "retry":
        open_breaker(settings, bus, meta, trips, last_error)
        return
    threshold = meta.worker_settings.failure_threshold
    failures = f"{threshold} consecutive failed deliveries (last: {last_error})"
    wid = uuid.UUID(meta.id)
    if how == "stop":
        reason = f"recovery 'stop' after {failures}; start it again once fixed"
        if outbox.leave_running(settings, bus, wid, Status.STOPPED, reason, actor="breaker"):
            enginecontrol.send(settings, enginecontrol.UNLOAD, meta.id)
            logger.warning("worker %s stopped by its recovery strategy", meta.id)
        return
    if how == "replace":
        enginecontrol.send(settings, enginecontrol.UNLOAD, meta.id)
        notify("replaced", meta)
        action = "its engine is loaded afresh from the pinned version on every node"
    else:
        action = "it goes on consuming, degraded"
    reason = f"recovery {how!r} after {failures}: {action}"
    logger.warning("worker %s: %s", meta.id, reason)
    data = {"strategy": how, "failures": threshold, "last_error": last_error}
    records.transaction(settings, lambda s: _recovery_event(s, wid, data, reason))
    outbox.flush(settings, bus)


def _recovery_event(session: Session, wid: uuid.UUID, data: dict[str, Any], reason: str) -> None:
    worker = records.lock_worker(session, wid)
    records.add_outbox(session, "recovery", worker, data, reason=reason)


def open_breaker(
    settings: Settings, bus: Bus, meta: WorkerMeta, trips: int, last_error: str
) -> None:
    """``running → pending`` (if still running), consumers cancelled, the back-off's end sent."""
    pause = meta.worker_settings.breaker_delay_s(trips)
    reason = (
        f"circuit breaker opened after {meta.worker_settings.failure_threshold} consecutive "
        f"failed deliveries (last: {last_error}); trying again in {pause:g} s"
    )
    wid = uuid.UUID(meta.id)
    if not outbox.leave_running(settings, bus, wid, Status.PENDING, reason, actor="breaker"):
        return
    logger.warning("worker %s paused by its circuit breaker for %g s", meta.id, pause)
    bus.app.send_task(RETRY_TASK, args=[meta.id, trips], countdown=pause, queue=DEFAULT_QUEUE)
