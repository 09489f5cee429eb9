"""Topic routing and publishing (DESIGN.md §5.1).

``publish(event, topic)`` looks the topic up in the routing table (a Redis hash per topic,
rebuilt from the ``subscriptions`` table whenever it is missing) and sends one message per
subscription to that subscription's own durable queue: a Celery task message for a worker,
a plain structured-mode CloudEvent for a plain subscription (sinks, observers, ``wm tail``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from sqlalchemy import select

from wm import store
from wm.config import Settings
from wm.dataplane.app import BROKER_ERRORS, broker_errors, make_app
from wm.dataplane.queues import (
    CLOUDEVENT_CONTENT_TYPE,
    DELIVER_TASK,
    EXCHANGE,
    subscription_queue,
)
from wm.events import CloudEvent, encode, key_of, payload_key
from wm.names import check_name
from wm.state.connection import redis_errors, redis_for, text
from wm.state.ledger import Ledger
from wm.store.models import Subscription

logger = logging.getLogger(__name__)

_ROUTES = "wm:routes:"
_ROUTES_READY = "wm:routes-ready"  # outside the wm:routes:* pattern
_DROPPED = "wm:stats:dropped"
# KEYS: ready flag, the topic's routes, drop counters. ARGV: topic, "1" to count a drop.
# Returns false when the table must be rebuilt first, else the routes (HGETALL's list);
# an empty one is counted as a drop in the same round trip.
_ROUTES_OR_DROP = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local routes = redis.call('HGETALL', KEYS[2])
if #routes == 0 and ARGV[2] == '1' then
  redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
  redis.call('HINCRBY', KEYS[3], '*', 1)
end
return routes
"""


@dataclass(frozen=True)
class Route:
    """One subscription of a topic: its queue and, for a worker, the worker id."""

    queue: str
    worker_id: str | None


def send_plain(producer: Any, queue: str, payload: str) -> None:
    """Publish an encoded event to the plain queue ``queue`` as structured-mode CloudEvent
    JSON, the format any kombu client of a plain subscription reads."""
    producer.publish(
        payload,
        exchange=EXCHANGE,
        routing_key=queue,
        declare=[subscription_queue(queue)],
        content_type=CLOUDEVENT_CONTENT_TYPE,
        content_encoding="utf-8",
        serializer=None,
        delivery_mode=2,
        retry=True,
    )


