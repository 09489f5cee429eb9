"""The consumer task and its failure policy (DESIGN.md §5.3–5.5).

Every path ends in exactly one of: success (ack), a broker-level retry with backoff and
jitter (a new message, then ack), a dead letter (stored, then ack), or a requeue (reject) when
the platform itself (Redis, database) is unavailable — so no message is ever dropped. What
an error means for the policy is declared by the error (``retryable``, ``EngineLoadError``).

A group member whose lock is held (beyond the short hand-off window of
``GroupLocks.take``) is no failure: the delivery is sent again with a delay (a new message,
then ack) and its pool process moves on. Such waits are counted apart (``lock_waits``):
they never use up the worker's retries and never dead-letter it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, NoReturn

from celery import Task, shared_task
from celery.exceptions import Reject, Retry

from wm.config import Settings
from wm.dataplane import breaker, logcontext, outbox, quota, tracing
from wm.dataplane.bus import ordered, send_plain
from wm.dataplane.deadletters import Failure
from wm.dataplane.delivery import REQUEUE_PAUSE_S, Delivery, Runtime
from wm.dataplane.observe import notify
from wm.dataplane.queues import DELIVER_TASK, delivery_labels
from wm.errors import (
    BrokerUnavailable,
    DatabaseError,
    DeadLettered,
    EngineLoadError,
    EventDecodeError,
    FenceRejected,
    LockContention,
    WorkerExecutionError,
    WorkerNotFound,
    WorkManagerError,
)
from wm.events import CloudEvent, decode, key_of, payload_key
from wm.lifecycle import Status
from wm.state import ordering
from wm.state.breaker import Breaker, failures_key
from wm.state.directory import WorkerMeta
from wm.state.locks import retry_delay_ms
from wm.state.nodehealth import EngineFailures
from wm.state.ordering import PARTITION_EXTENSION, NotYourTurn, Ordering

logger = logging.getLogger(__name__)
_runtime: Runtime | None = None
#: Threads of a ``-P threads`` pool share the process's runtime: one of them builds it.
_runtime_lock = threading.Lock()


def runtime(task: Task) -> Runtime:
    """The per-process runtime (reset after fork by ``wm.dataplane.node``)."""
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = Runtime(Settings.from_env(), task.app)
    return _runtime


def reset_runtime() -> None:
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            _runtime.listener.stop()
            _runtime.engines.close()
        _runtime = None


@dataclass(frozen=True)
class Attempt:
    """One run of the consumer task on one message: what parking it would record."""

    worker_id: str
    payload: str
    meta: WorkerMeta | None
    number: int
    first_failure_at: float | None

    def failure(
        self,
        exc: Exception,
        event: CloudEvent | None = None,
        *,
        key: str | None = None,
        version: int | None = None,
        fence: int | None = None,
    ) -> Failure:
        meta = self.meta
        return Failure(
            topic=meta.topic if meta else "unknown",
            worker_id=self.worker_id,
            envelope=self.payload,
            key=key or (key_of(event) if event is not None else None),
            event_id=event.get_id() if event is not None else None,
            error_type=type(exc).__name__,
            error_message=str(exc),
            attempts=self.number,
            version=version or (meta.version if meta else None),
            sha256=meta.sha256 if meta else None,
            fence=fence,
            first_failure_at=self.first_failure_at,
        )


@shared_task(
    bind=True,
    name=DELIVER_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=None,
    throws=(DeadLettered,),  # an expected end: logged without a traceback
)
def deliver(
    self: Task,
    worker_id: str,
    payload: str,
    pin_version: int | None = None,
    first_failure_at: float | None = None,
    lock_waits: int = 0,
    waiting_since: float | None = None,
    seq: int | None = None,
) -> None:
    rt = runtime(self)
    waits = LockWaits(lock_waits, waiting_since)
    with logcontext.scope(worker_id=worker_id):
        try:
            _deliver(self, rt, worker_id, payload, pin_version, first_failure_at, waits, seq)
        except (Retry, DeadLettered):
            raise
        except Reject as exc:
            if exc.requeue:
                raise
            # Celery turns a retry it could not publish into a dropping Reject: keep the message.
            time.sleep(REQUEUE_PAUSE_S)
            raise Reject(str(exc.reason), requeue=True) from exc
        except (BrokerUnavailable, DatabaseError) as exc:
            logger.error("platform unavailable, requeueing delivery to %s: %s", worker_id, exc)
            time.sleep(REQUEUE_PAUSE_S)
            raise Reject(str(exc), requeue=True) from exc
        except Exception as exc:
            # Never acknowledge a message this task could not settle: requeue it.
            logger.exception("unexpected failure delivering to %s; requeueing", worker_id)
            time.sleep(REQUEUE_PAUSE_S)
            raise Reject(str(exc), requeue=True) from exc


def _deliver(
    task: Task,
    rt: Runtime,
    worker_id: str,
    payload: str,
    pin_version: int | None,
    first_failure_at: float | None,
    waits: LockWaits,
    seq: int | None,
) -> None:
    number = max(1, int(task.request.retries or 0) - waits.count + 1)
    logcontext.bind(attempt=number)
    try:
        event = decode(payload)
    except EventDecodeError as exc:
        attempt = Attempt(worker_id, payload, rt.directory.get(worker_id), number, first_failure_at)
        _park(rt, attempt.failure(exc, key=payload_key(payload)))
    # the worker's facts, the event's recorded outcome and the breaker's count, in one trip
    meta, (outcome, failures) = rt.directory.get_with(
        worker_id, rt.outcomes.key(worker_id, key_of(event)), failures_key(worker_id)
    )
    attempt = Attempt(worker_id, payload, meta, number, first_failure_at)
    _bind_log_fields(event, meta)
    if meta is None or meta.status == Status.DELETED:
        error = WorkerNotFound(f"worker {worker_id} does not exist (deleted)")
        _park(rt, attempt.failure(error, event))
    if meta.status != Status.RUNNING:
        time.sleep(REQUEUE_PAUSE_S)
        raise Reject(f"worker {worker_id} is {meta.status}; message requeued", requeue=True)
    redelivered = bool((task.request.delivery_info or {}).get("redelivered"))
    delivery = Delivery(
        rt, meta, event, payload, str(task.request.id), pin_version, number, redelivered
    )
    delivery.prefetched, delivery.prefetched_outcome = True, outcome
    with quota.slot(rt, meta):  # a worker with max_events: one of its slots, or requeued
        _run(task, rt, attempt, delivery, waits, bool(failures), Turn.of(rt, delivery, seq))


def _bind_log_fields(event: CloudEvent, meta: WorkerMeta | None) -> None:
    """The lines logged about this delivery from here on name its event and worker."""
    correlation_id = event.get_extension(logcontext.CORRELATION_EXTENSION)
    logcontext.bind(event_id=event.get_id(), correlation_id=correlation_id)
    if meta is not None:
        logcontext.bind(worker=meta.name or meta.id, topic=meta.topic)


@dataclass(frozen=True)
class Turn:
    """An ordered delivery's place among its worker's events of one ``partitionkey``
    (``wm.state.ordering``): it runs in its turn, and its success or dead letter ends it."""

    ordering: Ordering
    worker_id: str
    partition: str
    seq: int

    @classmethod
    def of(cls, rt: Runtime, delivery: Delivery, seq: int | None) -> Turn | None:
        """None for an unordered delivery (no number, no key, or a worker not ordering)."""
        partition = delivery.event.get_extension(PARTITION_EXTENSION)
        if seq is None or not ordered(delivery.meta.settings) or not isinstance(partition, str):
            return None
        return cls(rt.ordering, delivery.meta.id, partition, seq)

    def take(self, gap_s: float) -> None:
        """Return in this delivery's turn; raise :class:`LockContention` before it."""
        verdict, due = self.ordering.turn(self.worker_id, self.partition, self.seq, gap_s)
        if verdict == ordering.WAIT:
            raise NotYourTurn(
                f"key {self.partition!r} of worker {self.worker_id} is at event {due}; this is "
                f"event {self.seq} (ordering: key)"
            )
        if verdict == ordering.SKIP:
            logger.warning(
                "key %r of worker %s waited %g s for event %d, which never came; going on at %d",
                self.partition,
                self.worker_id,
                gap_s,
                due,
                self.seq,
            )

    def done(self) -> None:
        self.ordering.advance(self.worker_id, self.partition, self.seq)


