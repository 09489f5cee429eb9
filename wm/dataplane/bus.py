"""Topic routing and publishing (DESIGN.md §5.1).

``publish(event, topic)`` looks the topic up in the routing table (a Redis hash per topic,
loaded from the ``subscriptions`` table whenever it is missing; ``wm.dataplane.routes``) and
sends one message per subscription to that subscription's own durable queue: a Celery task
message for a worker, a plain structured-mode CloudEvent for a plain subscription (sinks,
observers, ``wm tail``). The lookup and the pending-ledger write are one script, so a
publish costs two round trips: that script, then the send. ``publish_many`` does the same
for a batch of events: one script per topic of the batch and one pipelined send.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from amqp.exceptions import ChannelError, IrrecoverableChannelError
from celery import Celery
from kombu.transport import redis as kombu_redis
from redis.cluster import RedisCluster
from sqlalchemy import select

from wm import store
from wm.config import Settings
from wm.dataplane import tracing
from wm.dataplane.app import BROKER_ERRORS, broker_errors, make_app
from wm.dataplane.batches import Deliveries, batch_producer, declared_queue, undeclared
from wm.dataplane.message import numbered
from wm.dataplane.outgoing import (
    PUBLISH_BATCH,
    Encoded,
    Outgoing,
    encoded,
    outgoing,
    parsed_routes,
    route_keys,
    traced,
)
from wm.dataplane.queues import (
    CLOUDEVENT_CONTENT_TYPE,
    DEFAULT_QUEUE,
    DELIVER_TASK,
    EXCHANGE,
    delivery_labels,
    queue_arguments,
    subscription_queue,
)
from wm.dataplane.routes import (
    DROPPED,
    DROPPED_TTL_S,
    LEGACY_DROPPED,
    LEGACY_READY,
    LEGACY_ROUTES,
    READY,
    READY_TTL_S,
    ROUTES,
    ROUTES_OR_DROP,
    TOPIC,
    topic_key,
    worker_route,
)
from wm.dataplane.routes import Route as Route  # re-exported: the callers' import
from wm.dataplane.routes import ordered as ordered
from wm.dataplane.takenfacts import KEY_HEADER
from wm.errors import PublishInterrupted, Unavailable
from wm.events import (
    CloudEvent,
    in_tenant,
    payload_about,
    payload_key,
    payload_partition,
)
from wm.names import check_route_topic, split_route_topic
from wm.state.connection import StateRedis, queue_eval, redis_errors, redis_for, text
from wm.state.ledger import Delivery, Entries, Ledger
from wm.store.models import Subscription, Worker

logger = logging.getLogger(__name__)


def send_plain(producer: Any, queue: str, payload: str, settings: Settings) -> None:
    """Publish an encoded event to the plain queue ``queue`` as structured-mode CloudEvent
    JSON, the format any kombu client of a plain subscription reads. The queue is declared
    once per connection (kombu remembers what a connection declared); asking kombu every
    time would copy the queue and its exchange for each event (~0.1 ms)."""
    producer.publish(
        payload,
        exchange=EXCHANGE,
        routing_key=queue,
        declare=undeclared(producer, declared_queue(queue, settings)),
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
        self._scripts: dict[str, Any] = {}

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
        keys = (topic_key(topic, READY), topic_key(topic, ROUTES), topic_key(topic, DROPPED))
        return (ROUTES_OR_DROP, len(keys), *keys, "1" if count_drop else "0")

    @staticmethod
    def parse_routes(flat: list[Any] | None) -> list[Route] | None:
        """The routes a lookup returned; None when the table must be rebuilt first."""
        if flat is None:
            return None
        pairs = zip(flat[::2], flat[1::2], strict=True)
        return [Route.parse(q, w) for q, w in sorted(pairs)]

    def rebuild_routes(self, topic: str | None = None, repaired: list[str] | None = None) -> int:
        """Make the routing table (or ``topic``'s routes) match the ``subscriptions`` table
        and mark it loaded; returns the fixes made (the topic of each is added to
        ``repaired`` when given).

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
                pipe.hset(topic_key(name, ROUTES), queue, worker)
            for name, queue in extra:
                pipe.hdel(topic_key(name, ROUTES), queue)
            for name in loaded:  # after its routes: a topic's keys share one node
                pipe.set(topic_key(name, READY), "1", ex=READY_TTL_S)
            if topic is None:
                pipe.delete(LEGACY_READY)
            pipe.execute()
        if repaired is not None:
            repaired += [name for name, _ in [*missing, *extra]]
        if missing or extra:
            logger.warning(
                "routing table repaired: %d route(s) added, %d removed", len(missing), len(extra)
            )
        return len(missing) + len(extra)

    def _subscribed(self, topic: str | None) -> dict[tuple[str, str], str]:
        """The routes the ``subscriptions`` table makes: a worker's own, a shared group's one
        for all its members (``wm.store.shares``), a plain subscription's."""
        query = select(
            Subscription.topic,
            Subscription.queue,
            Subscription.worker_id,
            Worker.group,
            Worker.settings,
            Worker.name,
        ).outerjoin(Worker, Worker.id == Subscription.worker_id)
        if topic is not None:
            query = query.where(Subscription.topic == topic)
        with store.session_scope(self.settings) as session:
            rows = session.execute(query).all()
        routes = [
            worker_route(str(worker), topic_, group, settings, name)
            if worker
            else Route(queue, None)
            for topic_, queue, worker, group, settings, name in rows
        ]
        return {
            (topic_, route.queue): route.value
            for (topic_, *_), route in zip(rows, routes, strict=True)
        }

    def _routed(self, topic: str | None) -> dict[tuple[str, str], str]:
        if topic is not None:
            found = self.redis.hgetall(topic_key(topic, ROUTES))
            return {(topic, text(queue)): text(worker) for queue, worker in found.items()}
        routed: dict[tuple[str, str], str] = {}
        head, tail = len(TOPIC) + 1, len(ROUTES) + 2  # "{" and "}:"
        for key in self.redis.scan_iter(match=f"{TOPIC}*:{ROUTES}", count=500):
            name = text(key)[head:-tail]
            for queue, worker in self.redis.hgetall(key).items():
                routed[(name, text(queue))] = text(worker)
        return routed

    def add_route(self, topic: str, route: Route) -> None:
        """Declare the route's queue, then route ``topic`` to it."""
        self.declare_queue(route.queue)
        with redis_errors(self.settings):
            self.redis.hset(topic_key(topic, ROUTES), route.queue, route.value)
            if self.redis.exists(LEGACY_READY):  # an earlier release still reads it
                self.redis.hset(LEGACY_ROUTES + topic, route.queue, route.worker_id or "")

    def remove_route(self, topic: str, queue: str, *, delete_queue: bool = True) -> None:
        with redis_errors(self.settings):
            self.redis.hdel(topic_key(topic, ROUTES), queue)
            self.redis.hdel(LEGACY_ROUTES + topic, queue)
        if delete_queue:
            self.delete_queue(queue)

    def dropped(self, topic: str | None = None) -> int:
        """Events dropped because nobody subscribed (per topic, or in total), counted by
        this release and by earlier ones (:data:`LEGACY_DROPPED`)."""
        with redis_errors(self.settings):
            legacy = int(self.redis.hget(LEGACY_DROPPED, topic or "*") or 0)
            if topic is not None:
                return legacy + int(self.redis.get(topic_key(topic, DROPPED)) or 0)
            counters = self.redis.scan_iter(match=f"{TOPIC}*:{DROPPED}", count=500)
            return legacy + sum(int(self.redis.get(key) or 0) for key in counters)

    # -- queues ----------------------------------------------------------------------------

    def declare_queue(self, name: str) -> None:
        with broker_errors(self.settings), self.app.connection_for_write() as conn:
            self._declare_on(conn.default_channel, name)

    def declare_queues(self, names: Iterable[str]) -> dict[str, Exception]:
        """Declare each of ``names`` as :meth:`declare_queue` does, on one connection (a
        node's recovery declares every queue: a connection each was half of a node's start
        with 1,000 workers). Returns the queues the broker refused, with its error (after
        one, a new channel: RabbitMQ closes the channel that asked); an unreachable broker
        raises :class:`BrokerUnavailable`."""
        refused: dict[str, Exception] = {}
        with broker_errors(self.settings), self.app.connection_for_write() as conn:
            channel = conn.channel()
            # on Redis a queue costs one round trip, its binding (``Channel.adding_together``)
            together = getattr(channel, "adding_together", contextlib.nullcontext)
            try:
                with together():
                    for name in names:
                        try:
                            with broker_errors(self.settings):
                                self._declare_on(channel, name)
                        except Unavailable:
                            raise
                        except Exception as exc:  # this queue alone (e.g. declared elsewhere
                            refused[name] = exc  # with other arguments)
                            with contextlib.suppress(*BROKER_ERRORS):
                                channel.close()
                            channel = conn.channel()
            finally:
                with contextlib.suppress(*BROKER_ERRORS):
                    channel.close()
        return refused

    def _declare_on(self, channel: Any, name: str) -> None:
        if queue_arguments(self.settings, name):  # a quorum queue, which gives up into
            # the default queue: RabbitMQ drops what it dead-letters to no queue
            subscription_queue(DEFAULT_QUEUE, self.settings).bind(channel).declare()
        subscription_queue(name, self.settings).bind(channel).declare()

    def delete_queue(self, name: str) -> None:
        with broker_errors(self.settings), self.app.connection_for_write() as conn:
            bound = subscription_queue(name, self.settings).bind(conn.default_channel)
            # kombu's virtual transports delete only bindings this channel knows about.
            bound.declare()
            bound.delete()

    def queue_depth(self, name: str) -> int:
        """Messages ready in ``name`` (0 when the queue does not exist)."""
        return self.queue_depths([name])[name]

    def queue_depths(self, names: Sequence[str]) -> dict[str, int]:
        """Messages ready in each of ``names``, on one connection (0 for a queue that does
        not exist, and for every queue when the broker cannot be reached)."""
        try:
            with self.app.connection_for_write() as conn:
                return queue_depths(conn, names)
        except BROKER_ERRORS:
            return dict.fromkeys(names, 0)

    # -- publishing ------------------------------------------------------------------------

    def publish(self, event: CloudEvent, topic: str | None = None) -> int:
        """Send ``event`` to every subscription of ``topic`` (default: its type), a route
        topic (``wm.names.route_topic``): the event's ``tenant`` extension is set to its
        tenant's.

        One round trip looks the routes up and writes the pending ledger, one more sends.
        Returns how many subscriptions it was sent to; 0 means it was dropped and counted.
        """
        topic = check_route_topic(topic or event.get_type())
        event = in_tenant(event, split_route_topic(topic)[0])
        with tracing.publishing(event, topic) as traced:
            [out] = self._record([encoded(traced, topic)])
            if out.routes:
                self._send_out(out, {})
        if not out.routes:
            logger.debug("dropped event %s: topic %r has no subscriber", event.get_id(), topic)
        return len(out.routes)

    def publish_many(
        self, events: Sequence[tuple[CloudEvent, str]], batch: int = PUBLISH_BATCH
    ) -> list[int]:
        """Publish each (event, checked topic) in order, ``batch`` at a time: per
        batch one round trip for the routes and the ledger and one for the broker
        (``wm.dataplane.batches``). Returns the subscriptions each reached.

        A batch that fails raises :class:`PublishInterrupted` with the count of events (the
        first ones) published; the failed batch's ledger entries are withdrawn."""
        reached: list[int] = []
        encode = traced if tracing.spans_publishing() else encoded  # the caller's, throughout
        for start in range(0, len(events), batch):
            some = events[start : start + batch]
            try:
                outs = self._record([encode(event, topic) for event, topic in some])
                self._send_batch([out for out in outs if out.routes])
            except Unavailable as exc:
                raise PublishInterrupted(
                    f"{exc}; the first {start} of {len(events)} events were published, the "
                    "others were not",
                    reached,
                ) from exc
            reached += [len(out.routes) for out in outs]
        return reached

    def send(
        self,
        payload: str,
        routes: Iterable[Route],
        *,
        key: str | None = None,
        about: tuple[str, str] | None = None,
        **task_options: Any,
    ) -> None:
        """Send an encoded event to the given subscriptions (dead-letter replay, outputs,
        the sweep).

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
        self._send_out(Outgoing(payload, key, about, routes, entries), task_options)

    def _record(self, events: list[Encoded]) -> list[Outgoing]:
        """The routes of each event's topic, its deliveries to workers written to the pending
        ledger first (a drop counted for each event nobody subscribed to): one round trip on
        a single Redis server, two on a Redis Cluster (whose slots keep a topic's routes and a
        worker's ledger apart)."""
        if isinstance(self.redis, RedisCluster):
            return self._record_apart(events)
        found: dict[int, Outgoing] = {}
        waiting = self._record_some(events, range(len(events)), found)
        if waiting:  # after loading the topics Redis lost
            for topic in {events[index].topic for index in waiting}:
                self.rebuild_routes(topic)
            _routes_loaded(self._record_some(events, waiting, found))
        return [found[index] for index in range(len(events))]

    def _record_some(
        self, events: list[Encoded], indexes: Iterable[int], found: dict[int, Outgoing]
    ) -> list[int]:
        """Record the events of ``indexes`` into ``found``; returns those whose topic must
        be loaded first."""
        by_topic: dict[str, list[int]] = {}
        for index in indexes:
            by_topic.setdefault(events[index].topic, []).append(index)
        replies = self._routed_adds(events, by_topic)
        waiting: list[int] = []
        for mine, reply in zip(by_topic.values(), replies, strict=True):
            if reply is None:
                waiting += mine
                continue
            flat, done = reply
            width, routes = len(flat) // 2, parsed_routes(flat)
            for n, index in enumerate(mine):
                found[index] = outgoing(events[index], routes, done[n * width : (n + 1) * width])
        return waiting

    def _routed_adds(
        self, events: list[Encoded], by_topic: dict[str, list[int]]
    ) -> list[tuple[list[Any], list[tuple[int, int]]] | None]:
        """One routed add (``Ledger.routed_add_command``) per topic, in one round trip."""
        commands = [
            Ledger.routed_add_command(
                route_keys(topic),
                DROPPED_TTL_S,
                [(events[i].key, events[i].payload, events[i].partition) for i in indexes],
            )
            for topic, indexes in by_topic.items()
        ]
        with redis_errors(self.settings):
            if len(commands) == 1:  # EVALSHA: the script's text is not sent every time
                source, count, *rest = commands[0]
                script = self._scripts.get(source) or self._scripts.setdefault(
                    source, self.redis.register_script(source)
                )
                replies = [script(keys=rest[:count], args=rest[count:], client=self.redis)]
            else:
                pipe = self.redis.pipeline(transaction=False)
                for command in commands:
                    pipe.eval(*command)
                replies = pipe.execute()
        return [Ledger.parse_routed_add(reply) for reply in replies]

    def _record_apart(self, events: list[Encoded]) -> list[Outgoing]:
        """:meth:`_record` on a Redis Cluster: the lookups, then the ledger writes."""
        routes = self._lookups([event.topic for event in events])
        writes = [
            Delivery(
                event.key,
                event.payload,
                tuple((r.worker_id, r.queue) for r in found if r.worker_id is not None),
                tuple(r.worker_id for r in found if r.ordered and r.worker_id is not None),
                event.partition,
            )
            for event, found in zip(events, routes, strict=True)
        ]
        entries = Ledger(self.settings).add_many(writes)
        return [
            Outgoing(event.payload, event.key, event.about, found, written)
            for event, found, written in zip(events, routes, entries, strict=True)
        ]

    def _lookups(self, topics: list[str]) -> list[list[Route]]:
        """Each topic's routes, a drop counted for each without any, in one round trip
        (plus the loading of topics Redis lost, then one more for them)."""
        found: dict[int, list[Route]] = {}
        waiting = list(range(len(topics)))
        for _ in range(2):
            with redis_errors(self.settings):
                pipe = self.redis.pipeline(transaction=False)
                for index in waiting:
                    script, count, *rest = self.routes_command(topics[index], True)
                    queue_eval(pipe, script, rest[:count], *rest[count:])
                replies = pipe.execute()
            missing = []
            for index, reply in zip(waiting, replies, strict=True):
                routes = self.parse_routes(reply)
                if routes is None:
                    missing.append(index)
                else:
                    found[index] = routes
            waiting = missing
            if not waiting:
                break
            for topic in {topics[index] for index in waiting}:
                self.rebuild_routes(topic)
        _routes_loaded(waiting)
        return [found[index] for index in range(len(topics))]

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

    def _send_out(self, out: Outgoing, task_options: dict[str, Any]) -> None:
        """Send one event to its routes; what the send did not complete leaves the ledger."""
        unsent = set(out.entries.created)
        try:
            with broker_errors(self.settings), self.app.producer_or_acquire() as producer:
                for route in out.routes:
                    seq = out.entries.numbers.get(route.worker_id or "")
                    options = dict(task_options)
                    if out.key:  # a plain subscription's send takes no options
                        options["headers"] = {KEY_HEADER: out.key}  # wm.dataplane.takenfacts
                    self._send_one(producer, route, out.payload, options, seq, out.about)
                    unsent.discard(route.worker_id or "")
        except Exception:
            self._withdraw([(unsent, out.key, out.payload)])
            raise

    def _send_batch(self, outs: list[Outgoing]) -> None:
        """Send events to their routes in one batch; if it fails, none of it stays in the
        ledger (the caller is told the batch was not published)."""
        if not outs:
            return
        messages = sum(len(out.routes) for out in outs)
        tasks = Deliveries(self.app, self.settings)
        try:
            with broker_errors(self.settings), batch_producer(self.app, messages) as producer:
                for out in outs:
                    for route in out.routes:
                        if route.worker_id is None:
                            send_plain(producer, route.queue, out.payload, self.settings)
                            continue
                        seq = out.entries.numbers.get(route.worker_id)
                        kwargs = {} if seq is None else numbered(None, seq)
                        labels = self._labels(route, out.payload, out.about)
                        args = [route.worker_id, out.payload]
                        tasks.send(producer, route.queue, args, kwargs, labels, out.key)
        except Exception:
            self._withdraw([(out.entries.created, out.key, out.payload) for out in outs])
            raise

    def _withdraw(self, unsent: list[tuple[Iterable[str], str | None, str]]) -> None:
        """The send raised: the caller hears it failed, so what it did not send leaves the
        ledger, or the sweep would deliver it later."""
        unsent = [(workers, key, payload) for workers, key, payload in unsent if workers and key]
        if not unsent:
            return
        try:
            Ledger(self.settings).withdraw_many(
                (workers, key, payload) for workers, key, payload in unsent if key
            )
        except Unavailable as exc:
            logger.warning(
                "%d event(s): a failed send stays in the pending ledger (%s); the sweep may "
                "still deliver it",
                len(unsent),
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
            send_plain(producer, route.queue, payload, self.settings)
            return
        queue = declared_queue(route.queue, self.settings)
        if seq is not None:  # its number among the worker's events of its partition key
            task_options["kwargs"] = numbered(task_options.get("kwargs"), seq)
        labels = self._labels(route, payload, about)
        self.app.send_task(
            DELIVER_TASK,
            args=[route.worker_id, payload],
            queue=queue,
            **labels,
            task_id=task_options.pop("task_id", None) or str(uuid.uuid4()),
            producer=producer,
            declare=undeclared(producer, queue),
            **task_options,
        )

    def _labels(self, route: Route, payload: str, about: tuple[str, str] | None) -> dict[str, str]:
        event_id, event_type = about or ("?", "?")
        shown = payload if self.settings.flower_show_data else None
        return delivery_labels(route.topic, route.label, event_id, event_type, 1, shown)

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


def _routes_loaded(waiting: list[int]) -> None:
    """Refuse, as unavailable, a publish whose topics' routes Redis lost again right after
    they were loaded (evicted or flushed meanwhile), instead of failing on a missing route."""
    if waiting:
        raise Unavailable(
            "the routing table in Redis was lost again while it was loaded (evicted or "
            "flushed?); publish again: an event published twice is delivered once"
        )


def queue_depths(conn: Any, queues: Iterable[str]) -> dict[str, int]:
    """Messages ready in each queue (0 for a queue that does not exist), on ``conn``: on
    Redis in one round trip, elsewhere one passive declaration each."""
    depths: dict[str, int] = {}
    channel = conn.channel()
    try:
        if isinstance(channel, kombu_redis.Channel):
            return _redis_depths(channel, list(queues))
        for name in queues:
            try:
                declared = subscription_queue(name).bind(channel).queue_declare(passive=True)
                depths[name] = int(declared.message_count)
            except ChannelError as exc:  # no such queue
                depths[name] = 0
                if isinstance(exc, IrrecoverableChannelError):  # AMQP closed the channel
                    with contextlib.suppress(Exception):
                        channel.close()
                    channel = conn.channel()
    finally:
        channel.close()
    return depths


def _redis_depths(channel: Any, queues: list[str]) -> dict[str, int]:
    """What kombu's passive declaration counts -- the lengths of a queue's lists, one per
    priority level; none for a queue that does not exist -- for every queue in one pipeline."""
    levels = [[channel._q_for_pri(name, pri) for pri in channel.priority_steps] for name in queues]
    with channel.conn_or_acquire() as client:
        pipe = client.pipeline(transaction=False)  # lists in many slots on a cluster
        for keys in levels:
            for key in keys:
                pipe.llen(key)
        lengths = iter(pipe.execute())
    return {
        name: sum(int(next(lengths)) for _ in keys)
        for name, keys in zip(queues, levels, strict=True)
    }