class Bus:
    """Publishes events to topics and maintains the routing table and queues."""

    def __init__(self, settings: Settings, app: Celery | None = None) -> None:
        self.settings = settings
        self.app = app if app is not None else make_app(settings)

    @property
    def redis(self) -> redis.Redis:
        return redis_for(self.settings)

    # -- routing table ---------------------------------------------------------------------

    def routes(self, topic: str, *, count_drop: bool = False) -> list[Route]:
        """Subscriptions of ``topic``; rebuilds the table first if Redis lost it. With
        ``count_drop``, no subscription counts the event as dropped (same round trip)."""
        with redis_errors(self.settings):
            found = self.parse_routes(self.redis.eval(*self.routes_command(topic, count_drop)))
            if found is None:
                self.rebuild_routes()
                found = self.parse_routes(self.redis.eval(*self.routes_command(topic, count_drop)))
        assert found is not None
        return found

    @staticmethod
    def routes_command(topic: str, count_drop: bool) -> tuple[Any, ...]:
        """The EVAL arguments of a routes lookup (for a pipeline; see :meth:`parse_routes`)."""
        keys = (_ROUTES_READY, _ROUTES + topic, _DROPPED)
        return (_ROUTES_OR_DROP, len(keys), *keys, topic, "1" if count_drop else "0")

    @staticmethod
    def parse_routes(flat: list[Any] | None) -> list[Route] | None:
        """The routes a lookup returned; None when the table must be rebuilt first."""
        if flat is None:
            return None
        pairs = zip(flat[::2], flat[1::2], strict=True)
        return [Route(text(q), text(w) or None) for q, w in sorted(pairs)]

    def rebuild_routes(self) -> int:
        """Make the routing table match the ``subscriptions`` table; returns the fixes made.

        Differences are repaired one by one rather than by rewriting the table, so a route
        added concurrently is never wiped; a route is removed only if a second look at the
        database confirms its subscription is gone.
        """
        with redis_errors(self.settings):
            wanted = self._subscribed()
            actual = self._routed()
            missing = {k: w for k, w in wanted.items() if actual.get(k) != w}
            extra = set(actual) - set(wanted)
            if extra:
                extra -= set(self._subscribed())
            pipe = self.redis.pipeline(transaction=False)
            for (topic, queue), worker in missing.items():
                pipe.hset(_ROUTES + topic, queue, worker)
            for topic, queue in extra:
                pipe.hdel(_ROUTES + topic, queue)
            pipe.set(_ROUTES_READY, "1")
            pipe.execute()
        if missing or extra:
            logger.warning(
                "routing table repaired: %d route(s) added, %d removed", len(missing), len(extra)
            )
        return len(missing) + len(extra)

    def _subscribed(self) -> dict[tuple[str, str], str]:
        with store.session_scope(self.settings) as session:
            subs = session.scalars(select(Subscription)).all()
            return {(s.topic, s.queue): str(s.worker_id or "") for s in subs}

    def _routed(self) -> dict[tuple[str, str], str]:
        routed: dict[tuple[str, str], str] = {}
        for key in self.redis.scan_iter(match=_ROUTES + "*", count=500):
            topic = text(key)[len(_ROUTES) :]
            for queue, worker in self.redis.hgetall(key).items():
                routed[(topic, text(queue))] = text(worker)
        return routed

    def add_route(self, topic: str, queue: str, worker_id: str | None) -> None:
        """Declare the queue, then route ``topic`` to it."""
        self.declare_queue(queue)
        with redis_errors(self.settings):
            self.redis.hset(_ROUTES + topic, queue, worker_id or "")

    def remove_route(self, topic: str, queue: str, *, delete_queue: bool = True) -> None:
        with redis_errors(self.settings):
            self.redis.hdel(_ROUTES + topic, queue)
        if delete_queue:
            self.delete_queue(queue)

    def dropped(self, topic: str | None = None) -> int:
        """Events dropped because nobody subscribed (per topic, or in total)."""
        with redis_errors(self.settings):
            raw = self.redis.hget(_DROPPED, topic or "*")
        return int(raw or 0)

    # -- queues ----------------------------------------------------------------------------

    def declare_queue(self, name: str) -> None:
        with broker_errors(self.settings), self.app.connection_for_write() as conn:
            subscription_queue(name).bind(conn.default_channel).declare()

    def delete_queue(self, name: str) -> None:
        with broker_errors(self.settings), self.app.connection_for_write() as conn:
            bound = subscription_queue(name).bind(conn.default_channel)
            # kombu's virtual transports delete only bindings this channel knows about.
            bound.declare()
            bound.delete()

    def queue_depth(self, name: str) -> int:
        """Messages ready in ``name`` (0 when the queue does not exist)."""
        try:
            with self.app.connection_for_write() as conn:
                result = (
                    subscription_queue(name).bind(conn.default_channel).queue_declare(passive=True)
                )
                return int(result.message_count)
        except BROKER_ERRORS:
            return 0

    # -- publishing ------------------------------------------------------------------------

    def publish(self, event: CloudEvent, topic: str | None = None) -> int:
        """Send ``event`` to every subscription of ``topic`` (default: its type).

        Returns how many subscriptions it was sent to; 0 means it was dropped and counted.
        """
        topic = check_name("topic", topic or event.get_type())
        routes = self.routes(topic, count_drop=True)
        if not routes:
            logger.debug("dropped event %s: topic %r has no subscriber", event.get_id(), topic)
            return 0
        self.send(encode(event), routes, key=key_of(event))
        return len(routes)

    def send(
        self,
        payload: str,
        routes: Iterable[Route],
        *,
        key: str | None = None,
        **task_options: Any,
    ) -> None:
        """Send an encoded event to the given subscriptions (publish and dead-letter replay).

        Deliveries to workers are written to the pending ledger first (``wm.state.ledger``).
        """
        routes = list(routes)
        deliveries = [(r.worker_id, r.queue) for r in routes if r.worker_id is not None]
        key = key or payload_key(payload)
        if deliveries and key:
            Ledger(self.settings).add(deliveries, key, payload)
        with broker_errors(self.settings), self.app.producer_or_acquire() as producer:
            for route in routes:
                self._send_one(producer, route, payload, dict(task_options))

    def _send_one(
        self, producer: Any, route: Route, payload: str, task_options: dict[str, Any]
    ) -> None:
        if route.worker_id is None:
            send_plain(producer, route.queue, payload)
            return
        queue = subscription_queue(route.queue)
        self.app.send_task(
            DELIVER_TASK,
            args=[route.worker_id, payload],
            queue=queue,
            task_id=task_options.pop("task_id", None) or str(uuid.uuid4()),
            producer=producer,
            **task_options,
        )

    # -- consumers on running nodes --------------------------------------------------------

    def broadcast_consume(self, queue: str) -> None:
        """Ask every node to consume ``queue`` now (the periodic reconcile is the safety net)."""
        try:
            self.app.control.add_consumer(
                queue,
                exchange=EXCHANGE.name,
                exchange_type="direct",
                routing_key=queue,
                reply=False,
            )
        except BROKER_ERRORS as exc:
            logger.warning("could not broadcast add_consumer for %s: %s", queue, exc)

    def broadcast_cancel(self, queue: str) -> None:
        try:
            self.app.control.cancel_consumer(queue, reply=False)
        except BROKER_ERRORS as exc:
            logger.warning("could not broadcast cancel_consumer for %s: %s", queue, exc)