def _run(
    task: Task,
    rt: Runtime,
    attempt: Attempt,
    delivery: Delivery,
    waits: LockWaits,
    failures: bool,
    turn: Turn | None = None,
) -> None:
    """Run the delivery (in its turn, when ordered); every way it ends goes through the
    policy."""
    meta = delivery.meta
    traced = {
        "workmanager.worker_id": meta.id,
        "workmanager.worker": meta.name or "",
        "workmanager.attempt": attempt.number,
    }
    try:
        if turn is not None:
            turn.take(float(meta.settings.get("ordering_gap_s", ordering.GAP_S)))
        with tracing.delivering(delivery.event, traced):
            delivery.run()
    except (BrokerUnavailable, DatabaseError):
        raise
    except LockContention as exc:  # it waits in the broker: no attempt yet
        _wait_for_lock(task, rt, delivery, waits, exc)
    except EngineLoadError as exc:
        notify("delivered", meta)
        notify("failed", meta)
        logger.error("worker %s cannot run here, marking it failed: %s", meta.id, exc)
        node = task.request.hostname or rt.node
        with contextlib.suppress(BrokerUnavailable):  # a health detail: the failure goes on
            EngineFailures(rt.settings).record(node, meta.id, f"{type(exc).__name__}: {exc}")
        outbox.record_failure(
            rt.settings, rt.bus, uuid.UUID(meta.id), type(exc).__name__, str(exc), fail=True
        )
        raise Reject(f"worker {meta.id} failed: {exc}", requeue=True) from exc
    except Exception as exc:  # every failure goes through the policy
        if delivery.began and rt.interrupted(meta.id, delivery.began):
            # killed by a stop: no failure of the worker's; delivered again on its next start
            raise Reject(
                f"worker {meta.id} was stopped during this delivery", requeue=True
            ) from exc
        notify("delivered", meta)
        _failed(task, rt, attempt, delivery, exc, turn)
    else:
        if turn is not None:
            turn.done()
        notify("delivered", meta)
        notify("succeeded", meta)
        if failures:  # the breaker's count starts over (closed)
            Breaker(rt.settings).succeeded(meta.id)


