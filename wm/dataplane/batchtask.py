"""Batched deliveries at Celery's boundary (issue 26): a ``wm.deliver`` task run whose worker
has ``batch_size`` > 1 takes up to ``batch_size - 1`` more messages of its queue
(``wm.dataplane.batchbroker``: one script) and runs them with its own through
:class:`~wm.dataplane.batching.BatchPipeline`.

The task's own message (the leader) ends as any delivery does. Each taken message (a
follower) ends as it would have as a task of its own — the task's code carries out its
verdict under the follower's request (a retry is sent with its headers, a dead letter
stored) — then all are acknowledged in one script, or, for a requeue, put back. Followers
the broker delivered again (their last run may have ended its process) run after the batch,
one at a time, each acknowledged as it ends: code that crashes its process takes no other
event down with it twice. A follower that is no delivery of this worker (another shape,
another worker) is parked or runs alone, as the per-message path would.

Why not celery-batches: it buffers requests in the node's consumer (the serial main process)
and flushes them per task name — all workers share ``wm.deliver``, so a batch would mix
workers — it acknowledges a flush's messages together, with no requeue of one, and each
message is still one fetch from the broker and needs a prefetch as large as the batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import Task
from celery.exceptions import Reject, Retry

from wm.dataplane import guard
from wm.dataplane.batchbroker import BatchBroker, Taken, batch_broker
from wm.dataplane.batching import BatchPipeline
from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import Feature
from wm.dataplane.queues import DELIVER_TASK
from wm.dataplane.runtime import Runtime, runtime
from wm.dataplane.verdicts import Done, Requeue, Verdict
from wm.errors import (
    DeadLettered,
    EventDecodeError,
    IdempotencyKeyMissing,
    TenantMismatch,
    WorkerNotFound,
)
from wm.events import decode, key_of
from wm.idempotency import operation_key
from wm.lifecycle import Status
from wm.state.directory import WorkerMeta

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class BatchedDelivery(Delivery):
    """A follower: its locks and slots are held in the leader's name (one for the batch)."""

    leader_holder: str = ""

    @property
    def holder(self) -> str:
        return self.leader_holder or super().holder


@dataclass(frozen=True)
class Boundary:
    """What the task module lends: ``message(request, args, kwargs)`` reads a message with
    its request's attributes (as Celery's ``Context`` holds them: no request is pushed),
    ``carry_out(task, delivery, verdict)`` ends it as a task run would, and
    ``requeue(task, rt, message, verdict)`` counts a requeue (parking a looping one) and
    raises Reject."""

    message: Callable[[dict[str, Any], tuple[Any, ...], dict[str, Any]], Any]
    carry_out: Callable[[Task, Delivery, Verdict], None]
    requeue: Callable[[Task, Runtime, Any, Requeue], None]


@dataclass(eq=False)
class _Follower:
    taken: Taken
    request: dict[str, Any]
    message: Any
    delivery: Delivery | None = None
    verdict: Verdict | None = None
    settled: bool = field(default=False)


