"""Publishing a worker's outputs exactly once to plain subscriptions.

A redelivered event republishes its recorded outputs (``wm.state.outcomes``), so each output may
be sent more than once. Worker subscriptions absorb that (their deliveries are idempotent by
event id). A plain subscription is a queue any kombu client reads, so it gets each output once:
- Redis broker: one Lua script sets the output's marker and pushes the kombu message onto
  every plain queue, atomically: a crash leaves either both or neither.
- Other brokers (RabbitMQ): the marker is checked before and set right after the publish; a
  crash between the two can repeat that one output, with the same id.

The marker is one key, ``wm:published:<topic>:<event key>``: in the broker's Redis (always a
single server) for a Redis broker, else in the state store, where no command reads it with
another key, so it needs no hash tag on a Redis Cluster.

Where the broker is a database of the state store's own Redis server (the default: ``/0`` and
``/1`` of one server), a delivery without a group lock folds each output's push into the
round trip that records its outcome (:meth:`OutputPublisher.folded`): a script queued behind
the record reads the topic's routes and, if the outcome recorded is this one, pushes to the
plain subscriptions in the broker's database. One round trip fewer per delivery with
outputs, and the same guarantee: the marker and the pushes in one script, after the record.
The script returns the topic's routes, for the delivery to send to its worker subscribers.
Where this process found, less than :data:`QUIET_S` ago, that each output's topic has none
(:meth:`OutputPublisher.quiet`), the delivery does not wait for that reply
(``wm.state.unawaited``): the script is given the delivery's ledger entry instead and puts
it back, due at once, should it find worker subscribers after all (or another outcome, or
routes to load), so the sweep's next turn delivers the event again and the outcome recorded
is republished to them. Nothing is lost; such an output reaches a worker that subscribed in
that second up to WM_RECONCILE_INTERVAL_S later.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from kombu.utils.json import dumps
from redis.cluster import RedisCluster

from wm.dataplane.app import broker_errors, redis_broker, shared_server
from wm.dataplane.bus import Bus, Route
from wm.dataplane.queues import CLOUDEVENT_CONTENT_TYPE, EXCHANGE
from wm.dataplane.routes import COUNT_ENDS, DROPPED, READY, ROUTES, topic_key
from wm.events import CloudEvent, encode, key_of, tenant_of
from wm.names import route_topic
from wm.state.connection import StatePipeline, pooled_client, queue_eval, redis_errors
from wm.state.ledger import Settlement

_MARKER = "wm:published:"
#: Seconds a process takes a topic it found without worker subscribers to have none still
#: (:meth:`OutputPublisher.quiet`). A subscriber that comes meanwhile gets the outputs the
#: process pushed without reading the reply from the sweep's next turn, not at once.
QUIET_S = 1.0
#: Seconds an output's push may wait for the broker's Redis before it fails (and is retried).
BROKER_SOCKET_TIMEOUT_S = 30
# KEYS: marker, queue lists. ARGV: marker ttl s, one kombu message per queue.
_PUSH_ONCE = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 2, #KEYS do redis.call('LPUSH', KEYS[i], ARGV[i]) end
return 1
"""
#: Where :data:`_PUSH_FOLDED` writes each queue's name and delivery tag into the message.
_QUEUE, _TAG = "@wm-queue@", "@wm-tag@"
#: Where :meth:`OutputPublisher._message_template` puts the body into the message it made.
_BODY = "@wm-body@"
# Run in the state store's database, queued behind an outcome's record. KEYS: the topic's
# ready flag, routes and drop counter, the outcome, the marker (in the broker's database)[,
# the worker's pending ledger]. ARGV: the state's database, the broker's, the outcome's
# SHA-1, the marker's ttl s, the kombu message with the placeholders, a delivery tag
# prefix[, the delivery's ledger member]. Returns false, having done nothing (the topic's
# routes must be loaded, or the outcome recorded is another one), else the topic's routes
# (HGETALL's list) with its plain subscriptions pushed to once. Given the ledger's entry (a
# caller that reads no reply, :meth:`OutputPublisher.quiet`), it puts the delivery back in
# the ledger, due at once, where the caller would have had more to do: the sweep's next turn
# delivers the event again, which republishes the outcome recorded (and so where a push
# failed: the caller that waits raises then, and its retry republishes). No outcome at all
# means the record failed: its reply says so, and ``wm.state.unawaited`` decides. The writes
# in the broker's database are pcall'd, so the state's database is always selected back
# (before Redis 7, a script's SELECT outlives it on its connection).
_PUSH_FOLDED = """
local function owed() if KEYS[6] then redis.call('ZADD', KEYS[6], 0, ARGV[7]) end end
if redis.call('EXISTS', KEYS[1]) == 0 then owed() return false end
local outcome = redis.call('GET', KEYS[4])
if not outcome then return false end
if redis.sha1hex(outcome) ~= ARGV[3] then owed() return false end
local routes = redis.call('HGETALL', KEYS[2])
if #routes == 0 then redis.call('INCR', KEYS[3]) <ends> return routes end
local plain = {}
for i = 1, #routes, 2 do if routes[i + 1] == '' then plain[#plain + 1] = routes[i] end end
if #plain < #routes / 2 then owed() end
if #plain == 0 then return routes end
local function put(text, mark, value)
  local first, last = string.find(text, mark, 1, true)
  return string.sub(text, 1, first - 1) .. value .. string.sub(text, last + 1)
end
redis.call('SELECT', ARGV[2])
local marked = redis.pcall('SET', KEYS[5], '1', 'NX', 'EX', ARGV[4])
local failed = type(marked) == 'table' and marked.err and marked or nil
if type(marked) == 'table' and marked.ok then
  for i, queue in ipairs(plain) do
    local message = put(ARGV[5], '<queue>', cjson.encode(queue))
    message = put(message, '<tag>', cjson.encode(ARGV[6] .. '-' .. i))
    local pushed = redis.pcall('LPUSH', queue, message)
    if type(pushed) == 'table' and pushed.err then failed = pushed break end
  end
end
redis.call('SELECT', ARGV[1])
if failed then owed() return failed end
return routes
"""
_PUSH_FOLDED = (
    _PUSH_FOLDED.replace("<queue>", json.dumps(_QUEUE))
    .replace("<tag>", json.dumps(_TAG))
    .replace("<ends>", COUNT_ENDS)
)