def _failed(
    task: Task,
    rt: Runtime,
    attempt: Attempt,
    delivery: Delivery,
    exc: Exception,
    turn: Turn | None = None,
) -> None:
    meta = delivery.meta
    notify("failed", meta)
    if isinstance(exc, FenceRejected):
        notify("fence_refused", meta)
    error_type = exc.error_type if isinstance(exc, WorkerExecutionError) else type(exc).__name__
    delivery.emit_error(error_type, str(exc))
    if not isinstance(exc, FenceRejected):  # a stolen lock is not the worker's failure
        rt.tally.add(meta.id, ok=False)
        rt.tally.flush_if_due(rt.settings)
        is_open, trips = Breaker(rt.settings).failed(meta.id, breaker.threshold(meta))
        if trips:
            notify("breaker_opened", meta)
            breaker.trip(rt.settings, rt.bus, task.app, meta, trips, f"{error_type}: {exc}")
        if is_open and breaker.strategy(meta) in breaker.PAUSING:
            # kept for after the back-off (or the next start): nothing is retried or parked
            raise Reject(f"worker {meta.id} paused by its circuit breaker", requeue=True)
    max_retries = delivery.max_retries
    retryable = not isinstance(exc, WorkManagerError) or exc.retryable
    if not retryable or attempt.number > max_retries:
        fence = delivery.lease.fence if delivery.lease else None
        failure = attempt.failure(
            exc, delivery.event, key=delivery.key, version=delivery.version, fence=fence
        )
        _park(rt, failure, turn, meta)
    notify("retried", meta)
    delay_s = backoff_s(rt.settings, meta, attempt.number)
    logger.warning(
        "retrying event %s for worker %s in %.2fs (attempt %d of %d): %s",
        delivery.event.get_id(),
        meta.id,
        delay_s,
        attempt.number,
        max_retries + 1,
        exc,
    )
    first = attempt.first_failure_at or time.time()
    kwargs: dict[str, Any] = dict(task.request.kwargs or {}, first_failure_at=first)
    labels = _labels(rt, delivery, attempt.number + 1)
    raise task.retry(countdown=delay_s, kwargs=kwargs, exc=exc, max_retries=None, **labels)


def _park(
    rt: Runtime, failure: Failure, turn: Turn | None = None, meta: WorkerMeta | None = None
) -> NoReturn:
    """Store the dead letter (an ordered key's next event goes on; a known worker's count
    goes up), then end the task as failed (the message is acknowledged): Flower and
    Celery's events show the delivery failed, with the reason."""
    rt.dead_letters.park(failure)
    if turn is not None:
        turn.done()
    if meta is not None:
        notify("dead_lettered", meta)
    raise DeadLettered(
        f"dead-lettered after {failure.attempts} attempt(s): {failure.error_type}: "
        f"{failure.error_message}"
    )