class Batcher:
    """Runs batches through ``features``."""

    def __init__(self, features: Sequence[Feature], boundary: Boundary) -> None:
        self.pipeline = BatchPipeline(features)
        self.boundary = boundary

    def wanted(self, delivery: Delivery) -> bool:
        """A fresh delivery of a worker with batch_size > 1 (a redelivery runs alone, and so
        does a shared group's: its queue's next events may go to other members, and a worker
        with sessions': each call runs where its session is bound)."""
        settings = delivery.worker_settings
        size = settings.batch_size_on(delivery.rt.settings)
        alone = delivery.redelivered or delivery.share is not None or settings.session_key
        return size > 1 and not alone

    def run(self, task: Task, leader: Delivery) -> Verdict:
        """The leader's verdict, once every follower is settled."""
        rt = leader.rt
        broker = batch_broker(rt.settings, rt.bus.app)
        queue = (task.request.delivery_info or {}).get("routing_key")
        if broker is None or not queue:
            return self.pipeline.run(leader)
        size = leader.worker_settings.batch_size_on(rt.settings)
        with broker:
            taken = broker.take(str(queue), size - 1)
            if not taken:
                return self.pipeline.run(leader)
            followers = [self._read(task, broker, t) for t in taken]
            fresh, alone = self._deliveries(task, rt, broker, leader, followers)
            verdicts = self.pipeline.run_batch([leader, *_deliveries(fresh)])
            for follower, verdict in zip(fresh, verdicts[1:], strict=True):
                follower.verdict = verdict
            self._end_all(task, broker, fresh)
            for follower in alone:
                assert follower.delivery is not None
                follower.verdict = self.pipeline.run(follower.delivery)
                self._end_all(task, broker, [follower])
        return verdicts[0]

    def _end_all(self, task: Task, broker: BatchBroker, followers: list[_Follower]) -> None:
        """Carry out each follower's verdict and acknowledge those settled, in one script.
        One that fails to end stays held (it comes back once the batch's holder lapses) and
        its error is raised after the others are acknowledged: none of theirs runs again."""
        tags: list[str] = []
        error: Exception | None = None
        for follower in followers:
            try:
                tag = self._end(task, broker, follower)
            except Exception as exc:
                error = error or exc
                continue
            if tag:
                tags.append(tag)
        broker.ack(tags)
        if error is not None:
            raise error

    def _read(self, task: Task, broker: BatchBroker, taken: Taken) -> _Follower:
        try:
            args, kwargs, embed = taken.body
        except (TypeError, ValueError):  # not a task message of this shape: parked as such
            args, kwargs, embed = (), {"body": repr(taken.body)[:200]}, {}
        request = _request(task, taken, args, kwargs, embed)
        return _Follower(taken, request, self.boundary.message(request, tuple(args), dict(kwargs)))

    def _deliveries(
        self,
        task: Task,
        rt: Runtime,
        broker: BatchBroker,
        leader: Delivery,
        followers: list[_Follower],
    ) -> tuple[list[_Follower], list[_Follower]]:
        """The followers to run with the leader, and those to run alone after; the others
        are settled now (parked, requeued, or left to the node's consumer)."""
        ours = [f for f in followers if self._readable(task, rt, broker, f, leader.meta)]
        event_keys = [key_of(f.message.event) for f in ours]
        keys = [_outcome_key(rt, leader.meta, f, k) for f, k in zip(ours, event_keys, strict=True)]
        fact_keys = self.pipeline.fact_keys(leader.meta.id)
        meta, values = rt.directory.get_with(leader.meta.id, *keys, *fact_keys)
        facts = dict(zip(fact_keys, values[len(keys) :], strict=True))
        fresh: list[_Follower] = []
        alone: list[_Follower] = []
        found = zip(ours, event_keys, keys, values[: len(keys)], strict=True)
        for follower, event_key, key, value in found:
            delivery = _batched(rt, meta or leader.meta, leader, follower, {key: value, **facts})
            delivery.key = event_key  # derived once
            if meta is None or meta.status == Status.DELETED:
                error = WorkerNotFound(f"worker {leader.meta.id} does not exist (deleted)")
                self._park(task, broker, follower, delivery, error)
            elif meta.status != Status.RUNNING:
                follower.delivery = delivery
                reason = f"worker {leader.meta.id} is {meta.status}; message requeued"
                follower.verdict = Requeue(reason, pause=True)
                self._end_all(task, broker, [follower])
            else:
                follower.delivery = delivery
                (alone if delivery.redelivered else fresh).append(follower)
        return fresh, alone

    def _readable(
        self, task: Task, rt: Runtime, broker: BatchBroker, f: _Follower, meta: WorkerMeta
    ) -> bool:
        """A follower that is a delivery to the leader's worker, its event decoded and of the
        worker's tenant (another tenant's is dropped, ``wm.dataplane.guard``)."""
        message, leader = f.message, task.request
        if f.request.get("task") != DELIVER_TASK or message.malformed is not None:
            if f.request.get("task") == DELIVER_TASK:
                self._park(task, broker, f, None, message.malformed)
            else:  # the node's consumer reads it (or parks it) as it comes
                broker.restore(f.taken.tag)
            return False
        if message.worker_id != _worker_of(leader):
            broker.restore(f.taken.tag)  # another worker's, on this queue: delivered alone
            return False
        try:
            message.event = decode(message.payload)
        except EventDecodeError as exc:
            self._park(task, broker, f, None, exc, rt.directory.get(message.worker_id))
            return False
        try:
            guard.check_worker(message.event, meta)
        except TenantMismatch:
            broker.ack([f.taken.tag])
            return False
        return True

    def _park(
        self,
        task: Task,
        broker: BatchBroker,
        follower: _Follower,
        delivery: Delivery | None,
        error: Exception,
        meta: Any = None,
    ) -> None:
        """Dead-letter a follower the pipeline never saw, then acknowledge it."""
        rt = delivery.rt if delivery else None
        message = follower.message
        event = getattr(message, "event", None)
        failure = message.failure(error, delivery.meta if delivery else meta, event)
        (rt or _rt_of(task)).dead_letters.park(failure)
        broker.ack([follower.taken.tag])

    def _end(self, task: Task, broker: BatchBroker, follower: _Follower) -> str | None:
        """Carry out a follower's verdict under its own request; its tag when it is to be
        acknowledged (None: put back, or left held for the holder's lapse)."""
        assert follower.delivery is not None and follower.verdict is not None
        if isinstance(follower.verdict, Done):  # nothing to carry out: acknowledged
            return follower.taken.tag
        task.push_request(**follower.request)
        try:
            self.boundary.carry_out(task, follower.delivery, follower.verdict)
        except (Retry, DeadLettered):
            pass
        except Requeue as verdict:
            return self._requeue(task, broker, follower, verdict)
        except Reject as exc:  # a retry Celery could not publish: the message goes back
            return self._requeue(task, broker, follower, Requeue(str(exc.reason), pause=True))
        finally:
            task.pop_request()
        return follower.taken.tag

    def _requeue(
        self, task: Task, broker: BatchBroker, follower: _Follower, verdict: Requeue
    ) -> str | None:
        rt = _rt_of(task)
        try:  # no pause here: the message goes behind the queue's others
            self.boundary.requeue(task, rt, follower.message, Requeue(verdict.reason))
        except DeadLettered:  # it looped past WM_REQUEUE_LIMIT_S: parked
            return follower.taken.tag
        except Reject:
            pass
        broker.restore(follower.taken.tag)
        return None