class OutputPublisher:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.ttl_s = bus.settings.outcome_ttl_s
        self.redis_broker = redis_broker(bus.settings.broker_url)
        self._connection: Any = None
        self._channel: Any = None
        self._push_script: Any = None
        #: The text of kombu's message before and after its body (:meth:`_message_template`).
        self._around_body: list[str] | None = None
        #: Topics with no worker subscriber, until when (``time.monotonic()``; :meth:`quiet`).
        self._quiet: dict[str, float] = {}

    def lookups(self, outputs: list[CloudEvent]) -> Callable[[StatePipeline], None]:
        """Queues the routes lookups of ``outputs`` in a pipeline (drops counted), so
        :meth:`publish` can be given their results instead of asking Redis again."""

        def queue(pipe: StatePipeline) -> None:
            for output in outputs:
                script, count, *rest = Bus.routes_command(output_topic(output), True)
                queue_eval(pipe, script, rest[:count], *rest[count:])

        return queue

    @functools.cached_property
    def _databases(self) -> tuple[int, int] | None:
        """(the state store's database, the broker's) where outputs' pushes fold into their
        record's round trip (``wm.dataplane.app.shared_server``). None elsewhere."""
        if isinstance(self.bus.redis, RedisCluster):
            return None
        return shared_server(self.bus.settings)

    @property
    def folds(self) -> bool:
        """Whether outputs' pushes fold into their record's round trip (:meth:`folded`)."""
        return self._databases is not None

    def folded(
        self,
        outputs: list[CloudEvent],
        texts: list[str],
        outcome: str,
        body: str,
        owed: Settlement | None = None,
    ) -> Callable[[StatePipeline], None]:
        """Queues, for each output (``texts``: each one's :func:`~wm.events.encode`), its
        push in the round trip of its record (``outcome``, recorded as ``body``), where the
        pushes fold (:attr:`folds`); :meth:`looked_up` reads their replies. ``owed``: the
        delivery's ledger entry, for a caller that reads no reply (:meth:`quiet`): the
        push puts it back, due at once, wherever the caller would have had more to do."""
        dbs = self._databases
        assert dbs is not None, "the pushes do not fold here"
        digest = hashlib.sha1(body.encode()).hexdigest()
        ledger = [] if owed is None else [owed.index]
        entry = [] if owed is None else [owed.member]

        def queue(pipe: StatePipeline) -> None:
            for output, text in zip(outputs, texts, strict=True):
                topic = output_topic(output)
                keys = [topic_key(topic, kind) for kind in (READY, ROUTES, DROPPED)]
                keys += [outcome, f"{_MARKER}{topic}:{key_of(output)}", *ledger]
                message = self._message_template(text)
                tags = os.urandom(16).hex()  # a uuid4's randomness, without its object
                args = (*dbs, digest, self.ttl_s, message, tags, *entry)
                queue_eval(pipe, _PUSH_FOLDED, keys, *args)

        return queue

    def quiet(self, outputs: list[CloudEvent]) -> bool:
        """Whether each output's topic had no worker subscriber (its routes loaded) when this
        process last read its routes, less than :data:`QUIET_S` ago: then a folded push
        (:meth:`folded`, given the ledger's entry) leaves nothing to send after it, and its
        reply need not be read."""
        now = time.monotonic()
        return all(self._quiet.get(output_topic(o), 0.0) > now for o in outputs)

    def looked_up(
        self, outputs: list[CloudEvent], replies: list[Any], folded: bool
    ) -> list[list[Route] | None]:
        """Each output's routes from the replies of :meth:`lookups` or :meth:`folded` (None:
        look them up when publishing). Folded, the plain subscriptions were pushed to: only
        the workers' routes are left, and :meth:`quiet` learns which topics have none."""
        found = [self.bus.parse_routes(reply) for reply in replies]
        if not folded:
            return found
        left = [None if r is None else [x for x in r if x.worker_id is not None] for r in found]
        until = time.monotonic() + QUIET_S
        for output, routes in zip(outputs, left, strict=True):
            if routes == []:
                self._quiet[output_topic(output)] = until
            else:
                self._quiet.pop(output_topic(output), None)
        return left

    def publish(
        self, output: CloudEvent, routes: list[Route] | None = None, payload: str | None = None
    ) -> None:
        """Send ``output`` to the topic of its type: to workers (maybe again), to plain
        subscriptions once. ``routes``: the topic's, looked up (and a drop counted) already;
        ``payload``: the output's :func:`~wm.events.encode`, when the caller has it."""
        topic = output_topic(output)
        if routes is None:
            routes = self.bus.routes(topic, count_drop=True)
        if not routes:
            return
        payload, key = encode(output) if payload is None else payload, key_of(output)
        workers = [r for r in routes if r.worker_id is not None]
        plain = [r for r in routes if r.worker_id is None]
        # Plain subscriptions first: a worker fed by this output may answer before the
        # send returns, and a subscriber must not see that answer before its cause.
        if plain:
            marker = f"{_MARKER}{topic}:{key}"
            if self.redis_broker:
                self._push_once(payload, plain, marker)
            else:
                self._send_marked(payload, plain, marker)
        if workers:
            self.bus.send(payload, workers, key=key, about=(output.get_id(), topic))

    def _push_once(self, payload: str, routes: list[Route], marker: str) -> None:
        """One EVAL on a pooled client of the broker's Redis (opening a broker connection
        per output cost about 2 ms: two new Redis connections)."""
        settings = self.bus.settings
        with broker_errors(settings):
            channel = self._message_channel()
            keys, messages = [marker], []
            for route in routes:
                key, message = _kombu_message(channel, payload, route.queue)
                keys.append(key)
                messages.append(message)
            client = pooled_client(settings.broker_url, BROKER_SOCKET_TIMEOUT_S)
            if self._push_script is None:  # EVALSHA: the script's text is not sent each time
                self._push_script = client.register_script(_PUSH_ONCE)
            self._push_script(keys=keys, args=[self.ttl_s, *messages], client=client)

    def _message_channel(self) -> Any:
        """A kombu channel of the broker, kept to build messages exactly as kombu's Redis
        transport does (no I/O goes through it after it is opened)."""
        if self._channel is None:
            self._connection = self.bus.app.connection_for_write()
            self._channel = self._connection.default_channel
        return self._channel

    def _message_template(self, payload: str) -> str:
        """The kombu message :data:`_PUSH_FOLDED` pushes, its queue and delivery tag left as
        placeholders. Only the body differs from one output to the next: kombu makes the
        message once, and each output's body, encoded as kombu encodes it, goes in."""
        channel = self._message_channel()
        if self._around_body is None:
            message = _prepared(channel, "", _QUEUE)
            message["body"], message["properties"]["delivery_tag"] = _BODY, _TAG
            self._around_body = str(dumps(message)).split(json.dumps(_BODY))
        head, tail = self._around_body
        body, _ = channel.encode_body(payload, channel.body_encoding)
        return f"{head}{json.dumps(body)}{tail}"

    def _send_marked(self, payload: str, routes: list[Route], marker: str) -> None:
        with redis_errors(self.bus.settings):
            if self.bus.redis.exists(marker):
                return
            self.bus.send(payload, routes)
            self.bus.redis.set(marker, 1, ex=self.ttl_s)


def output_topic(output: CloudEvent) -> str:
    """The route topic of an output (stamped by its delivery): its type, in the tenant of
    the worker that made it."""
    return route_topic(tenant_of(output), output.get_type())


def _kombu_message(channel: Any, payload: str, queue: str) -> tuple[str, str]:
    """The list key and the serialized message kombu's Redis transport would LPUSH for a
    plain publish of ``payload`` to ``queue`` (what ``Producer.publish`` does, step by step)."""
    message = _prepared(channel, payload, queue)
    key = channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False))
    return str(key), str(dumps(message))


def _prepared(channel: Any, payload: str, queue: str) -> dict[str, Any]:
    """The message kombu's Redis transport makes of a plain publish of ``payload`` to
    ``queue`` (its priority is 0: it goes to the list named after the queue)."""
    message: dict[str, Any] = channel.prepare_message(
        payload, None, CLOUDEVENT_CONTENT_TYPE, "utf-8", {}, {"delivery_mode": 2}
    )
    channel._inplace_augment_message(message, EXCHANGE.name, queue)
    return message