def _labels(rt: Runtime, delivery: Delivery, attempt: int) -> dict[str, str]:
    """How the delivery sent again shows in Flower (``wm.dataplane.queues``)."""
    meta, event = delivery.meta, delivery.event
    shown = delivery.payload if rt.settings.flower_show_data else None
    return delivery_labels(
        meta.topic, meta.name or meta.id, event.get_id(), event.get_type(), attempt, shown
    )


@dataclass(frozen=True)
class LockWaits:
    """How often, and since when, a delivery has waited for its group lock."""

    count: int
    since: float | None


def _wait_for_lock(
    task: Task, rt: Runtime, delivery: Delivery, waits: LockWaits, exc: LockContention
) -> None:
    """Send the delivery again after ``lock_wait_s``: the pool process is free meanwhile, and
    the wait is not a failure. A delivery that has waited longer than any one holder may keep
    the lock is logged as a warning (the group is saturated, or a holder misbehaves)."""
    since = waits.since or time.time()
    waited_s = time.time() - since
    if waited_s > delivery.longest_hold_s:
        logger.warning(
            "event %s for worker %s has waited %.1f s (%d times): %s",
            delivery.event.get_id(),
            delivery.meta.id,
            waited_s,
            waits.count,
            exc,
        )
    kwargs: dict[str, Any] = dict(
        task.request.kwargs or {}, lock_waits=waits.count + 1, waiting_since=since
    )
    delay_s = lock_wait_s(rt.settings, waits.count)
    if isinstance(exc, NotYourTurn):  # its turn comes with a success elsewhere: look soon
        delay_s = min(delay_s, random.uniform(ordering.WAIT_MAX_S / 2, ordering.WAIT_MAX_S))
    labels = _labels(rt, delivery, delivery.attempt)
    raise task.retry(countdown=delay_s, kwargs=kwargs, exc=exc, max_retries=None, **labels)


def lock_wait_s(settings: Settings, waits: int) -> float:
    """Between half and all of :func:`wm.state.locks.retry_delay_ms` (jitter spreads the
    waiters of one group)."""
    ceiling_ms = retry_delay_ms(settings, waits)
    return random.uniform(ceiling_ms / 2, ceiling_ms) / 1000


def backoff_s(settings: Settings, meta: WorkerMeta, attempts: int) -> float:
    """Exponential backoff with jitter (between half and all of base * 2^(n-1)), capped."""
    base_ms = int(meta.settings.get("retry_base_delay_ms", settings.retry_base_delay_ms))
    ceiling_ms = min(settings.retry_max_delay_ms, base_ms * 2 ** (attempts - 1))
    return random.uniform(ceiling_ms / 2, ceiling_ms) / 1000


@shared_task(bind=True, name=breaker.RETRY_TASK, acks_late=True, reject_on_worker_lost=True)
def breaker_retry(self: Task, worker_id: str, trips: int) -> None:
    """A worker's circuit-breaker back-off is over: run it again, half-open."""
    rt = runtime(self)
    with logcontext.scope(worker_id=worker_id):
        breaker.half_open(rt.settings, rt.bus, worker_id, trips)


@shared_task(bind=True, name=breaker.START_TASK, acks_late=True, reject_on_worker_lost=True)
def start_due(self: Task, worker_id: str, actor: str, due: float) -> None:
    """A delayed start's wait is over: run the worker."""
    rt = runtime(self)
    with logcontext.scope(worker_id=worker_id):
        breaker.start_due(rt.settings, rt.bus, worker_id, actor, due)


@shared_task(name="wm.noop", acks_late=True, reject_on_worker_lost=True)
def noop() -> None:
    """Does nothing: the bare-Celery baseline that ``wm bench`` measures WorkManager against."""


@shared_task(bind=True, name="wm.echo", acks_late=True, reject_on_worker_lost=True)
def echo(self: Task, queue: str, payload: str) -> None:
    """Publishes ``payload`` to the plain queue ``queue`` on a pooled producer: the bare-Celery
    reference of ``wm bench``'s round trip, a task that answers each message with one, as a
    worker with one output to a plain subscription does."""
    with self.app.producer_or_acquire() as producer:
        send_plain(producer, queue, payload)
