"""The consumer task: decode the message, read the worker's facts, run the delivery pipeline
(``wm.dataplane.pipeline``) and carry out its verdict at Celery's boundary.

Every path ends in exactly one of: success (ack), a resend with a delay (a new message, then
ack: a retry after a failure, or a wait for a lock that uses up no attempt), a dead letter
(stored, then ack), or a requeue (reject) when the platform itself (Redis, database) is
unavailable or a feature keeps the message for later — so no message is ever dropped but one
the tenant guard refuses (``wm.dataplane.guard``: its event is another tenant's). A
message of another shape is parked as ``MalformedMessage``; one that keeps being requeued
for ``WM_REQUEUE_LIMIT_S`` is parked as ``RequeueLimitExceeded`` (``wm.state.requeues``).
"""

from __future__ import annotations

import inspect
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from celery import Task, shared_task
from celery.app.task import Context
from celery.exceptions import Reject, Retry

from wm.dataplane import guard, logcontext, pending, shares, takenfacts, tracing
from wm.dataplane import runtime as runtime_module
from wm.dataplane.batchtask import Batcher, Boundary
from wm.dataplane.bus import send_plain
from wm.dataplane.deadletters import Failure, malformed
from wm.dataplane.delivery import REQUEUE_PAUSE_S, Delivery
from wm.dataplane.features import FEATURES
from wm.dataplane.message import DeliveryState
from wm.dataplane.pipeline import Pipeline
from wm.dataplane.queues import DELIVER_TASK, delivery_labels, over_delivery_limit
from wm.dataplane.runtime import Runtime, reset_runtime, runtime
from wm.dataplane.verdicts import Park, Requeue, Resend, Verdict
from wm.dataplane.watchdog import OVERRUN_GRACE_S
from wm.errors import (
    DeadLettered,
    DeliveryLimitExceeded,
    EventDecodeError,
    InvalidArgument,
    MalformedMessage,
    RequeueLimitExceeded,
    TenantMismatch,
    Unavailable,
    WorkerNotFound,
    WorkerTimeout,
)
from wm.events import CloudEvent, decode, key_of, payload_key
from wm.lifecycle import Status
from wm.names import DEFAULT_TENANT
from wm.state import settled
from wm.state.directory import WorkerMeta, code_key, find_keys
from wm.state.outcomes import Outcomes
from wm.state.requeues import Requeues
from wm.store.shares import Share

__all__ = [
    "PIPELINE",
    "breaker_retry",
    "deliver",
    "echo",
    "first_trip_templates",
    "noop",
    "reset_runtime",
    "start_due",
]

logger = logging.getLogger(__name__)
PIPELINE = Pipeline(FEATURES)
#: Requeues a message has at least before WM_REQUEUE_LIMIT_S parks it: one requeued a few
#: times, far apart, is no loop.
MIN_REQUEUES = 10


@shared_task(
    bind=True,
    name=DELIVER_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=None,
    throws=(DeadLettered, TenantMismatch),  # expected ends: logged without a traceback
)
def deliver(self: Task, *args: Any, **kwargs: Any) -> None:
    """Deliver an event to a worker: ``(worker_id, payload, state=None, **legacy)``, where
    ``state`` is the delivery's state across its runs (``wm.dataplane.message``) and
    ``legacy`` the same as release 0.1 sent it. A message of any other shape is parked as
    ``MalformedMessage``: Celery would drop it (a missing argument) or fail it for ever. One
    whose event is another tenant's than its worker's is dropped (``wm.dataplane.guard``)."""
    rt = runtime(self)
    message = _Message(vars(self.request), args, kwargs)
    with logcontext.scope(worker_id=message.worker_id or None):
        try:
            _deliver(self, rt, message)
        except (Retry, DeadLettered, TenantMismatch):
            raise
        except Requeue as verdict:
            _requeue(self, rt, message, verdict)
        except Reject as exc:
            # Celery turns a retry it could not publish into a dropping Reject: keep the message.
            _requeue(self, rt, message, Requeue(str(exc.reason), pause=True))
        except Unavailable as exc:
            logger.error(
                "platform unavailable, requeueing delivery to %s: %s", message.worker_id, exc
            )
            _requeue(self, rt, message, Requeue(f"{type(exc).__name__}: {exc}", pause=True))
        except Exception as exc:
            # Never acknowledge a message this task could not settle: requeue it.
            logger.exception("unexpected failure delivering to %s; requeueing", message.worker_id)
            _requeue(self, rt, message, Requeue(f"{type(exc).__name__}: {exc}", pause=True))


