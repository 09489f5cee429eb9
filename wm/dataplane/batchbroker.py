"""The broker's side of a batched delivery (``wm.dataplane.batching``): more messages of the
worker queue a delivery came from, taken in one script, and their acknowledgements.

A pool process takes them itself, with the node's transport scripts' rule: each message is
recorded as unacknowledged and held in the script that takes it (:data:`~wm.dataplane.
liveness.HOLD`), so no kill between the two loses it. Its holder is not the node but the
pool process (a name of its own, with a liveness record of its own renewed while a batch
runs): a pool process that dies, or whose node is killed, stops renewing, and any live node
puts the messages back when the record lapses (``liveness.restore_dead``); a node that
lives on would otherwise hold them for ever. Only on a Redis broker (kombu's transport).
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from wm.config import Settings
from wm.dataplane import liveness
from wm.dataplane.app import redis_broker
from wm.dataplane.liveness import HOLD, HOLDERS_KEY, held_key

# KEYS: the lists of the queue's levels, highest priority first. ARGV: most messages, then
# the H of liveness.HOLD. Returns message, tag, message, tag... An item that is not a kombu
# message goes back where it was, and the take ends: the node's consumer parks it.
_TAKE_MORE = (
    HOLD
    + """
local most, H, taken = tonumber(ARGV[1]), {unpack(ARGV, 2)}, {}
for i = 1, #KEYS do
  while #taken < 2 * most do
    local message = redis.call('RPOP', KEYS[i])
    if not message then break end
    local tag = hold(message, H)
    if not tag then
      redis.call('RPUSH', KEYS[i], message)
      return taken
    end
    taken[#taken + 1] = message
    taken[#taken + 1] = tag
  end
end
return taken
"""
)
# KEYS: unacked, unacked_index, wm.held, the holder's held set. ARGV: the holder, the tags.
# kombu's ack of each, unless another holder has the message now (liveness._ACK's rule).
_ACK_ALL = """
local me = ARGV[1]
for i = 2, #ARGV do
  local tag = ARGV[i]
  local holder = redis.call('HGET', KEYS[3], tag)
  redis.call('SREM', KEYS[4], tag)
  if not holder or holder == me then
    redis.call('ZREM', KEYS[2], tag)
    redis.call('HDEL', KEYS[1], tag)
    redis.call('HDEL', KEYS[3], tag)
  end
end
"""


@dataclass(frozen=True)
class Taken:
    """A message taken for a batch: its headers, properties and decoded body (None: it
    cannot be decoded), and its delivery tag."""

    headers: dict[str, Any]
    properties: dict[str, Any]
    body: Any
    tag: str

    @property
    def delivery_info(self) -> dict[str, Any]:
        return dict(self.properties.get("delivery_info") or {})


class BatchBroker:
    """This pool process's taker of batch messages (one per process, after the fork)."""

    def __init__(self, settings: Settings, app: Any) -> None:
        self.settings = settings
        self.connection = app.connection_for_write()
        self.channel: Any = self.connection.default_channel
        self.holder = f"batch.{os.getpid()}.{uuid.uuid4().hex[:12]}"
        self._active = 0
        self._lock = threading.Lock()
        self._beaten = 0.0  # monotonic time of the last renewal
        self._thread: threading.Thread | None = None

    @staticmethod
    def usable(settings: Settings) -> bool:
        return redis_broker(settings.broker_url)

    def usable_channel(self) -> bool:
        """kombu's key prefix leaves holders unrecorded: no batch there."""
        return not self.channel.global_keyprefix and hasattr(self.channel, "_levels")

    def take(self, queue: str, most: int) -> list[Taken]:
        """Up to ``most`` more messages of ``queue``, oldest first, held by this process."""
        self._renew_if_due()
        channel = self.channel
        keys = channel._levels(queue)
        h = [
            self.holder,
            time.time(),
            channel.unacked_key,
            channel.unacked_index_key,
            HOLDERS_KEY,
            held_key(self.holder),
        ]
        with channel.conn_or_acquire() as client:
            reply = channel._script(_TAKE_MORE)(keys=keys, args=[most, *h], client=client)
        return [_read(channel, raw, tag) for raw, tag in zip(reply[::2], reply[1::2], strict=True)]

    def ack(self, tags: list[str]) -> None:
        """Acknowledge ``tags`` (messages this process holds), in one script."""
        if not tags:
            return
        channel = self.channel
        keys = [channel.unacked_key, channel.unacked_index_key, HOLDERS_KEY]
        keys.append(held_key(self.holder))
        with channel.conn_or_acquire() as client:
            channel._script(_ACK_ALL)(keys=keys, args=[self.holder, *tags], client=client)

    def restore(self, tag: str) -> None:
        """Put the message back at the end of its queue (a reject with requeue), unless
        another holder has it now."""
        channel, holder = self.channel, self.holder

        def restore(pipe: Any) -> None:
            raw = pipe.hget(channel.unacked_key, tag)
            if bytes_to_str(pipe.hget(HOLDERS_KEY, tag) or b"") != holder:
                return
            pipe.multi()
            pipe.zrem(channel.unacked_index_key, tag).hdel(channel.unacked_key, tag)
            pipe.hdel(HOLDERS_KEY, tag).srem(held_key(holder), tag)
            if raw:
                message, exchange, routing_key = loads(bytes_to_str(raw))
                channel._do_restore_message(message, exchange, routing_key, pipe, True)

        with channel.conn_or_acquire() as client:
            client.transaction(restore, channel.unacked_key, HOLDERS_KEY)

    def __enter__(self) -> BatchBroker:
        """A batch runs: the holder's record is renewed until it ends."""
        with self._lock:
            self._active += 1
        self._start()
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        with self._lock:
            self._active -= 1
        if kind is not None:
            self.rotate()

    def rotate(self) -> None:
        """Hold under a new name from now on: what a batch that failed midway left held
        goes back when the old name's record lapses (nobody renews it)."""
        self.holder = f"batch.{os.getpid()}.{uuid.uuid4().hex[:12]}"
        self._beaten = 0.0

    def _renew_if_due(self) -> None:
        """Renew now unless a renewal is recent: the record outlives the take."""
        if time.monotonic() - self._beaten > self.settings.node_heartbeat_s / 2:
            self._renew()

    def _renew(self) -> None:
        liveness.beat(self.channel, self.holder, self.settings.node_dead_after_s)
        self._beaten = time.monotonic()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="wm-batch-holder", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.settings.node_heartbeat_s)
            if self._active:
                try:
                    self._renew()
                except Exception:  # Redis away: the next beat tries again
                    continue


def _read(channel: Any, raw: bytes, tag: bytes) -> Taken:
    """A taken message as a task run reads it. JSON bodies in base64 (what Celery sends
    through kombu's Redis transport) are read with the standard library's decoder, several
    times faster than kombu's, whose object hook only matters for its tagged types."""
    payload = _json(bytes_to_str(raw))
    try:
        body = _body(channel, payload)
    except Exception:  # the task reads it as a message of another shape, and parks it
        body = None
    return Taken(payload.get("headers") or {}, payload["properties"], body, bytes_to_str(tag))


def _json(text: str) -> Any:
    return loads(text) if "__type__" in text else json.loads(text)


def _body(channel: Any, payload: dict[str, Any]) -> Any:
    properties = payload["properties"]
    if payload.get("content-type") == "application/json" and (
        properties.get("body_encoding") == "base64"
    ):
        return _json(base64.b64decode(payload["body"]).decode())
    return channel.Message(payload, channel=channel).decode()


#: Each thread's broker: a threads pool's threads run batches at once, and a batch that
#: fails renames its holder (:meth:`BatchBroker.rotate`), which must not rename another's.
_local = threading.local()


def batch_broker(settings: Settings, app: Any) -> BatchBroker | None:
    """This thread's :class:`BatchBroker`; None where batches cannot be taken."""
    if not BatchBroker.usable(settings):
        return None
    broker: BatchBroker | None = getattr(_local, "broker", None)
    if broker is None or getattr(_local, "pid", 0) != os.getpid():
        broker = _local.broker = BatchBroker(settings, app)
        _local.pid = os.getpid()
    return broker if broker.usable_channel() else None
