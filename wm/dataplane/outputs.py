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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kombu.utils.json import dumps

from wm.dataplane.app import broker_errors, redis_broker
from wm.dataplane.bus import Bus, Route
from wm.dataplane.queues import CLOUDEVENT_CONTENT_TYPE, EXCHANGE
from wm.events import CloudEvent, encode, key_of, tenant_of
from wm.names import route_topic
from wm.state.connection import StatePipeline, pooled_client, queue_eval, redis_errors

_MARKER = "wm:published:"
#: Seconds an output's push may wait for the broker's Redis before it fails (and is retried).
BROKER_SOCKET_TIMEOUT_S = 30
# KEYS: marker, queue lists. ARGV: marker ttl s, one kombu message per queue.
_PUSH_ONCE = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 2, #KEYS do redis.call('LPUSH', KEYS[i], ARGV[i]) end
return 1
"""


class OutputPublisher:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.ttl_s = bus.settings.outcome_ttl_s
        self.redis_broker = redis_broker(bus.settings.broker_url)
        self._connection: Any = None
        self._channel: Any = None
        self._push_script: Any = None

    def lookups(self, outputs: list[CloudEvent]) -> Callable[[StatePipeline], None]:
        """Queues the routes lookups of ``outputs`` in a pipeline (drops counted), so
        :meth:`publish` can be given their results instead of asking Redis again."""

        def queue(pipe: StatePipeline) -> None:
            for output in outputs:
                script, count, *rest = Bus.routes_command(output_topic(output), True)
                queue_eval(pipe, script, rest[:count], *rest[count:])

        return queue

    def publish(self, output: CloudEvent, routes: list[Route] | None = None) -> None:
        """Send ``output`` to the topic of its type: to workers (maybe again), to plain
        subscriptions once. ``routes``: the topic's, looked up (and a drop counted) already."""
        topic = output_topic(output)
        if routes is None:
            routes = self.bus.routes(topic, count_drop=True)
        if not routes:
            return
        payload, key = encode(output), key_of(output)
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
    message = channel.prepare_message(
        payload, None, CLOUDEVENT_CONTENT_TYPE, "utf-8", {}, {"delivery_mode": 2}
    )
    channel._inplace_augment_message(message, EXCHANGE.name, queue)
    key = channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False))
    return str(key), str(dumps(message))