def _deliver(task: Task, rt: Runtime, message: _Message) -> None:
    if message.malformed is not None:
        _park(rt, message.failure(message.malformed, None))
    if message.given_up_by is not None:
        error = DeliveryLimitExceeded(
            f"RabbitMQ delivered it from queue {message.given_up_by} more than "
            f"WM_AMQP_DELIVERY_LIMIT={rt.settings.amqp_delivery_limit} times without an "
            "acknowledgement, and gave it up"
        )
        _park(rt, message.failure(error, rt.directory.get(message.worker_id)))
    logcontext.bind(attempt=message.number)
    delivery = _delivery(task, rt, message)
    verdict = BATCHER.run(task, delivery) if BATCHER.wanted(delivery) else PIPELINE.run(delivery)
    try:
        _carry_out(task, delivery, verdict)
    except (Retry, DeadLettered):
        _replace_if_due(rt, delivery)
        raise
    except Requeue:
        if rt.replacing is not None:  # its message goes back with the process, unsettled
            raise SystemExit(rt.replacing) from None
        raise
    _replace_if_due(rt, delivery)


def _replace_if_due(rt: Runtime, delivery: Delivery) -> None:
    """The delivery is settled (done, sent again or parked); a pool process that must be
    replaced (``Runtime.replace``) marks its message settled and ends. Its node hands the
    message out again as lost with the process; its next run only acknowledges it."""
    if rt.replacing is None:
        return
    try:
        settled.mark(rt.settings, delivery.message_key)
    except Unavailable as exc:  # its next run would run it again: replaced after another
        logger.warning("pool process not replaced yet (%s): %s", rt.replacing, exc)
        return
    raise SystemExit(rt.replacing)


def _mark_settled(delivery: Delivery) -> None:
    try:
        settled.mark(delivery.rt.settings, delivery.message_key)
    except Unavailable as exc:  # unavoidable: its next run runs it again
        logger.warning("could not mark a timed-out delivery settled; it may run again: %s", exc)


def _overrun(task: Task, request: Context) -> Callable[[Delivery], None]:
    """What the watchdog does with a delivery whose call outlived its limit
    (``wm.dataplane.watchdog``), from its own thread: judge it as failed with WorkerTimeout
    (``worker.error``, retry or dead letter), carry the verdict out as the task would, mark the
    message settled and free the group lock. The watchdog then ends the process."""

    def settle(delivery: Delivery) -> None:
        limit_s = delivery.timeout_s
        error = WorkerTimeout(
            f"worker {delivery.meta.id} did not return within {limit_s:g} s (+{OVERRUN_GRACE_S:g} "
            "s of grace) and its code cannot be stopped: its pool process is replaced"
        )
        verdict = PIPELINE.fail(delivery, error)
        task.request_stack.push(request)  # the task's request, as task.retry reads it
        try:
            _carry_out(task, delivery, verdict)
        except (Retry, DeadLettered):
            _mark_settled(delivery)
        except Requeue:  # it goes back as a message lost with its process (not counted)
            pass
        finally:
            task.request_stack.pop()
            if delivery.lease is not None:
                delivery.rt.locks.release(delivery.lease)

    return settle


