"""kombu's Redis transport, hardened against input it cannot parse.

Anything that can write to a Redis list can put bytes on a WorkManager queue. kombu decodes
every item it pops as a JSON kombu message, and an item that is not one ended the node
("Unrecoverable error: JSONDecodeError") after the item was already popped: the node died
and the bytes were lost. Here such an item is handed on as a message of content type
``application/octet-stream`` carrying the bytes, which the node's consumer refuses to decode
and parks as a dead letter (``wm.dataplane.node.Consumer``).
"""

from __future__ import annotations

import json
from typing import Any

from kombu.transport import redis as kombu_redis

from wm.dataplane.queues import EXCHANGE

#: Content type of an item that was not a kombu message: its bytes, undecoded.
RAW_CONTENT_TYPE = "application/octet-stream"
#: Keys every kombu message has; an item without them is raw input.
_MESSAGE_KEYS = frozenset({"body", "headers", "properties"})


class Channel(kombu_redis.Channel):
    def _brpop_read(self, **options: Any) -> bool:
        try:
            return bool(super()._brpop_read(**options))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            # kombu rotated the popped queue to the end of its cycle before decoding.
            queue = self._queue_cycle.items[-1]
            raw = exc.doc.encode() if isinstance(exc, json.JSONDecodeError) else exc.object
            self.connection._deliver(raw_message(self, bytes(raw), queue), queue)
            return True


class Transport(kombu_redis.Transport):
    Channel = Channel

    def _deliver(self, message: Any, queue: str) -> None:
        """Valid JSON that is not a kombu message is raw input too."""
        if self.channels and not (isinstance(message, dict) and message.keys() >= _MESSAGE_KEYS):
            message = raw_message(self.channels[-1], json.dumps(message).encode(), queue)
        super()._deliver(message, queue)


def raw_message(channel: Any, raw: bytes, queue: str) -> dict[str, Any]:
    """A kombu message of ``queue`` whose body is ``raw`` (what ``Producer.publish`` of the
    bytes would have pushed)."""
    message: dict[str, Any] = channel.prepare_message(raw, None, RAW_CONTENT_TYPE, "binary", {})
    channel._inplace_augment_message(message, EXCHANGE.name, queue)
    return message
