"""Plain subscriptions: named durable queues fed by a topic, for sinks and observers that any
kombu client can read (``wm tail`` reads a temporary one through :meth:`receive`), and the
listing of every subscription with its queue's depth."""

from __future__ import annotations

import json
import time
from collections.abc import Generator, Iterator
from typing import Any

from kombu.entity import Queue
from sqlalchemy.orm import Session

from wm import store
from wm.control.context import Context
from wm.dataplane.app import broker_errors, redis_broker
from wm.dataplane.bus import Route
from wm.dataplane.queues import check_queue_name, plain_queue_name, subscription_queue
from wm.dataplane.routes import route_of
from wm.errors import SubscriptionNotFound
from wm.names import DEFAULT_TENANT, check_name, split_route_topic
from wm.store import records
from wm.store import subscriptions as rows

#: How long one wait for a message lasts while receiving, in seconds (bounds how long a
#: reader takes to notice Ctrl-C).
POLL_S = 1.0


class Subscriptions:
    def __init__(self, context: Context) -> None:
        self.context = context
        self.settings = context.settings

    def subscribe(self, topic: str, name: str) -> str:
        """A named durable queue fed by ``topic`` that any kombu client can read; idempotent.

        Returns the queue name. Messages are structured-mode CloudEvent JSON.
        """
        route = self.context.route(topic)
        queue = plain_queue_name(route, check_name("subscription name", name))
        check_queue_name(queue)
        tenant = self.context.tenant
        records.transaction(self.settings, lambda s: rows.add_plain(s, route, queue, tenant))
        self.context.bus.add_route(route, Route(queue, None))
        return queue

    def unsubscribe(self, topic: str, name: str, *, delete_queue: bool = True) -> None:
        """Remove a plain subscription and (by default) its queue with what it holds."""
        route = self.context.route(topic)
        queue = plain_queue_name(route, name)

        def remove(session: Session) -> None:
            if not rows.remove_plain(session, queue):
                raise SubscriptionNotFound(f"topic {topic!r} has no subscription named {name!r}")

        records.transaction(self.settings, remove)
        self.context.bus.remove_route(route, queue, delete_queue=delete_queue)

    def _check_queue(self, queue: str) -> None:
        """Refuse another tenant's queue (the default tenant may also read a queue no
        subscription has, as before tenants)."""
        tenant = self.context.tenant
        with store.session_scope(self.settings) as session:
            owner = rows.tenant_of_queue(session, queue)
        if owner != tenant and (owner is not None or tenant != DEFAULT_TENANT):
            raise SubscriptionNotFound(f"no subscription has the queue {queue!r}")

    def list(self, topic: str | None = None) -> list[dict[str, Any]]:
        """Every subscription (worker and plain) with its queue depth."""
        route = self.context.route_filter(topic)
        with store.session_scope(self.settings) as session:
            found = [  # a shared group's member with its group's queue
                (
                    split_route_topic(sub.topic)[1],
                    sub.queue if w is None else route_of(w).queue,
                    sub.worker_id,
                )
                for sub, w in rows.listed(session, self.context.tenant, route)
            ]
        depths = self.context.bus.queue_depths([q for _, q, _ in found])
        return [
            {"topic": t, "queue": q, "worker_id": str(w) if w else None, "depth": depths[q]}
            for t, q, w in found
        ]

    def receive(
        self, queue: str, *, count: int | None = None, idle_s: float | None = None
    ) -> Generator[str | bytes, None, None]:
        """The messages of a subscription's queue as they arrive (each one's body), until
        ``count`` were received or none came for ``idle_s`` seconds (None: for ever). A
        message is acknowledged once the caller asks for the next one, or for no more.

        Only this tenant's queues: another tenant's subscription is not found, and outside
        the default tenant so is a queue no subscription has."""
        self._check_queue(queue)
        seen = 0
        # A kombu Connection to WM_BROKER_URL with the transport options publishers use.
        app = self.context.bus.app
        with broker_errors(self.settings), app.connection_for_read() as conn:
            simple = conn.SimpleQueue(subscription_queue(queue, self.settings))
            try:
                while count is None or seen < count:
                    message = _next_message(simple, idle_s)
                    if message is None:
                        return
                    yield message.body
                    message.ack()
                    seen += 1
            finally:
                simple.close()

    def consume(
        self,
        topic: str,
        name: str,
        *,
        count: int | None = None,
        idle_s: float | None = None,
        peek: bool = False,
    ) -> Iterator[str | bytes]:
        """The messages of the plain subscription ``name`` of ``topic``, oldest first:
        taken and acknowledged as :meth:`receive` does, or with ``peek`` those waiting now,
        left in the queue in their order."""
        queue = self._plain_queue(topic, name)
        if peek:
            return self._peek(queue, count)
        return self.receive(queue, count=count, idle_s=idle_s)

    def _plain_queue(self, topic: str, name: str) -> str:
        """The queue of this tenant's plain subscription, or :class:`SubscriptionNotFound`."""
        queue = plain_queue_name(self.context.route(topic), check_name("subscription name", name))
        with store.session_scope(self.settings) as session:
            owner = rows.tenant_of_queue(session, queue)
        if owner != self.context.tenant:
            raise SubscriptionNotFound(
                f"topic {topic!r} has no subscription named {name!r}; create it with: "
                f"wm subscribe {topic} {name}"
            )
        return queue

    def _peek(self, queue: str, count: int | None) -> Iterator[str | bytes]:
        """Up to ``count`` message bodies of ``queue``, oldest first, none taken. Redis: the
        lists read as they are; RabbitMQ: taken unacknowledged, and put back in place when
        the channel closes."""
        app = self.context.bus.app
        with broker_errors(self.settings), app.connection_for_read() as conn:
            if redis_broker(self.settings.broker_url):
                return iter(_redis_peek(conn.default_channel, queue, count))
            return iter(_amqp_peek(conn, subscription_queue(queue, self.settings), count))


def _amqp_peek(conn: Any, queue: Queue, count: int | None) -> list[str | bytes]:
    """Messages taken unacknowledged; closing the channel puts them back where they were."""
    simple = conn.SimpleQueue(queue, no_ack=False)
    bodies: list[str | bytes] = []
    try:
        while count is None or len(bodies) < count:
            try:
                bodies.append(simple.get(block=False).body)
            except simple.Empty:
                break
    finally:
        simple.close()
    return bodies


def _redis_peek(channel: Any, queue: str, count: int | None) -> list[str | bytes]:
    """kombu's Redis lists of ``queue`` in the order a consumer takes them: priority levels
    in turn, each from its right end (kombu pushes left, pops right)."""
    raws: list[bytes] = []
    for level in channel.priority_steps:
        raws.extend(reversed(channel.client.lrange(channel._q_for_pri(queue, level), 0, -1)))
    return [channel.Message(json.loads(raw), channel=channel).body for raw in raws[:count]]


def _next_message(simple: Any, idle_s: float | None) -> Any:
    """The next message, or None once ``idle_s`` passed without one (None: wait forever)."""
    deadline = None if idle_s is None else time.monotonic() + idle_s
    while True:
        wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if wait <= 0:
            return None
        try:
            return simple.get(block=True, timeout=wait)
        except simple.Empty:
            continue