def _requeue(task: Task, rt: Runtime, message: _Message, verdict: Requeue) -> NoReturn:
    """Give the message back to its queue, unless it has gone back again and again for
    WM_REQUEUE_LIMIT_S (``wm.state.requeues``): then it is parked, naming the last cause."""
    try:
        requeued = Requeues(rt.settings).count(str(task.request.id), message.resends)
        looping_s, limit_s = requeued.looping_s(time.time()), rt.settings.requeue_limit_s
        if requeued.times >= MIN_REQUEUES and looping_s >= limit_s:
            error = RequeueLimitExceeded(
                f"the message went back to its queue {requeued.times} times in "
                f"{looping_s:.0f} s (WM_REQUEUE_LIMIT_S={limit_s:g}); last cause: {verdict}"
            )
            _park(rt, message.failure(error, rt.directory.get(message.worker_id)))
    except Unavailable as exc:  # neither counted nor parked: the outage itself bounds the loop
        logger.warning(
            "could not count a requeue of the delivery to %s: %s", message.worker_id, exc
        )
    if verdict.pause:
        time.sleep(REQUEUE_PAUSE_S)
    raise Reject(verdict.reason, requeue=True)


class _Message:
    """A ``wm.deliver`` message as read, before its event is decoded. One of another shape
    keeps its arguments as its bytes, and what is wrong with it (``malformed``)."""

    def __init__(
        self, request: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Read under ``request``: the attributes of the task's request (Celery's
        ``Context``), or what they would be for a message a batch took."""
        self.queue = str((request.get("delivery_info") or {}).get("routing_key") or "unknown")
        #: the quorum queue that gave it up at its delivery limit (its headers, which Celery
        #: keeps as the request's attributes, say so), else None
        self.given_up_by = over_delivery_limit(dict(request))
        #: how often it was sent again (a retry, a wait): its number among its messages
        self.resends = 0
        self.malformed: MalformedMessage | None = None
        try:
            self.resends = _resends(request.get("retries"))
            self.worker_id, self.payload, self.state = _arguments(args, kwargs)
        except MalformedMessage as exc:
            self.malformed, self.worker_id, self.state = exc, "", DeliveryState()
            self.payload = json.dumps([args, kwargs], default=repr)  # its body, as JSON
        self.number = max(1, self.resends - self.state.lock_waits + 1)

    def failure(
        self, exc: Exception, meta: WorkerMeta | None, event: CloudEvent | None = None
    ) -> Failure:
        """What parking it before the pipeline records."""
        if self.malformed is not None:
            return malformed(self.queue, self.payload, "application/json", str(exc))
        return Failure(
            topic=meta.topic if meta else "unknown",
            worker_id=self.worker_id,
            envelope=self.payload,
            key=key_of(event) if event is not None else payload_key(self.payload),
            event_id=event.get_id() if event is not None else None,
            error_type=type(exc).__name__,
            error_message=str(exc),
            attempts=self.number,
            version=meta.version if meta else None,
            sha256=meta.sha256 if meta else None,
            first_failure_at=self.state.first_failure_at,
        )


def _shape(
    worker_id: str, payload: str, state: dict[str, Any] | None = None, **legacy: Any
) -> None:
    """The arguments of a ``wm.deliver`` message."""


_SHAPE = inspect.signature(_shape)
_SHAPE_SHOWN = "(worker_id, payload, state=None)"


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str, DeliveryState]:
    """(worker id, payload, state) of a message; raises ``MalformedMessage`` naming what
    does not fit."""
    try:
        given = _given(args, kwargs)
        worker_id, payload = given["worker_id"], given["payload"]
        if not isinstance(payload, str):
            raise InvalidArgument(
                f"payload must be an encoded event (a string), not {payload!r:.40}"
            )
        if not isinstance(worker_id, str) or not _is_uuid(worker_id):
            raise InvalidArgument(f"worker_id must be a worker's id, not {worker_id!r:.60}")
        return worker_id, payload, DeliveryState.read(given.get("state"), given.get("legacy", {}))
    except (TypeError, InvalidArgument) as exc:
        raise MalformedMessage(f"not a {DELIVER_TASK}{_SHAPE_SHOWN} message: {exc}") from exc


def _given(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments by name; the shapes WorkManager sends without ``inspect``'s binding
    (a tenth of a delivery's own time), any other through it (its errors name the defect)."""
    if not kwargs and len(args) == 2:
        return {"worker_id": args[0], "payload": args[1]}
    if len(args) == 2 and kwargs.keys() == {"state"}:
        return {"worker_id": args[0], "payload": args[1], "state": kwargs["state"]}
    return dict(_SHAPE.bind(*args, **kwargs).arguments)


