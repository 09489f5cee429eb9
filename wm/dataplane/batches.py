"""Sending many messages with one wait for the broker (``Bus.publish_many``).

- Redis: kombu's publish batch (``Producer.batch``) buffers each message's final command
  (an LPUSH, or this package's ready-list script, ``wm.dataplane.transport``) in one
  pipeline, executed once when the block ends: one round trip for the batch.
- RabbitMQ: publisher confirms stay on, but the batch's messages go out on a channel of its
  own without waiting for each confirm; leaving the block waits until the broker confirmed
  them all (RabbitMQ acknowledges several with one ``multiple`` ack).
- kombu's in-process transport (``memory://``, a test's node in the same process): each
  message as it comes; there is no broker to wait for.

Either way a failure raises out of the block, so the caller tells its own caller the batch
was not published; which of its messages the broker kept is unknown, as for a single publish
whose reply was lost.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from amqp import spec
from celery import Celery
from celery.utils.nodenames import anon_nodename
from kombu.exceptions import OperationalError

from wm.config import Settings
from wm.dataplane.app import BROKER_ERRORS, redis_broker
from wm.dataplane.queues import DELIVER_TASK, EXCHANGE, subscription_queue
from wm.dataplane.readybatch import ReadyBatch, TaskTexts
from wm.dataplane.takenfacts import KEY_HEADER

#: Seconds a batch waits for RabbitMQ's confirms before it counts as failed.
CONFIRM_TIMEOUT_S = 30.0


@functools.lru_cache(maxsize=4096)
def declared_queue(queue: str, settings: Settings) -> Any:
    """The queue of a subscription as ``settings`` declare it, made once per process."""
    return subscription_queue(queue, settings)


def undeclared(producer: Any, queue: Any) -> list[Any]:
    """What a publish through ``producer`` must declare first: ``queue``, unless its
    connection declared it already (kombu's own check comes after copying the queue)."""
    return [] if hash(queue) in producer.connection.declared_entities else [queue]


@contextmanager
def batch_producer(app: Celery, messages: int) -> Iterator[Any]:
    """A producer whose publishes inside the block reach the broker together (see the
    module's docstring); ``messages``: how many the block sends, at most."""
    url = str(app.conf.broker_url)
    if redis_broker(url):
        with app.producer_or_acquire() as producer, producer.batch(max_size=max(1, messages)):
            yield producer
    elif url.startswith("memory://"):  # kombu's in-process transport: nothing to confirm
        with app.producer_or_acquire() as producer:
            yield producer
    else:
        with confirmed(app) as producer:
            yield producer


class Deliveries:
    """Publishes ``wm.deliver`` task messages as ``app.send_task`` builds them (Celery's own
    ``as_task_v2``), without what ``send_task`` does again for each message of a batch:
    routing, a queue declare (kombu copies the queue to check it was declared), signals
    and the result object. With task events on (WM_TASK_EVENTS) each goes through
    ``send_task``, which also publishes its task-sent event."""

    def __init__(self, app: Celery, settings: Settings) -> None:
        self.app, self.settings = app, settings
        self.origin = anon_nodename()
        self._producer: Any = None
        self._held: ReadyBatch | None = None  # the producer's ready-list batch
        self._direct: set[str] = set()  # queues whose messages it holds directly
        self._texts = TaskTexts(app, self.origin)
        self._sent_events = bool(app.conf.task_send_sent_event)  # a lookup: 1.2 µs

    def send(
        self,
        producer: Any,
        queue: str,
        args: list[Any],
        kwargs: dict[str, Any],
        labels: dict[str, str],
        key: str | None = None,
    ) -> None:
        """Send a delivery of the event whose key is ``key`` (``wm.dataplane.takenfacts``)."""
        task_id = self._texts.task_id()
        if self._sent_events:
            self.app.send_task(
                DELIVER_TASK,
                args=args,
                kwargs=kwargs,
                queue=declared_queue(queue, self.settings),
                task_id=task_id,
                producer=producer,
                retry=False,
                headers={KEY_HEADER: key},
                **labels,
            )
            return
        if producer is not self._producer:
            self._producer, self._held, self._direct = producer, ready_batch(producer), set()
        if self._held is not None and queue in self._direct:
            text = self._texts.text(queue, task_id, args, kwargs, labels, key)
            self._held.put_text(queue, text)
            return
        message = self.app.amqp.as_task_v2(
            task_id, DELIVER_TASK, args, kwargs, origin=self.origin, **labels
        )
        message.headers[KEY_HEADER] = key
        self._publish(producer, queue, message)
        if self._held is not None and self._held.takes(queue):  # declared now
            self._direct.add(queue)

    def _publish(self, producer: Any, queue: str, message: Any) -> None:
        """Publish ``message`` through kombu, declaring ``queue`` on the producer's
        connection first if it has not yet."""
        producer.publish(
            message.body,
            exchange=EXCHANGE.name,
            routing_key=queue,
            declare=undeclared(producer, declared_queue(queue, self.settings)),
            serializer="json",
            delivery_mode=2,
            headers=message.headers,
            **message.properties,
        )


def ready_batch(producer: Any) -> ReadyBatch | None:
    """The ready-list batch of ``producer``'s open ``Producer.batch`` block, or None (no
    block open, another transport). kombu keeps a block's batch per thread and makes it on
    the block's first publish; asking for it here makes it the same way, so the messages
    held here and those ``producer.publish`` holds go out in one pipeline, each queue's in
    order."""
    state = getattr(getattr(producer, "_batch_local", None), "current", None)
    make = getattr(state, "_get_session", None)  # kombu >= 5.7
    held = None if make is None else make(producer.channel)
    return held if isinstance(held, ReadyBatch) else None


@contextmanager
def confirmed(app: Celery, timeout_s: float = CONFIRM_TIMEOUT_S) -> Iterator[Any]:
    """A producer on a new channel of a pooled RabbitMQ connection in confirm mode; its
    publishes are not waited for one by one, the block's end waits for all of them."""
    with app.pool.acquire(block=True) as connection:
        channel = connection.channel()
        try:
            confirms = Confirms(channel)
            yield app.amqp.Producer(channel)
            confirms.wait(timeout_s)
        finally:
            with suppress(*BROKER_ERRORS):
                channel.close()


class Confirms:
    """Counts a confirm-mode channel's publishes and the broker's acks and nacks of them
    (delivery tags number a channel's publishes from 1)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.sent = 0
        self.settled: set[int] = set()
        self.refused = 0
        self._floor = 0  # every tag up to it is settled
        channel.confirm_select()
        channel._confirm_selected = True  # py-amqp's own per-message confirm stays off
        channel.basic_publish = self._publish
        channel.events["basic_ack"].add(self._ack)
        channel.events["basic_nack"].add(self._nack)

    def _publish(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("confirm_timeout", None)
        result = self.channel._basic_publish(*args, **kwargs)
        self.sent += 1
        return result

    def _settle(self, tag: int, multiple: bool) -> int:
        if not multiple:
            added = tag not in self.settled
            self.settled.add(tag)
            return int(added)
        before = len(self.settled)
        self.settled.update(range(self._floor + 1, tag + 1))
        self._floor = max(self._floor, tag)
        return len(self.settled) - before

    def _ack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple)

    def _nack(self, tag: int, multiple: bool) -> None:
        self.refused += self._settle(tag, multiple)

    def wait(self, timeout_s: float) -> None:
        """Until every publish is acked; a nack or no answer in time raises."""
        deadline = time.monotonic() + timeout_s
        while len(self.settled) < self.sent:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OperationalError(
                    f"RabbitMQ confirmed {len(self.settled)} of {self.sent} messages within "
                    f"{timeout_s:g} s"
                )
            self.channel.wait([spec.Basic.Ack, spec.Basic.Nack], timeout=left)
        if self.refused:
            raise OperationalError(f"RabbitMQ refused {self.refused} of {self.sent} messages")
