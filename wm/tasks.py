"""The consumer task and its failure policy (DESIGN.md §5.3–5.5).

Every path ends in exactly one of: success (ack), a broker-level retry with backoff and
jitter (a new message, then ack), a dead letter (stored, then ack), or a requeue (reject) when
the platform itself (Redis, database) is unavailable — so no message is ever dropped.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from celery import Task, shared_task
from celery.exceptions import Reject, Retry

from wm.bus import payload_key
from wm.celeryapp import DELIVER_TASK
from wm.config import Settings
from wm.deadletters import Failure
from wm.delivery import Delivery, Runtime
from wm.directory import WorkerMeta
from wm.errors import (
    BrokerUnavailable,
    DatabaseError,
    EngineNotFound,
    EngineUnavailable,
    EventDecodeError,
    InvalidCode,
)
from wm.events import LIFECYCLE_TOPIC, decode, lifecycle_event
from wm.lifecycle import Status
from wm.manager import WorkManager

logger = logging.getLogger(__name__)
#: Failures of the event itself, which no retry fixes: dead-lettered at once.
NOT_RETRYABLE = (EventDecodeError, LookupError)
#: Failures of the worker's code or engine on this node: the worker is moved to ``failed``
#: and the message requeued, so nothing is lost while an operator repairs the worker.
WORKER_BROKEN = (InvalidCode, EngineNotFound, EngineUnavailable)
#: Pause before requeueing when the platform is down, so a node does not spin.
_REQUEUE_PAUSE_S = 1.0
_runtime: Runtime | None = None


def runtime(task: Task) -> Runtime:
    """The per-process runtime (reset after fork by ``wm.node``)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime(Settings.from_env(), task.app)
    return _runtime


def reset_runtime() -> None:
    global _runtime
    if _runtime is not None:
        _runtime.engines.close()
    _runtime = None


@shared_task(
    bind=True, name=DELIVER_TASK, acks_late=True, reject_on_worker_lost=True, max_retries=None
)
def deliver(
    self: Task,
    worker_id: str,
    payload: str,
    pin_version: int | None = None,
    first_failure_at: float | None = None,
) -> None:
    rt = runtime(self)
    try:
        _deliver(self, rt, worker_id, payload, pin_version, first_failure_at)
    except Retry:
        raise
    except Reject as exc:
        if exc.requeue:
            raise
        # Celery turns a retry it could not publish into a dropping Reject: keep the message.
        time.sleep(_REQUEUE_PAUSE_S)
        raise Reject(str(exc.reason), requeue=True) from exc
    except (BrokerUnavailable, DatabaseError) as exc:
        logger.error("platform unavailable, requeueing delivery to %s: %s", worker_id, exc)
        time.sleep(_REQUEUE_PAUSE_S)
        raise Reject(str(exc), requeue=True) from exc
    except Exception as exc:
        # Never acknowledge a message this task could not settle: requeue it.
        logger.exception("unexpected failure delivering to %s; requeueing", worker_id)
        time.sleep(_REQUEUE_PAUSE_S)
        raise Reject(str(exc), requeue=True) from exc


def _deliver(
    task: Task,
    rt: Runtime,
    worker_id: str,
    payload: str,
    pin_version: int | None,
    first_failure_at: float | None,
) -> None:
    meta = rt.directory.get(worker_id)
    topic = meta.topic if meta is not None else "unknown"
    try:
        event = decode(payload)
    except EventDecodeError as exc:
        _park(rt, meta, topic, worker_id, payload, None, exc, 1, first_failure_at)
        return
    if meta is None or meta.status == Status.DELETED:
        error = LookupError(f"worker {worker_id} does not exist (deleted)")
        _park(rt, meta, topic, worker_id, payload, event.get_id(), error, 1, first_failure_at)
        return
    if meta.status != Status.RUNNING:
        time.sleep(_REQUEUE_PAUSE_S)
        raise Reject(f"worker {worker_id} is {meta.status}; message requeued", requeue=True)
    delivery = Delivery(rt, meta, event, str(task.request.id), pin_version)
    try:
        delivery.run()
    except (BrokerUnavailable, DatabaseError):
        raise
    except WORKER_BROKEN as exc:
        logger.error("worker %s cannot run here, marking it failed: %s", meta.id, exc)
        WorkManager(rt.settings, bus=rt.bus).record_failure(
            meta.id, type(exc).__name__, str(exc), fail=True
        )
        raise Reject(f"worker {meta.id} failed: {exc}", requeue=True) from exc
    except Exception as exc:  # every failure goes through the policy
        _failed(task, rt, delivery, payload, exc, first_failure_at)


