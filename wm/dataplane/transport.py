"""kombu's Redis transport, hardened against input it cannot parse and against a restart of
Redis under load.

Anything that can write to a Redis list can put bytes on a WorkManager queue. kombu decodes
every item it pops as a JSON kombu message, and an item that is not one ended the node
("Unrecoverable error: JSONDecodeError") after the item was already popped: the node died
and the bytes were lost. Here such an item is handed on as a message of content type
``application/octet-stream`` carrying the bytes, which the node's consumer refuses to decode
and parks as a dead letter (``wm.dataplane.consumer.Consumer``).

When Redis restarts, Celery closes the broker connection (which detaches it from its
transport) while channels still restore unacknowledged messages or delete queues on it;
kombu then asks the detached connection for its host and fails with ``AttributeError:
'NoneType' object has no attribute 'hostname'`` (kombu issues #582 and #970), an error no
caller expects, which ended the node. Here that is the connection error it really is, which
kombu's close path ignores; the messages stay unacknowledged in Redis and come back after
WM_VISIBILITY_TIMEOUT_S (or through the pending-ledger sweep).
"""

from __future__ import annotations

import json
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

from wm.dataplane.queues import EXCHANGE

#: Content type of an item that was not a kombu message: its bytes, undecoded.
RAW_CONTENT_TYPE = "application/octet-stream"
#: Keys every kombu message has; an item without them is raw input.
_MESSAGE_KEYS = frozenset({"body", "headers", "properties"})


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            raise redis.exceptions.ConnectionError(
                "the broker connection is closed; unacknowledged messages stay in Redis"
            )
        return super()._connparams(asynchronous=asynchronous)

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