def _resends(retries: Any) -> int:
    """The message's ``retries`` header, a count (Celery's own would fail on another)."""
    if retries is None:
        return 0
    if isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0:
        return retries
    error = f"its retries header must be a count, not {retries!r:.40}"
    raise MalformedMessage(f"not a {DELIVER_TASK}{_SHAPE_SHOWN} message: {error}")


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _delivery(task: Task, rt: Runtime, message: _Message) -> Delivery:
    """The attempt, once its event decodes and its worker runs (else parked or requeued).
    The worker's facts, the event's recorded outcome and the features' facts: one trip (two
    for a shared group's: its members, then the one picked)."""
    worker_id = message.worker_id
    try:
        event = decode(message.payload)
    except EventDecodeError as exc:
        _park(rt, message.failure(exc, rt.directory.get(worker_id)))
    guard.check_queue(event, message.queue, worker_id)  # before any store is touched
    event_key = key_of(event)
    keys = _first_trip_keys(rt, worker_id, event_key)
    request = task.request
    read = None  # what the take of its message read for it, if the node did
    if rt.takes_facts:
        told_at = rt.told_at.get(worker_id, 0.0)  # a stop's question since the take?
        read = takenfacts.taken(request.headers, worker_id, event_key, told_at)
    found, values = rt.directory.find(worker_id, *keys, read=read)
    facts, share = dict(zip(keys, values, strict=True)), None
    if isinstance(found, Share):
        share = found.id
        found, facts = _member(found, rt, {keys[0]: values[0]})
    meta = _running(rt, message, event, found)
    delivery = Delivery(
        rt,
        meta,
        event,
        message.payload,
        str(request.id),
        message.state,
        message.number,
        redelivered=bool((request.delivery_info or {}).get("redelivered")),
        facts=facts,
        node=request.hostname or "",
        on_overrun=_overrun(task, request) if runtime_module.POOL_CHILD else None,
        share=share,
    )
    delivery.key = event_key  # derived once
    return delivery


def _running(
    rt: Runtime, message: _Message, event: CloudEvent, meta: WorkerMeta | None
) -> WorkerMeta:
    """``meta``, once its worker is known to run: the event of a missing or deleted worker
    is parked, that of a worker not running requeued (and its queue paused)."""
    _bind_log_fields(event, meta)
    if meta is not None:
        guard.check_worker(event, meta)  # before anything of the worker is used
    if meta is None or meta.status == Status.DELETED:
        error = WorkerNotFound(f"worker {message.worker_id} does not exist (deleted)")
        _park(rt, message.failure(error, meta, event))
    if meta.status != Status.RUNNING:
        raise Requeue(f"worker {message.worker_id} is {meta.status}; message requeued", pause=True)
    return meta


def _first_trip_keys(rt: Runtime, worker_id: str, event_key: str) -> list[str]:
    """What the first trip reads beside the worker's facts: the event's recorded outcome
    (first, under its key ``event_key``), the features' keys and, on this process's first
    delivery to the worker, its cached code."""
    keys = _trip_keys(worker_id, event_key)
    if rt.engines.loaded(worker_id) is None:
        keys.append(code_key(worker_id))
    return keys


def _trip_keys(worker_id: str, event_key: str) -> list[str]:
    return [Outcomes.key(worker_id, event_key), *PIPELINE.fact_keys(worker_id)]


def first_trip_templates() -> list[str]:
    """The keys of a delivery's first trip but the code's, as a node's take reads them for
    it (``wm.dataplane.takenfacts``): ``Directory.find``'s, then :func:`_first_trip_keys`'."""
    worker, event = takenfacts.WORKER_MARK, takenfacts.EVENT_MARK
    return [*find_keys(worker), *_trip_keys(worker, event)]


def _member(share: Share, rt: Runtime, facts: dict[str, Any]) -> tuple[WorkerMeta, dict[str, Any]]:
    """The running member of ``share`` that takes this delivery, with its facts added to
    ``facts`` (``wm.dataplane.shares``); requeued while none runs."""
    picked = shares.pick(rt.directory, share, PIPELINE.fact_keys)
    if picked is None:
        raise Requeue(
            f"no member of shared group {share.group!r} on topic {share.topic!r} runs now; "
            "message requeued",
            pause=True,
        )
    meta, more = picked
    return meta, {**facts, **more}