def _batched(
    rt: Runtime, meta: WorkerMeta, leader: Delivery, follower: _Follower, facts: dict[str, Any]
) -> BatchedDelivery:
    """A follower's delivery, run beside ``leader`` with the facts read for the batch."""
    request, message = follower.request, follower.message
    return BatchedDelivery(
        rt,
        meta,
        message.event,
        message.payload,
        str(request["id"]),
        message.state,
        message.number,
        redelivered=bool(request["delivery_info"].get("redelivered")),
        facts=facts,
        node=leader.node,
        leader_holder=leader.holder,
    )


def _deliveries(followers: list[_Follower]) -> list[Delivery]:
    return [f.delivery for f in followers if f.delivery is not None]


def _rt_of(task: Task) -> Runtime:
    return runtime(task)


def _outcome_key(rt: Runtime, meta: WorkerMeta, follower: _Follower, key: str) -> str:
    """The outcome key a follower's delivery reads, under the worker's settings as the
    leader read them; its event's (``key``) when it lacks its business key (its run parks
    it)."""
    event = follower.message.event
    with contextlib.suppress(IdempotencyKeyMissing):
        key = operation_key(meta.worker_settings.idempotency_key, event, meta.id, key)
    return rt.outcomes.key(meta.id, key)


def _worker_of(request: Any) -> str | None:
    args, kwargs = request.args or (), request.kwargs or {}
    return args[0] if args else kwargs.get("worker_id")


def _request(task: Task, taken: Taken, args: Any, kwargs: Any, embed: Any) -> dict[str, Any]:
    """The request a task run of the message would have (Celery's ``Request``)."""
    info, properties, leader = taken.delivery_info, taken.properties, task.request
    return {
        **taken.headers,
        **(embed if isinstance(embed, dict) else {}),
        "args": args,
        "kwargs": kwargs,
        "called_directly": False,
        "is_eager": False,
        "hostname": leader.hostname,
        "reply_to": properties.get("reply_to"),
        "correlation_id": properties.get("correlation_id"),
        "delivery_info": {
            "exchange": info.get("exchange"),
            "routing_key": info.get("routing_key"),
            "priority": properties.get("priority"),
            "redelivered": info.get("redelivered"),
        },
    }
