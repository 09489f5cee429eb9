"""The circuit breaker (issue 14): a worker whose deliveries keep failing pauses itself.

``failure_threshold`` consecutive failed attempts (0 turns the breaker off) trip it; what
that does is the worker's recovery strategy for the kind of the failure that tripped it
(seed 004's decision tree: ``recovery_on_crash`` default ``replace``,
``recovery_on_timeout`` and ``recovery_on_error`` default ``retry``; ``recovery`` given sets
the ones not given; :data:`~wm.workersettings.STRATEGIES`, ``wm.dataplane.strategies``):

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
  consuming;
- ``remove`` takes it out of service: ``running → failed``, the failing delivery kept
  queued for its next start.

The count lives in Redis (``wm.state.breaker``) and is read in the delivery's first round
trip, so a success costs nothing more unless there were failures to forget. A write refused
under a lost lease is no failure of the worker's.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from wm.config import Settings
from wm.dataplane import outbox, strategies
from wm.dataplane.bus import Bus
from wm.dataplane.delivery import Delivery, reported_type
from wm.dataplane.observe import notify
from wm.dataplane.pending import RETRY_TASK
from wm.dataplane.pipeline import Feature
from wm.dataplane.queues import DEFAULT_QUEUE
from wm.dataplane.verdicts import Done, Requeue, Verdict
from wm.errors import FenceRejected, WorkerCrashed, WorkerTimeout
from wm.lifecycle import Status
from wm.state.breaker import Breaker as Counts
from wm.state.breaker import failures_key
from wm.state.directory import WorkerMeta
from wm.workersettings import PAUSING

logger = logging.getLogger(__name__)


class Breaker(Feature):
    owns = (
        "failure_threshold",
        "breaker_base_delay_s",
        "breaker_max_delay_s",
        "recovery",
        "recovery_on_crash",
        "recovery_on_timeout",
        "recovery_on_error",
    )

    def facts(self, worker_id: str) -> Sequence[str]:
        return (failures_key(worker_id),)

    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        if isinstance(error, FenceRejected):
            return None
        meta, settings = delivery.meta, delivery.rt.settings
        threshold = delivery.worker_settings.failure_threshold
        is_open, trips = Counts(settings).failed(meta.id, threshold)
        kind = failure_kind(error)
        if trips:
            notify("breaker_opened", meta)
            last_error = f"{reported_type(error)}: {error}"
            trip(settings, delivery.rt.bus, meta, trips, last_error, kind)
        if is_open and delivery.worker_settings.strategy_for(kind) in PAUSING:
            # kept for after the back-off (or the next start): nothing is retried or parked
            return Requeue(f"worker {meta.id} paused by its circuit breaker")
        return None

    def ended(self, delivery: Delivery, verdict: Verdict) -> None:
        if isinstance(verdict, Done) and delivery.facts.get(failures_key(delivery.meta.id)):
            Counts(delivery.rt.settings).succeeded(delivery.meta.id)  # closed: count anew


def trip(
    settings: Settings, bus: Bus, meta: WorkerMeta, trips: int, last_error: str, kind: str = "error"
) -> None:
    """The worker reached its ``failure_threshold``: apply its recovery strategy for the kind
    of failure that tripped it (``wm.dataplane.strategies``)."""
    if meta.worker_settings.strategy_for(kind) == "retry":
        open_breaker(settings, bus, meta, trips, last_error)
        return
    threshold = meta.worker_settings.failure_threshold
    failures = f"{threshold} consecutive failed deliveries"
    strategies.apply(settings, bus, meta, kind, failures, threshold, last_error, "breaker")


def failure_kind(error: Exception) -> str:
    """Seed 004's kinds of a failed delivery: its process ended (``crash``: a sandbox or
    helper that died, or runs that kept ending with their pool process), it outlived its
    time limit (``timeout``), or anything else (``error``)."""
    if isinstance(error, WorkerCrashed) or getattr(error, "process_exited", False):
        return "crash"
    return "timeout" if isinstance(error, WorkerTimeout) else "error"


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
