"""Topic routing and publishing (DESIGN.md §5.1).

``publish(event, topic)`` looks the topic up in the routing table (a Redis hash per topic,
loaded from the ``subscriptions`` table whenever it is missing) and sends one message per
subscription to that subscription's own durable queue: a Celery task message for a worker,
a plain structured-mode CloudEvent for a plain subscription (sinks, observers, ``wm tail``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery import Celery
from sqlalchemy import select

from wm import store
from wm.config import Settings
from wm.dataplane import tracing
from wm.dataplane.app import BROKER_ERRORS, broker_errors, make_app
from wm.dataplane.message import numbered
from wm.dataplane.queues import (
    CLOUDEVENT_CONTENT_TYPE,
    DELIVER_TASK,
    EXCHANGE,
    delivery_labels,
    subscription_queue,
)
from wm.errors import Unavailable
from wm.events import (
    CloudEvent,
    encode,
    key_of,
    payload_about,
    payload_key,
    payload_partition,
)
from wm.names import check_name
from wm.state.connection import StateRedis, redis_errors, redis_for, text
from wm.state.ledger import Entries, Ledger
from wm.store.models import Subscription, Worker
from wm.workersettings import WorkerSettings

logger = logging.getLogger(__name__)

#: The routing table, one set of keys per topic, each tagged with the topic: on a Redis
#: Cluster every topic lives on one shard (topics spread over the shards), and a lookup's
#: script touches one slot.
#:
#: - ``wm:topic:{<topic>}:routes``: hash, queue → worker id ('' for a plain subscription);
#: - ``wm:topic:{<topic>}:ready``: the topic's routes were loaded from the database. It is
#:   lost with its shard's data, and a lookup that misses it loads the topic first;
#: - ``wm:topic:{<topic>}:dropped``: events published to the topic while nobody subscribed.
_TOPIC = "wm:topic:"
_ROUTES, _READY, _DROPPED = "routes", "ready", "dropped"
#: The layout of earlier releases, across several slots: a hash per topic and one flag for
#: the whole table, and one hash of drop counts (field ``*``: all topics). Processes of an
#: earlier release still read it during an upgrade: :meth:`Bus.add_route` writes it too
#: while its flag exists, and a full rebuild deletes the flag, so they rebuild theirs from
#: the database. Drops counted there are still reported by :meth:`Bus.dropped`.
_LEGACY_ROUTES = "wm:routes:"
_LEGACY_READY = "wm:routes-ready"
_LEGACY_DROPPED = "wm:stats:dropped"
# KEYS: the topic's ready flag, routes, drop counter. ARGV: "1" to count a drop.
# Returns false when the topic's routes must be loaded first, else the routes (HGETALL's
# list); an empty one is counted as a drop in the same round trip.
_ROUTES_OR_DROP = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local routes = redis.call('HGETALL', KEYS[2])
if #routes == 0 and ARGV[1] == '1' then redis.call('INCR', KEYS[3]) end
return routes
"""


def topic_key(topic: str, kind: str) -> str:
    """The key of ``topic``'s routes, ready flag or drop counter (``kind``)."""
    return f"{_TOPIC}{{{topic}}}:{kind}"


@dataclass(frozen=True)
class Route:
    """One subscription of a topic: its queue and, for a worker, the worker id, its name and
    whether it orders its events by ``partitionkey`` (``wm.state.ordering``)."""

    queue: str
    worker_id: str | None
    ordered: bool = False
    name: str | None = None

    @property
    def value(self) -> str:
        """The route's value in the routing table: '' for a plain subscription, the worker id
        (the format of earlier releases), or JSON with the worker's name and ordering."""
        if self.worker_id is None:
            return ""
        if not (self.name or self.ordered):
            return self.worker_id
        found: dict[str, Any] = {"id": self.worker_id}
        if self.name:
            found["name"] = self.name
        if self.ordered:
            found["ordering"] = "key"
        return json.dumps(found, separators=(",", ":"))

    @classmethod
    def parse(cls, queue: Any, value: Any) -> Route:
        worker = text(value)
        if not worker.startswith("{"):
            return cls(text(queue), worker or None)
        found = json.loads(worker)
        return cls(text(queue), found["id"], found.get("ordering") == "key", found.get("name"))

    @property
    def topic(self) -> str:
        """The topic a worker's queue is named after (``<topic>::<worker id>``)."""
        return self.queue.rpartition("::")[0] or self.queue


