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
kombu's close path ignores; the messages stay unacknowledged in Redis, held by the node,
and come back when its liveness expires (``wm.dataplane.liveness``).

The scripts that take a worker queue's message also record it as unacknowledged and held by
this node (:data:`wm.dataplane.liveness.HOLD`), so no kill between the two loses it.

kombu keeps one list per queue and priority level (``WM_PRIORITY_STEPS``; kombu's default
0,3,6,9 makes every BRPOP name each queue four times). A node reads only its levels, so the
lists of other levels, filled under an earlier setting or by a publisher that still has
one, are moved into the lists it reads (:meth:`Channel.merge_unread_levels`), and deleting
or purging a queue takes every level's list.

kombu's BRPOP names every list of every queue a node consumes, so a node serving 1,000
workers sends, and Redis scans, 1,000 keys per message. With a ready key (``WM_READY_LIST``)
a node instead waits on one list, the *ready list*, naming the worker queues that hold
messages, each once, in the order they became ready. A publish that makes a queue non-empty
lists it (one script: the push and, if the push made the list's length 1, the name). An
idle node waits in BRPOP on the ready list and takes the named queue's oldest message; while
there is a backlog it sends a script instead, which pops names and takes their queues'
messages together: as many messages as the prefetch window has room for (up to
:data:`TAKE_MOST`), each taken as a take of its own would take it, so one round trip serves
several deliveries. A node's task channel takes such a backlog again only once its window
has room for several messages (:func:`refill_at`), not at each acknowledgement; a take
that finds fewer messages than it asked for ends the backlog, and the node waits in BRPOP
again. A queue that still holds messages goes back to the end of the
ready list (round robin over busy queues); an empty one is not listed. A node's cost per
message does not depend on how many queues it consumes. A queue whose name a node popped and
did not take from (the node died in between; or it does not consume the queue, a stopped
worker's, and put the message back) stays unlisted until a node starts consuming it or
:meth:`Channel.repair_ready` lists it, which the maintaining node runs every reconcile
period; that also finds messages pushed by a client without this transport. A name listed
twice costs one take that finds nothing. Other queues (``wm.default``, plain subscriptions)
are consumed as kombu does. The ready list's scripts are in ``wm.dataplane.readyscripts``,
a batched publish in ``wm.dataplane.readybatch``.

With ``wait_replicas`` (WM_BROKER_WAIT_REPLICAS) every publish, single or batched, is
followed by WAIT on the connection that pushed it and fails unless enough replicas have it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from time import monotonic
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import Empty
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from wm.dataplane import fairshare
from wm.dataplane.liveness import QoS, hold_args
from wm.dataplane.placement import INBOX, MEMBERS, my_inbox, place_args
from wm.dataplane.queues import EXCHANGE, is_worker_queue
from wm.dataplane.readybatch import ReadyBatch
from wm.dataplane.readyscripts import (
    ARM,
    MERGE,
    MERGE_BATCH,
    MERGE_QUEUES_PER_CALL,
    PUT,
    REPAIR,
    REPAIR_QUEUES_PER_CALL,
    TAKE,
    TAKE_NEXT,
)
from wm.dataplane.takenfacts import facts_args, hand_over
from wm.errors import BrokerUnavailable
from wm.state.connection import refuse_cluster_broker
from wm.state.packing import connection_options

logger = logging.getLogger(__name__)

#: Content type of an item that was not a kombu message: its bytes, undecoded.
RAW_CONTENT_TYPE = "application/octet-stream"
#: Keys every kombu message has; an item without them is raw input.
_MESSAGE_KEYS = frozenset({"body", "headers", "properties"})
_DELIVERY_INFO_KEYS = frozenset({"exchange", "routing_key"})
#: Most messages one take without blocking takes (as many as the prefetch window has room
#: for, up to this): one round trip to Redis for several messages while there is a backlog.
TAKE_MOST = 8
#: Priorities a kombu message may carry: kombu clamps them to 0..9 (``max_priority``).
PRIORITIES = range(10)


def refill_at(window: int, processes: int) -> int:
    """The room a prefetch ``window`` of a node with ``processes`` pool processes must have
    before a take of a backlog: half of what the node holds beyond one message per process,
    up to half of :data:`TAKE_MOST` (at least one). One take then serves several deliveries,
    where a take at each acknowledgement cost a script, a round trip and a turn of the loop
    per message; meanwhile each process still has its delivery and the node holds half of
    the rest."""
    return max(1, min(window - processes, TAKE_MOST) // 2)


class PacedQoS(QoS):
    """kombu's acknowledgement emulation (with holders, ``wm.dataplane.liveness``), which
    lets the channel take again only once its prefetch window has the room
    :meth:`Channel.refill_room` asks for."""

    def can_consume(self) -> bool:
        room = self.can_consume_max_estimate()  # None: no prefetch limit
        return room is None or bool(room >= self.channel.refill_room(self.prefetch_count))


class Channel(kombu_redis.Channel):
    QoS = PacedQoS
    from_transport_options = (  # type: ignore[assignment]  # kombu types it by its length
        *kombu_redis.Channel.from_transport_options,
        "ready_key",
        "wait_replicas",
        "wait_timeout_ms",
    )
    #: The ready list (empty: kombu's BRPOP over every queue); see the module's docstring.
    ready_key = ""
    #: Replicas that must acknowledge each publish (Redis WAIT; 0: none) within
    #: ``wait_timeout_ms``: WM_BROKER_WAIT_REPLICAS and WM_REDIS_WAIT_TIMEOUT_MS.
    wait_replicas = 0
    wait_timeout_ms = 500
    #: The node's pool processes (``wm.dataplane.node.pace_takes``); 0, not a node's task
    #: channel: a take whenever the prefetch window has room.
    processes = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Queues consumed that are not worker queues, and how many worker queues are, from
        #: active_queues (None: not sorted out since the consumers last changed).
        self._split: tuple[list[str], int] | None = None
        self._active: frozenset[str] | None = None  # active_queues, until the next change
        #: Queues consumed inside ``adding_together``, armed on the way out (None: outside).
        self._adding: list[str] | None = None
        self._others_first = False
        self._last_tenant = ""  # the tenant of the worker queue taken from last
        self._backlog = False  # the last take saw more listed: take without blocking
        self._sent = "BRPOP"  # the command in flight on the polling connection
        self._asked = 0  # the most messages the take in flight without blocking takes
        self._scripts: dict[str, Any] = {}
        self._bound: set[str] = set()  # queues bound to EXCHANGE under their own name
        self._commands: Any = None  # the client conn_or_acquire lends
        #: The delivery tag of the message being delivered if its take recorded it as held.
        self.recorded: str | None = None
        super().__init__(*args, **kwargs)
        broker = self.connection.client
        refuse_cluster_broker(self.client, f"at {broker.hostname}:{broker.port}")

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> Any:
        """WorkManager binds each subscription queue to its exchange under the queue's own
        name (``subscription_queue``). kombu reads the exchange's whole binding table (one
        member per queue of the deployment) from Redis for every message published there;
        here a binding this channel made or found is remembered, and only a routing key not
        seen yet reads the table. A queue deleted by another process stays known here: the
        routing table no longer names it, so no publish goes there."""
        if exchange == EXCHANGE.name and routing_key in self._bound:
            return [routing_key]
        found = super()._lookup(exchange, routing_key, default)
        if exchange == EXCHANGE.name and found == [routing_key]:
            self._bound.add(routing_key)
        return found

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        super()._queue_bind(exchange, routing_key, pattern, queue)
        if exchange == EXCHANGE.name and routing_key == queue:
            self._bound.add(queue)

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """kombu builds a new redis-py client (and its table of reply callbacks) for every
        command it sends, a publish's LPUSH included; here one is kept per channel and
        pool (a client only borrows a pooled connection for each command)."""
        if client:
            yield client
            return
        pool = self.pool
        if self._commands is None or self._commands.connection_pool is not pool:
            self._commands = self._create_client()
        yield self._commands

    def close(self) -> None:
        qos = self._qos
        if isinstance(qos, QoS):  # acknowledgements sent: have them confirmed
            qos.acks.close()
        super().close()

    def _ready_for(self, queue: str) -> bool:
        """Whether messages of ``queue`` go through the ready list."""
        return bool(self.ready_key) and not self.global_keyprefix and is_worker_queue(queue)

    def _script(self, source: str) -> Any:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self._create_client().register_script(source)
        return script

    def _levels(self, queue: str) -> list[str]:
        """The lists of ``queue``'s levels read, highest priority first."""
        return [self._q_for_pri(queue, pri) for pri in self.priority_steps]

    @property
    def active_queues(self) -> frozenset[str]:
        """kombu's (the queues consumed, fanout ones left out), kept from one change of the
        consumers to the next: kombu builds it anew on every read, several per message, and
        a node consuming 1,000 queues spent a third of its main process doing so."""
        found = self._active
        if found is None:
            fanout = self.active_fanout_queues
            found = self._active = frozenset(q for q in self._active_queues if q not in fanout)
        return found

    def _update_queue_cycle(self) -> None:
        # kombu calls it after every consume and cancel, each change of the set above: a
        # node adding 1,000 queues sorts them out once, at its next read
        self._active = self._split = None
        super()._update_queue_cycle()

    def _sorted_out(self) -> tuple[list[str], int]:
        """The queues consumed that are not worker queues, and how many worker queues are."""
        split = self._split
        if split is None:
            active = self.active_queues
            others = [queue for queue in active if not self._ready_for(queue)]
            split = self._split = (others, len(active) - len(others))
        return split

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        consumer_tag = super().basic_consume(queue, *args, **kwargs)
        # messages that waited while nobody consumed the queue
        if self._adding is None:
            self.arm([queue])
        else:
            self._adding.append(queue)
        return consumer_tag

    @contextmanager
    def adding_together(self) -> Iterator[None]:
        """Queues declared and consumed inside cost one round trip each (their binding), not
        four: their messages waiting are listed together on the way out, in one round
        trip, and a declare does not count the queue's messages (a node starting with
        1,000 queues spent a second on them; nothing inside reads the count)."""
        if self._adding is not None:  # nested: the outer one arms
            yield
            return
        self._adding = []
        try:
            yield
        finally:
            queues, self._adding = self._adding, None
            self.arm(queues)

    def _size(self, queue: str) -> int:
        return 0 if self._adding is not None else int(super()._size(queue))

    def arm(self, queues: Iterable[str]) -> None:
        """List each of ``queues`` that holds messages and is not listed."""
        queues = [queue for queue in queues if self._ready_for(queue)]
        if not queues:
            return
        script = self._script(ARM)
        with self.conn_or_acquire() as client:
            if len(queues) == 1:  # a pipeline would ask SCRIPT EXISTS first: a round trip more
                (queue,) = queues
                script(keys=[self.ready_key, *self._levels(queue)], args=[queue], client=client)
                return
            with client.pipeline(transaction=False) as pipe:
                for queue in queues:
                    script(keys=[self.ready_key, *self._levels(queue)], args=[queue], client=pipe)
                pipe.execute()

    def repair_ready(self, queues: Iterable[str]) -> int:
        """List every one of ``queues`` that holds messages but is not in the ready list (nor
        in a placement member's inbox); returns how many. Costs Redis one LLEN per queue and
        one read of the ready list and of each inbox."""
        queues = sorted(queue for queue in set(queues) if self._ready_for(queue))
        suffixes = self._levels("")
        script = self._script(REPAIR)
        fixed = 0
        with self.conn_or_acquire() as client:
            for start in range(0, len(queues), REPAIR_QUEUES_PER_CALL):
                chunk = queues[start : start + REPAIR_QUEUES_PER_CALL]
                args = [MEMBERS, INBOX, len(suffixes), *suffixes, *chunk]
                fixed += int(script(keys=[self.ready_key], args=args, client=client))
        return fixed

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        if self.wait_replicas and "_publish_batch" not in kwargs:
            self._put_waited(queue, message)
            return
        if not self._ready_for(queue):
            super()._put(queue, message, **kwargs)
            return
        pri = self._get_message_priority(message, reverse=False)
        keys = [self._q_for_pri(queue, pri), self.ready_key]
        batch = kwargs.pop("_publish_batch", None)
        if batch is not None:
            batch.put(keys, queue, dumps(message))
            return
        with self.conn_or_acquire() as client:
            self._script(PUT)(keys=keys, args=[queue, dumps(message)], client=client)

    def _put_waited(self, queue: str, message: Any) -> None:
        """A publish that returns once ``wait_replicas`` replicas have it: the push and WAIT
        in one pipeline, so on one connection (WAIT counts its own connection's writes)."""
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        with self.conn_or_acquire() as client, client.pipeline(transaction=False) as pipe:
            if self._ready_for(queue):
                pipe.eval(PUT, 2, key, self.ready_key, queue, dumps(message))
            else:
                pipe.lpush(key, dumps(message))
            self.queue_wait(pipe)
            *_, acknowledged = pipe.execute()
        self.check_wait(acknowledged, f"a message published to {queue}")

    def queue_wait(self, pipe: Any) -> None:
        """Queue WAIT for ``wait_replicas`` behind the writes queued in ``pipe``."""
        pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)

    def check_wait(self, acknowledged: Any, what: str) -> None:
        """Raise :class:`BrokerUnavailable` when fewer replicas than ``wait_replicas``
        acknowledged ``what`` (the reply of :meth:`queue_wait`'s WAIT)."""
        if int(acknowledged) < self.wait_replicas:
            raise BrokerUnavailable(
                f"{what} reached {acknowledged} replica(s) of the broker within "
                f"WM_REDIS_WAIT_TIMEOUT_MS={self.wait_timeout_ms}, not "
                f"WM_BROKER_WAIT_REPLICAS={self.wait_replicas}: it is on the broker's primary "
                "but would not survive its loss (publishing again is safe: deliveries are "
                "idempotent by event id); start the missing replicas or lower the setting"
            )

    def create_publish_batch(self, max_size: int) -> ReadyBatch:
        return ReadyBatch(self, max_size)

    def _do_restore_message(
        self, payload: Any, exchange: str, routing_key: str, pipe: Any, leftmost: bool = False
    ) -> None:
        super()._do_restore_message(payload, exchange, routing_key, pipe, leftmost)
        try:
            queues = [q for q in self._lookup(exchange, routing_key) if self._ready_for(q)]
        except Exception:  # kombu logged it: the message was not restored either
            return
        for queue in queues:  # in the restore's transaction, after the push
            keys = [self.ready_key, *self._levels(queue)]
            pipe.eval(ARM, len(keys), *keys, queue)

    def _brpop_start(self, timeout: int | None = None) -> None:
        plain, workers = self._sorted_out()
        if not workers:
            super()._brpop_start(timeout)
            return
        others = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in plain]
        # Each pops from the first source holding messages: alternate, so neither starves.
        self._others_first = not self._others_first
        if self._backlog:
            self._sent = "EVAL"
            suffixes = self._levels("")
            command = ["EVAL", TAKE_NEXT, 1 + len(others), self.ready_key, *others]
            first = f"{int(self._others_first)}:{fairshare.avoided(self._last_tenant)}"
            crowded = int(fairshare.crowded())
            self._asked = self._room()
            command += [first, self._asked, crowded, len(suffixes), *suffixes]
            command += [*hold_args(self), *facts_args()]
            command += place_args(self)
        else:
            self._sent = "BRPOP"
            ready = [self.ready_key, *filter(None, [my_inbox(self)])]
            keys = [*others, *ready] if self._others_first else [*ready, *others]
            timeout = self.brpop_timeout if timeout is None else timeout
            command = ["BRPOP", *keys, timeout or 0]
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()  # type: ignore[assignment]  # kombu: None or a time
        self.client.connection.send_command(*command)

    def _brpop_read(self, **options: Any) -> bool:
        sent, self._sent = self._sent, "BRPOP"
        try:
            try:
                reply = self.client.parse_response(self.client.connection, sent, **options)
            except self.connection_errors:
                # kombu's own read does the same: the next iteration reconnects.
                self.client.connection.disconnect()
                raise
            if sent == "EVAL":
                return self._took_next(reply)
            if not reply:
                raise Empty()
            dest, item = bytes_to_str(reply[0]), reply[1]
            if dest == self.ready_key or dest == my_inbox(self):
                return self._take(bytes_to_str(item), dest != self.ready_key)
            queue = dest.rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            self._deliver_item(item, queue)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # kombu: a connection or None
            flush = getattr(self, "_flush_brpop_reauth", None)  # kombu >= 5.7
            if flush is not None:
                flush()

    def _take(self, queue: str, mine: bool = False) -> bool:
        """Take the oldest message of ``queue``, whose name BRPOP popped off the ready list
        (``mine``: off this node's inbox)."""
        if queue not in self.active_queues:
            # A stopped worker's queue, or one this node does not consume yet: it stays
            # unlisted until a node consumes it (or the repair lists it).
            raise Empty()
        keys = [self.ready_key, *self._levels(queue)]
        with self.conn_or_acquire() as client:
            args = [queue, int(mine), *hold_args(self), *facts_args(), *place_args(self)]
            reply = self._script(TAKE)(keys=keys, args=args, client=client)
        if not reply:
            raise Empty()
        item, listed, tag, facts = (*reply, None, None)[:4]
        self._backlog = int(listed) > 0
        self._last_tenant = fairshare.queue_tenant(queue)
        self._deliver_item(item, queue, tag, facts)
        return True

    def refill_room(self, window: int) -> int:
        """The room the prefetch ``window`` must have before the next take:
        :func:`refill_at` while a backlog is taken without blocking, else one (an idle
        queue's message is taken at once)."""
        if not (self._backlog and self.processes):
            return 1
        return refill_at(window, self.processes)

    def _room(self) -> int:
        """The most messages one take without blocking takes: what the prefetch window has
        room for, up to :data:`TAKE_MOST` (at least one)."""
        room = self.qos.can_consume_max_estimate()
        return max(1, min(room or 1, TAKE_MOST))

    def _took_next(self, reply: Any) -> bool:
        """Deliver what a take without blocking returned, in order; none: wait in BRPOP
        again. What was not this node's to take (a stopped worker's queue) goes back. A
        message whose delivery raises does not keep the others from theirs: the first error
        is raised once each was delivered, as a take of one message would raise it."""
        self._backlog = len(reply or ()) >= self._asked  # fewer: nothing was left to take
        if not reply:
            raise Empty()
        back: list[tuple[str, bytes, str, bytes | None]] = []
        errors = []
        for taken in reply:
            try:
                self._took(taken, back)
            except Exception as exc:
                errors.append(exc)
        if back:
            self._put_back(back)
        if errors:
            raise errors[0]
        if len(back) == len(reply):
            raise Empty()
        return True

    def _took(self, taken: Any, back: list[tuple[str, bytes, str, bytes | None]]) -> None:
        """Deliver one message of a take without blocking, or add it to ``back`` when it is
        not this node's to take."""
        queue, item, key = (bytes_to_str(taken[0]), taken[1], bytes_to_str(taken[2]))
        tag, facts = (*taken[3:], None, None)[:2]
        if not self._ready_for(queue):  # one of the other queues
            queue = queue.rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
        elif queue not in self.active_queues:
            back.append((queue, item, key, tag))
            return
        else:
            self._last_tenant = fairshare.queue_tenant(queue)
        self._deliver_item(item, queue, tag, facts)

    def _put_back(self, taken: list[tuple[str, bytes, str, bytes | None]]) -> None:
        """Messages of queues this node does not consume (a stopped worker's), taken oldest
        first: back where they were, in their order, their queues unlisted, in the shared
        list and in this node's inbox (the take may have listed them there again: left in,
        the next take would pop them again, and again)."""
        inbox = my_inbox(self)
        with self.conn_or_acquire() as client, client.pipeline() as pipe:
            for queue, item, key, tag in reversed(taken):  # the oldest goes back last
                pipe.rpush(key, item).lrem(self.ready_key, 0, queue)
                if inbox:
                    pipe.lrem(inbox, 0, queue)
                if tag:
                    self.qos._remove_from_indices(bytes_to_str(tag), pipe)
            pipe.execute()

    def _deliver_item(
        self, item: bytes, queue: str, tag: bytes | None = None, facts: Any = None
    ) -> None:
        """Deliver a popped list item; one that is no kombu message as raw bytes. ``tag``:
        the take recorded the message as held (kombu's QoS.append need not); ``facts``:
        what the take read for its delivery (``wm.dataplane.takenfacts``)."""
        try:
            message, taken = loads(bytes_to_str(item)), True
            hand_over(message, facts)
        except json.JSONDecodeError as exc:
            message, taken = raw_message(self, exc.doc.encode(), queue), False
        if tag and not (taken and is_kombu_message(self, message)):
            # Redis's JSON parser took it, kombu cannot: the raw message gets a tag of its own
            self.qos._remove_from_indices(bytes_to_str(tag)).execute()
            tag = None
        self.recorded = bytes_to_str(tag) if tag else None
        try:
            self.connection._deliver(message, queue)
        except Exception:
            self._unhold(self.recorded)
            raise
        finally:
            self.recorded = None

    def _unhold(self, tag: str | None) -> None:
        """After a delivery raised: a message the take recorded as held that kombu's QoS
        never took goes back to the head of its queue now (left held, a node's heartbeat
        would keep it from every other node until this one stopped)."""
        if tag is None or tag in self.qos._delivered:
            return  # kombu holds it: acknowledged, rejected or restored as any other
        try:
            self.qos.restore_by_tag(tag)  # kombu's restore: where BRPOP pops next
        except Exception:
            logger.exception(
                "message %s could not go back to its queue now: it stays held by this node "
                "until the node stops",
                tag,
            )

    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            raise redis.exceptions.ConnectionError(
                "the broker connection is closed; unacknowledged messages stay in Redis"
            )
        return {**super()._connparams(asynchronous=asynchronous), **connection_options()}

    def unread_levels(self, queue: str) -> list[tuple[str, str]]:
        """(list of a level this channel does not read, list of the level it reads that a
        message of that priority goes to now) for ``queue``, lower levels first."""
        return [
            (f"{queue}{self.sep}{level}", self._q_for_pri(queue, level))
            for level in PRIORITIES
            if level not in self.priority_steps
        ]

    def merge_unread_levels(self, queues: Collection[str]) -> int:
        """Move the messages of levels this channel does not read into the lists it reads;
        returns how many. Each message moves in one atomic RPOPLPUSH: a node that dies
        midway loses or repeats none."""
        pairs = [pair for queue in sorted(set(queues)) for pair in self.unread_levels(queue)]
        step = MERGE_QUEUES_PER_CALL * (len(PRIORITIES) - 1)
        moved = 0
        with self.conn_or_acquire() as client:
            script = client.register_script(MERGE)
            for start in range(0, len(pairs), step):
                keys = [key for pair in pairs[start : start + step] for key in pair]
                count = MERGE_BATCH
                while count == MERGE_BATCH:
                    count = int(script(keys=keys, args=[MERGE_BATCH]))
                    moved += count
        if moved:
            self.arm(queues)
        return moved

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self._bound.discard(queue)
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

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """kombu's registration, whose hook at each turn of the loop adds every socket of
        the transport to the loop again: a failing ``epoll_ctl`` and a Python exception
        caught, per socket and turn, in the node's busiest process. Here a socket whose
        reader is already this transport's is left as it is; kombu registers each new socket
        with the poller itself (``MultiChannelPoller._register``), and a socket removed from
        the loop (a lost connection, a paused poll) has no reader and is added as before."""
        before = set(loop.on_tick)
        super().register_with_event_loop(connection, loop)
        added = [hook for hook in loop.on_tick - before if hook.__name__ == "on_poll_start"]
        if len(added) != 1:  # not the kombu this was written for: leave its hook
            return
        loop.on_tick.discard(added[0])
        cycle: Any = self.cycle  # kombu types it as its base class
        on_readable = self.on_readable

        def on_poll_start() -> None:
            cycle.on_poll_start()
            readers = loop.readers
            for fd in cycle.fds:
                if readers.get(fd) != (on_readable, (fd,)):
                    loop.add_reader(fd, on_readable, fd)

        loop.on_tick.add(on_poll_start)

    def _deliver(self, message: Any, queue: str) -> None:
        """Valid JSON that is not a kombu message is raw input too, and so is one shaped
        like it that kombu cannot take (no delivery tag: kombu's consumer failed on it after
        it was popped, reset, and the message was gone)."""
        if self.channels and not is_kombu_message(self.channels[-1], message):
            message = raw_message(self.channels[-1], json.dumps(message).encode(), queue)
        super()._deliver(message, queue)


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The channel above on the primary a Redis Sentinel names (kombu's ``SentinelChannel``:
    each new connection asks the sentinels, so after a failover it reaches the new one)."""

    from_transport_options = (  # type: ignore[assignment]  # kombu types it by its length
        *Channel.from_transport_options,
        "master_name",
        "min_other_sentinels",
        "sentinel_kwargs",
    )


class SentinelTransport(Transport):
    """WorkManager's Redis transport through Redis Sentinel (``sentinel://`` broker URLs)."""

    default_port = 26379  # type: ignore[assignment]  # kombu types it as None
    Channel = SentinelChannel


def is_kombu_message(channel: Any, message: Any) -> bool:
    """Whether kombu can consume, acknowledge and restore ``message``: its keys, a delivery
    tag and where it was delivered, and a body it can decode."""
    if not (isinstance(message, dict) and message.keys() >= _MESSAGE_KEYS):
        return False
    properties = message["properties"]
    if not isinstance(properties, dict) or not isinstance(message["headers"], dict | None):
        return False
    info = properties.get("delivery_info")
    if not isinstance(properties.get("delivery_tag"), str) or not isinstance(info, dict):
        return False
    if not info.keys() >= _DELIVERY_INFO_KEYS:  # what acknowledging and restoring it read
        return False
    try:
        channel.Message(message, channel=channel)
    except Exception:  # a body it cannot decode, a field of the wrong type
        return False
    return True


def raw_message(channel: Any, raw: bytes, queue: str) -> dict[str, Any]:
    """A kombu message of ``queue`` whose body is ``raw`` (what ``Producer.publish`` of the
    bytes would have pushed)."""
    message: dict[str, Any] = channel.prepare_message(raw, None, RAW_CONTENT_TYPE, "binary", {})
    channel._inplace_augment_message(message, EXCHANGE.name, queue)
    return message