def _bind_log_fields(event: CloudEvent, meta: WorkerMeta | None) -> None:
    """The lines logged about this delivery from here on name its event and worker."""
    correlation_id = event.get_extension(logcontext.CORRELATION_EXTENSION)
    logcontext.bind(
        event_id=event.get_id(), correlation_id=correlation_id, trace_id=tracing.trace_id(event)
    )
    if meta is not None:
        logcontext.bind(worker=meta.name or meta.id, topic=meta.topic)
        if meta.tenant != DEFAULT_TENANT:  # the default tenant's lines are as before
            logcontext.bind(tenant=meta.tenant)


def _carry_out(task: Task, delivery: Delivery, verdict: Verdict) -> None:
    """End the task as the verdict says (a success returns)."""
    if isinstance(verdict, Park):  # stored by the pipeline already
        raise DeadLettered(_dead_lettered(verdict.failure))
    if isinstance(verdict, Requeue):
        raise verdict
    if isinstance(verdict, Resend):
        attempt = delivery.attempt + 1 if verdict.counts else delivery.attempt
        raise task.retry(
            countdown=verdict.delay_s,
            kwargs=verdict.state.kwargs(),
            exc=verdict.error,
            max_retries=None,
            **_labels(delivery, attempt),
        )


def _park(rt: Runtime, failure: Failure) -> NoReturn:
    """Store the dead letter of a message the pipeline never saw, then end the task as
    failed (the message is acknowledged): Flower and Celery's events show it, with why."""
    rt.dead_letters.park(failure)
    raise DeadLettered(_dead_lettered(failure))


def _dead_lettered(failure: Failure) -> str:
    return (
        f"dead-lettered after {failure.attempts} attempt(s): {failure.error_type}: "
        f"{failure.error_message}"
    )


def _labels(delivery: Delivery, attempt: int) -> dict[str, str]:
    """How the delivery sent again shows in Flower (``wm.dataplane.queues``)."""
    meta, event = delivery.meta, delivery.event
    shown = delivery.payload if delivery.rt.settings.flower_show_data else None
    return delivery_labels(
        meta.topic, meta.name or meta.id, event.get_id(), event.get_type(), attempt, shown
    )


@shared_task(bind=True, name=pending.RETRY_TASK, acks_late=True, reject_on_worker_lost=True)
def breaker_retry(self: Task, worker_id: str, trips: int) -> None:
    """A worker's circuit-breaker back-off is over: run it again, half-open."""
    rt = runtime(self)
    with logcontext.scope(worker_id=worker_id):
        pending.half_open(rt.settings, rt.bus, worker_id, trips)


@shared_task(bind=True, name=pending.START_TASK, acks_late=True, reject_on_worker_lost=True)
def start_due(self: Task, worker_id: str, actor: str, due: float) -> None:
    """A delayed start's wait is over: run the worker."""
    rt = runtime(self)
    with logcontext.scope(worker_id=worker_id):
        pending.start_due(rt.settings, rt.bus, worker_id, actor, due)


@shared_task(name="wm.noop", acks_late=True, reject_on_worker_lost=True)
def noop() -> None:
    """Does nothing: the bare-Celery baseline that ``wm bench`` measures WorkManager against."""


@shared_task(bind=True, name="wm.echo", acks_late=True, reject_on_worker_lost=True)
def echo(self: Task, queue: str, payload: str) -> None:
    """Publishes ``payload`` to the plain queue ``queue`` on a pooled producer: the bare-Celery
    reference of ``wm bench``'s round trip, a task that answers each message with one, as a
    worker with one output to a plain subscription does."""
    with self.app.producer_or_acquire() as producer:
        send_plain(producer, queue, payload, runtime(self).settings)


#: Batched deliveries (``wm.dataplane.batchtask``), with this module's boundary.
BATCHER = Batcher(FEATURES, Boundary(_Message, _carry_out, _requeue))