def ordered(settings: dict[str, Any] | None) -> bool:
    """A worker with these settings orders its events by ``partitionkey``."""
    return WorkerSettings.of(settings).ordered


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
    def redis(self) -> StateRedis:
        return redis_for(self.settings)

    # -- routing table ---------------------------------------------------------------------

    def routes(self, topic: str, *, count_drop: bool = False) -> list[Route]:
        """Subscriptions of ``topic``; loads them first if Redis lost them. With
        ``count_drop``, no subscription counts the event as dropped (same round trip)."""
        with redis_errors(self.settings):
            found = self.parse_routes(self.redis.eval(*self.routes_command(topic, count_drop)))
            if found is None:
                self.rebuild_routes(topic)
                found = self.parse_routes(self.redis.eval(*self.routes_command(topic, count_drop)))
        assert found is not None
        return found

    @staticmethod
    def routes_command(topic: str, count_drop: bool) -> tuple[Any, ...]:
        """The EVAL arguments of a routes lookup (for a pipeline; see :meth:`parse_routes`)."""
        keys = (topic_key(topic, _READY), topic_key(topic, _ROUTES), topic_key(topic, _DROPPED))
        return (_ROUTES_OR_DROP, len(keys), *keys, "1" if count_drop else "0")

    @staticmethod
    def parse_routes(flat: list[Any] | None) -> list[Route] | None:
        """The routes a lookup returned; None when the table must be rebuilt first."""
        if flat is None:
            return None
        pairs = zip(flat[::2], flat[1::2], strict=True)
        return [Route.parse(q, w) for q, w in sorted(pairs)]

    def rebuild_routes(self, topic: str | None = None) -> int:
        """Make the routing table (or ``topic``'s routes) match the ``subscriptions`` table
        and mark it loaded; returns the fixes made.

        Differences are repaired one by one rather than by rewriting the table, so a route
        added concurrently is never wiped; a route is removed only if a second look at the
        database confirms its subscription is gone.
        """
        with redis_errors(self.settings):
            wanted = self._subscribed(topic)
            actual = self._routed(topic)
            missing = {k: w for k, w in wanted.items() if actual.get(k) != w}
            extra = set(actual) - set(wanted)
            if extra:
                extra -= set(self._subscribed(topic))
            loaded = {t for t, _ in [*wanted, *actual]} | ({topic} if topic else set())
            pipe = self.redis.pipeline(transaction=False)
            for (name, queue), worker in missing.items():
                pipe.hset(topic_key(name, _ROUTES), queue, worker)
            for name, queue in extra:
                pipe.hdel(topic_key(name, _ROUTES), queue)
            for name in loaded:  # after its routes: a topic's keys share one node
                pipe.set(topic_key(name, _READY), "1")
            if topic is None:
                pipe.delete(_LEGACY_READY)
            pipe.execute()
        if missing or extra:
            logger.warning(
                "routing table repaired: %d route(s) added, %d removed", len(missing), len(extra)
            )
        return len(missing) + len(extra)

    def _subscribed(self, topic: str | None) -> dict[tuple[str, str], str]:
        query = select(
            Subscription.topic,
            Subscription.queue,
            Subscription.worker_id,
            Worker.settings,
            Worker.name,
        ).outerjoin(Worker, Worker.id == Subscription.worker_id)
        if topic is not None:
            query = query.where(Subscription.topic == topic)
        with store.session_scope(self.settings) as session:
            rows = session.execute(query).all()
        return {
            (topic_, queue): Route(
                queue, str(worker) if worker else None, ordered(settings), name
            ).value
            for topic_, queue, worker, settings, name in rows
        }

    def _routed(self, topic: str | None) -> dict[tuple[str, str], str]:
        if topic is not None:
            found = self.redis.hgetall(topic_key(topic, _ROUTES))
            return {(topic, text(queue)): text(worker) for queue, worker in found.items()}
        routed: dict[tuple[str, str], str] = {}
        head, tail = len(_TOPIC) + 1, len(_ROUTES) + 2  # "{" and "}:"
        for key in self.redis.scan_iter(match=f"{_TOPIC}*:{_ROUTES}", count=500):
            name = text(key)[head:-tail]
            for queue, worker in self.redis.hgetall(key).items():
                routed[(name, text(queue))] = text(worker)
        return routed

    def add_route(self, topic: str, route: Route) -> None:
        """Declare the route's queue, then route ``topic`` to it."""
        self.declare_queue(route.queue)
        with redis_errors(self.settings):
            self.redis.hset(topic_key(topic, _ROUTES), route.queue, route.value)
            if self.redis.exists(_LEGACY_READY):  # an earlier release still reads it
                self.redis.hset(_LEGACY_ROUTES + topic, route.queue, route.worker_id or "")

    def remove_route(self, topic: str, queue: str, *, delete_queue: bool = True) -> None:
        with redis_errors(self.settings):
            self.redis.hdel(topic_key(topic, _ROUTES), queue)
            self.redis.hdel(_LEGACY_ROUTES + topic, queue)
        if delete_queue:
            self.delete_queue(queue)

    def dropped(self, topic: str | None = None) -> int:
        """Events dropped because nobody subscribed (per topic, or in total), counted by
        this release and by earlier ones (:data:`_LEGACY_DROPPED`)."""
        with redis_errors(self.settings):
            legacy = int(self.redis.hget(_LEGACY_DROPPED, topic or "*") or 0)
            if topic is not None:
                return legacy + int(self.redis.get(topic_key(topic, _DROPPED)) or 0)
            counters = self.redis.scan_iter(match=f"{_TOPIC}*:{_DROPPED}", count=500)
            return legacy + sum(int(self.redis.get(key) or 0) for key in counters)

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
        with tracing.publishing(event, topic) as traced:
            about = (traced.get_id(), traced.get_type())
            self.send(encode(traced), routes, key=key_of(traced), about=about)
        return len(routes)

    def send(
        self,
        payload: str,
        routes: Iterable[Route],
        *,
        key: str | None = None,
        about: tuple[str, str] | None = None,
        **task_options: Any,
    ) -> None:
        """Send an encoded event to the given subscriptions (publish and dead-letter replay).

        Deliveries to workers are written to the pending ledger first (``wm.state.ledger``);
        if the send raises, those it did not complete are withdrawn from the ledger.
        ``about``: the event's id and type, which label the delivery in Flower (read from
        the payload when not given).
        """
        routes = list(routes)
        key = key or payload_key(payload)
        entries = self._pending(routes, key, payload)
        if about is None and any(r.worker_id is not None for r in routes):
            about = payload_about(payload)
        unsent = set(entries.created)
        try:
            with broker_errors(self.settings), self.app.producer_or_acquire() as producer:
                for route in routes:
                    seq = entries.numbers.get(route.worker_id or "")
                    self._send_one(producer, route, payload, dict(task_options), seq, about)
                    unsent.discard(route.worker_id or "")
        except Exception:
            self._withdraw(unsent, key, payload)
            raise

    def _pending(self, routes: list[Route], key: str | None, payload: str) -> Entries:
        """Write the deliveries to workers to the pending ledger."""
        deliveries = [(r.worker_id, r.queue) for r in routes if r.worker_id is not None]
        if not (deliveries and key):
            return Entries({}, ())
        numbered = [r.worker_id for r in routes if r.ordered and r.worker_id is not None]
        partition = payload_partition(payload) if numbered else None
        return Ledger(self.settings).add(
            deliveries, key, payload, numbered=numbered, partition=partition
        )

    def _withdraw(self, unsent: set[str], key: str | None, payload: str) -> None:
        """The send raised: the caller hears it failed, so what it did not send leaves the
        ledger, or the sweep would deliver it later."""
        if not (unsent and key):
            return
        try:
            Ledger(self.settings).withdraw(unsent, key, payload)
        except Unavailable as exc:
            logger.warning(
                "event %s: a failed send stays in the pending ledger of %s (%s); the sweep "
                "may still deliver it",
                key,
                sorted(unsent),
                exc,
            )

    def _send_one(
        self,
        producer: Any,
        route: Route,
        payload: str,
        task_options: dict[str, Any],
        seq: int | None = None,
        about: tuple[str, str] | None = None,
    ) -> None:
        if route.worker_id is None:
            send_plain(producer, route.queue, payload)
            return
        queue = subscription_queue(route.queue)
        if seq is not None:  # its number among the worker's events of its partition key
            task_options["kwargs"] = numbered(task_options.get("kwargs"), seq)
        event_id, event_type = about or ("?", "?")
        shown = payload if self.settings.flower_show_data else None
        labels = delivery_labels(
            route.topic, route.name or route.worker_id, event_id, event_type, 1, shown
        )
        self.app.send_task(
            DELIVER_TASK,
            args=[route.worker_id, payload],
            queue=queue,
            **labels,
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
