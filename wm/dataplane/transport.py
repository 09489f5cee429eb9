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

kombu keeps one list per queue and priority level (``WM_PRIORITY_STEPS``; kombu's default
0,3,6,9 makes every BRPOP name each queue four times). A node reads only its levels, so the
lists of other levels, filled under an earlier setting or by a publisher that still has
one, are moved into the lists it reads (:meth:`Channel.merge_unread_levels`), and deleting
or purging a queue takes every level's list.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

from wm.dataplane.queues import EXCHANGE

#: Content type of an item that was not a kombu message: its bytes, undecoded.
RAW_CONTENT_TYPE = "application/octet-stream"
#: Keys every kombu message has; an item without them is raw input.
_MESSAGE_KEYS = frozenset({"body", "headers", "properties"})
#: Priorities a kombu message may carry: kombu clamps them to 0..9 (``max_priority``).
PRIORITIES = range(10)
#: Messages one merge script moves at most, so a long list never blocks Redis for long.
MERGE_BATCH = 10_000
#: Queues whose lists one merge script looks at (each with up to nine unread levels).
MERGE_QUEUES_PER_CALL = 100
# KEYS: (list of an unread level, list it goes to) pairs, lower levels first. ARGV: most
# messages to move. RPOPLPUSH takes the oldest message (kombu pops from the right) and puts
# it behind everything waiting in the target: FIFO within a level, lower levels first.
_MERGE = """
local moved, limit = 0, tonumber(ARGV[1])
for i = 1, #KEYS, 2 do
  while moved < limit and redis.call('RPOPLPUSH', KEYS[i], KEYS[i + 1]) do
    moved = moved + 1
  end
end
return moved
"""


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

    def unread_levels(self, queue: str) -> list[tuple[str, str]]:
        """(list of a level this channel does not read, list of the level it reads that a
        message of that priority goes to now) for ``queue``, lower levels first."""
        return [
            (f"{queue}{self.sep}{level}", self._q_for_pri(queue, level))
            for level in PRIORITIES
            if level not in self.priority_steps
        ]

    def merge_unread_levels(self, queues: Iterable[str]) -> int:
        """Move the messages of levels this channel does not read into the lists it reads;
        returns how many. Each message moves in one atomic RPOPLPUSH: a node that dies
        midway loses or repeats none."""
        pairs = [pair for queue in sorted(set(queues)) for pair in self.unread_levels(queue)]
        step = MERGE_QUEUES_PER_CALL * (len(PRIORITIES) - 1)
        moved = 0
        with self.conn_or_acquire() as client:
            script = client.register_script(_MERGE)
            for start in range(0, len(pairs), step):
                keys = [key for pair in pairs[start : start + step] for key in pair]
                count = MERGE_BATCH
                while count == MERGE_BATCH:
                    count = int(script(keys=keys, args=[MERGE_BATCH]))
                    moved += count
        return moved

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        super()._delete(queue, *args, **kwargs)
        unread = [key for key, _ in self.unread_levels(queue)]
        if unread:
            with self.conn_or_acquire(client=kwargs.get("client")) as client:
                client.delete(*unread)

    def _purge(self, queue: str) -> int:
        purged = int(super()._purge(queue))
        with self.conn_or_acquire() as client, client.pipeline() as pipe:
            for unread, _ in self.unread_levels(queue):
                pipe.llen(unread).delete(unread)
            return purged + int(sum(pipe.execute()[::2]))


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