def _failed(
    task: Task,
    rt: Runtime,
    delivery: Delivery,
    payload: str,
    exc: Exception,
    first_failure_at: float | None,
) -> None:
    meta, event = delivery.meta, delivery.event
    attempts = int(task.request.retries or 0) + 1
    first = first_failure_at or time.time()
    _emit_error(rt, meta, exc, event.get_id(), attempts)
    max_retries = int(meta.settings.get("max_retries", rt.settings.max_retries))
    if isinstance(exc, NOT_RETRYABLE) or attempts > max_retries:
        fence = delivery.lease.fence if delivery.lease else None
        _park(
            rt,
            meta,
            meta.topic,
            meta.id,
            payload,
            event.get_id(),
            exc,
            attempts,
            first,
            version=delivery.version,
            fence=fence,
        )
        return
    delay_s = backoff_s(rt.settings, meta, attempts)
    logger.info(
        "retrying event %s for worker %s in %.2fs (attempt %d of %d): %s",
        event.get_id(),
        meta.id,
        delay_s,
        attempts,
        max_retries + 1,
        exc,
    )
    kwargs: dict[str, Any] = dict(task.request.kwargs or {}, first_failure_at=first)
    raise task.retry(countdown=delay_s, kwargs=kwargs, exc=exc, max_retries=None)


def backoff_s(settings: Settings, meta: WorkerMeta, attempts: int) -> float:
    """Exponential backoff with jitter (between half and all of base * 2^(n-1)), capped."""
    base_ms = int(meta.settings.get("retry_base_delay_ms", settings.retry_base_delay_ms))
    ceiling_ms = min(settings.retry_max_delay_ms, base_ms * 2 ** (attempts - 1))
    return random.uniform(ceiling_ms / 2, ceiling_ms) / 1000


def _park(
    rt: Runtime,
    meta: WorkerMeta | None,
    topic: str,
    worker_id: str,
    payload: str,
    event_id: str | None,
    exc: Exception,
    attempts: int,
    first_failure_at: float | None,
    *,
    version: int | None = None,
    fence: int | None = None,
) -> None:
    rt.dead_letters.park(
        Failure(
            topic=topic,
            worker_id=worker_id,
            envelope=payload,
            event_id=event_id,
            error_type=type(exc).__name__,
            error_message=str(exc),
            attempts=attempts,
            version=version or (meta.version if meta else None),
            sha256=meta.sha256 if meta else None,
            fence=fence,
            first_failure_at=first_failure_at,
        )
    )
    key = payload_key(payload)
    if key is not None:
        rt.ledger.settle(worker_id, key)


def _emit_error(
    rt: Runtime, meta: WorkerMeta, exc: Exception, event_id: str, attempts: int
) -> None:
    data = {
        "group": meta.group,
        "topic": meta.topic,
        "version": meta.version,
        "error_type": type(exc).__name__,
        "error_message": str(exc),
        "event_id": event_id,
        "attempt": attempts,
    }
    rt.bus.publish(lifecycle_event("error", meta.id, data), LIFECYCLE_TOPIC)


@shared_task(name="wm.noop", acks_late=True, reject_on_worker_lost=True)
def noop() -> None:
    """Does nothing: the bare-Celery baseline that ``wm bench`` measures WorkManager against."""
