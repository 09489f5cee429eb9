"""Which node holds which unacknowledged message on a Redis broker, and who gives back the
messages of a node that died.

kombu's Redis transport keeps a message a node took but has not acknowledged in the hash
``unacked`` (delivery tag → message) and its time in the sorted set ``unacked_index``; any
node puts back what waited there longer than WM_VISIBILITY_TIMEOUT_S. Nothing says which node
holds it, so the timeout must outlast the slowest delivery (an hour by default), and a killed
node's messages waited that long. Here a node records itself as the holder of each message
it takes, in the same script that takes it (``wm.dataplane.transport``) or in kombu's own
transaction, and keeps a liveness record that expires WM_NODE_DEAD_AFTER_S after its event
loop last turned (the loop that hands its messages to the pool: a node whose loop is wedged
holds messages it will not run, so it counts as dead though its heartbeat thread lives).
Every WM_NODE_HEARTBEAT_S each node

- renews its record and refreshes the time of each message it holds, so kombu's visibility
  timeout never puts back a delivery that is still running, however long it runs; and
- claims the messages of every node whose record expired and puts them back in their queues
  (kombu's restore, which lists the queue in the ready list again).

Keys, in the broker's database, beside kombu's: ``wm.nodes`` (the set of nodes that may hold
messages), ``wm.node.<node>`` (a node's liveness record), ``wm.node.<node>.held`` (the
delivery tags it holds) and ``wm.held`` (delivery tag → its holder). A node is one process
lifetime: a restarted node is another one, so a node's record never hides its earlier life.

A claim is one script: the messages of a dead node move to the claimer's name, so two
nodes claiming at once share nothing, and a claimer that dies midway leaves the rest held
by itself, for the next one. A delivery tag comes back with its message: when the holder
of record is another live node (it took the message again), a late acknowledgement or
restore of the earlier holder (a node that stalled past its expiry and came back) leaves
the message alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from wm.config import Settings
from wm.errors import ConfigurationError

logger = logging.getLogger(__name__)

#: The set of nodes that may hold messages.
NODES_KEY = "wm.nodes"
#: Delivery tag → the node that holds the message.
HOLDERS_KEY = "wm.held"
#: A node's liveness record is ``<prefix><node>``, the tags it holds ``<prefix><node>.held``.
NODE_PREFIX = "wm.node."
#: Fewest heartbeats a node may miss before it counts as dead.
MIN_BEATS_MISSED = 2

# The holding of a message just popped, for the take scripts: KEYS of those scripts do not
# name it. H: {this node ('' when not a node), now, unacked, unacked_index, wm.held, the
# node's held set}. Records what kombu's QoS.append records, and the holder; returns the
# delivery tag and the message decoded, or false for an item that is not a kombu message
# (the node parks it).
HOLD = """
local function hold(message, H)
  if H[1] == '' then return false end
  local ok, m = pcall(cjson.decode, message)
  if not ok or type(m) ~= 'table' or m.body == nil or m.headers == nil then return false end
  local p = m.properties
  if type(p) ~= 'table' or type(p.delivery_tag) ~= 'string' then return false end
  local info = p.delivery_info
  if type(info) ~= 'table' or type(info.exchange) ~= 'string'
      or type(info.routing_key) ~= 'string' then return false end
  local tag = p.delivery_tag
  local entry = '[' .. message .. ',' .. cjson.encode(info.exchange) .. ','
    .. cjson.encode(info.routing_key) .. ']'
  redis.call('ZADD', H[4], H[2], tag)
  redis.call('HSET', H[3], tag, entry)
  redis.call('HSET', H[5], tag, H[1])
  redis.call('SADD', H[6], tag)
  return tag, m
end
"""
# KEYS: wm.nodes, unacked_index, wm.held. ARGV: this node, the record's life (ms), now, the
# prefix of a node's keys. Renews the record, refreshes the time of the messages the node
# holds (and forgets tags it no longer holds). Returns {1 if the record was there, the dead
# nodes}.
_BEAT = """
local me, prefix = ARGV[1], ARGV[4]
local was = redis.call('EXISTS', prefix .. me)
redis.call('SET', prefix .. me, ARGV[3], 'PX', ARGV[2])
redis.call('SADD', KEYS[1], me)
local held = prefix .. me .. '.held'
for _, tag in ipairs(redis.call('SMEMBERS', held)) do
  if redis.call('HGET', KEYS[3], tag) == me and redis.call('ZSCORE', KEYS[2], tag) then
    redis.call('ZADD', KEYS[2], ARGV[3], tag)
  else
    redis.call('SREM', held, tag)
  end
end
local dead = {}
for _, node in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', prefix .. node) == 0 then table.insert(dead, node) end
end
return {was, dead}
"""
# KEYS: wm.nodes, wm.held. ARGV: a dead node, this node, the prefix of a node's keys. Moves
# what the dead node holds to this node; returns the tags.
_CLAIM = """
local dead, me, prefix = ARGV[1], ARGV[2], ARGV[3]
if redis.call('EXISTS', prefix .. dead) == 1 then return {} end
local from, to, claimed = prefix .. dead .. '.held', prefix .. me .. '.held', {}
for _, tag in ipairs(redis.call('SMEMBERS', from)) do
  if redis.call('HGET', KEYS[2], tag) == dead then
    redis.call('HSET', KEYS[2], tag, me)
    redis.call('SADD', to, tag)
    table.insert(claimed, tag)
  end
end
redis.call('DEL', from)
redis.call('SREM', KEYS[1], dead)
return claimed
"""
# KEYS: unacked, unacked_index, wm.held, this node's held set. ARGV: the tag, this node.
# kombu's ack, unless another node holds the message now.
_ACK = """
local holder = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
if holder and holder ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""

#: Acknowledgements sent whose replies are not read yet, most (:class:`Acks`).
MAX_UNREAD_ACKS = 64
#: Seconds a closing channel waits for each acknowledgement's reply.
ACK_CLOSE_WAIT_S = 5.0
#: Connections a closing channel tries to have its acknowledgements confirmed on.
ACK_CLOSE_TRIES = 3
#: No PING before an acknowledgement: its reply would be read as another's.
_UNCHECKED = {"check_health": False}

#: Every channel's acknowledgements in this process, for the heartbeat (:func:`flush_acks`).
_registry: weakref.WeakSet[Acks] = weakref.WeakSet()
_registry_lock = threading.Lock()

#: This process's name as a holder of messages, once it is a node (:func:`hold_as`).
_holder = ""
#: This process's heartbeat, once it is a node.
_beating: list[Heartbeat] = []


def hold_as(holder: str) -> None:
    """Record from now on the messages this process takes as held by ``holder``."""
    global _holder
    _holder = holder


def drain() -> None:
    """A warm shutdown began: the node keeps what it holds while its deliveries end."""
    for heartbeat in _beating:
        heartbeat.drain()


def record_key(node: str) -> str:
    return f"{NODE_PREFIX}{node}"


def live_hostnames(conn: Any) -> set[str] | None:
    """The (Celery) host names of the nodes whose liveness record is current, on the broker
    ``conn`` reaches: one round trip; None when that broker keeps no records (RabbitMQ) or
    they cannot be read as written (a kombu key prefix)."""
    if not isinstance(conn.transport, kombu_redis.Transport):
        return None
    channel = conn.default_channel
    if channel.global_keyprefix:  # the records' own keys are not prefixed (``_BEAT``)
        return None
    client = channel.client
    nodes = sorted(bytes_to_str(node) for node in client.smembers(NODES_KEY))
    pipe = client.pipeline(transaction=False)
    for node in nodes:
        pipe.exists(record_key(node))
    alive = pipe.execute() if nodes else []
    # a node's name is its host name and a dot-less life id (``wm.dataplane.node``)
    return {node.rpartition(".")[0] for node, up in zip(nodes, alive, strict=True) if up}


def held_key(node: str) -> str:
    return f"{NODE_PREFIX}{node}.held"


def hold_args(channel: Any) -> list[Any]:
    """The ``H`` of :data:`HOLD` for ``channel`` now."""
    me = _holder if holds(channel) else ""
    keys = [channel.unacked_key, channel.unacked_index_key, HOLDERS_KEY, held_key(me)]
    return [me, time.time(), *keys]


def holds(channel: Any) -> bool:
    """Whether ``channel`` records holders (a node's; kombu's key prefix leaves it off)."""
    return bool(_holder) and not channel.global_keyprefix


class QoS(kombu_redis.QoS):
    """kombu's acknowledgement emulation, with the holder of each message recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acks = Acks(self.channel)

    def append(self, message: Any, delivery_tag: str) -> None:
        channel = self.channel
        if channel.recorded == delivery_tag:  # the take's script recorded it
            virtual.QoS.append(self, message, delivery_tag)
            return
        if not holds(channel):
            super().append(message, delivery_tag)
            return
        info = message.delivery_info
        entry = dumps([message._raw, info["exchange"], info["routing_key"]])
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()})
            pipe.hset(self.unacked_key, delivery_tag, entry)
            pipe.hset(HOLDERS_KEY, delivery_tag, _holder)
            pipe.sadd(held_key(_holder), delivery_tag).execute()
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        if not holds(self.channel):
            super().ack(delivery_tag)
            return
        keys = [self.unacked_key, self.unacked_index_key, HOLDERS_KEY, held_key(_holder)]
        self.acks.send(keys, [delivery_tag, _holder])
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue or not holds(self.channel):
            super().reject(delivery_tag, requeue)
        else:
            self.ack(delivery_tag)

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        pipe = super()._remove_from_indices(delivery_tag, pipe)
        if not self.channel.global_keyprefix:
            pipe.hdel(HOLDERS_KEY, delivery_tag)
        if holds(self.channel):
            pipe.srem(held_key(_holder), delivery_tag)
        return pipe

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        """kombu's restore, unless another live node holds the message now."""

        def restore_transaction(pipe: Any) -> None:
            raw = pipe.hget(self.unacked_key, tag)
            holder = bytes_to_str(pipe.hget(HOLDERS_KEY, tag) or _holder)
            if holder != _holder and pipe.exists(record_key(holder)):
                return
            pipe.multi()
            self._remove_from_indices(tag, pipe)
            if raw:
                message, exchange, routing_key = loads(bytes_to_str(raw))
                self.channel._do_restore_message(message, exchange, routing_key, pipe, leftmost)

        with self.channel.conn_or_acquire(client) as client:
            client.transaction(restore_transaction, self.unacked_key, HOLDERS_KEY)


class Acks:
    """A channel's acknowledgements, pipelined: each is written to Redis at once, on a
    connection of its own, and its reply read later (before the next one when it has come,
    or when :data:`MAX_UNREAD_ACKS` wait). Redis runs each as it arrives, so none waits
    longer than the write; the node's event loop no longer waits a round trip per message.

    What each acknowledgement was sent with is kept until its reply is read: when the
    connection fails (the write, a read, or Redis closed it) those are written again on a
    new one, so none is lost with a connection. :data:`_ACK` is idempotent: run again for a
    message it acknowledged, it finds nothing to remove. Nothing here raises into Celery: an
    acknowledgement Redis cannot take now waits for the next one, the node's heartbeat
    (:meth:`flush`) or the channel's close; one whose script failed is logged. A lock lets a
    threads pool's threads acknowledge at once; in a prefork node only its event loop takes
    it (the heartbeat only tries, and skips a turn), so it costs under a microsecond and
    adds no wait: as before, the loop waits for replies only when :data:`MAX_UNREAD_ACKS`
    are unread, and connects only when it has no connection."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.connection: Any = None
        #: What each acknowledgement whose reply is unread was sent with, oldest first.
        self.unread: deque[tuple[list[str], list[Any]]] = deque()
        self.lock = threading.Lock()
        self.failing = False  # Redis could not be reached; said once
        with _registry_lock:
            _registry.add(self)

    def send(self, keys: list[str], args: list[Any]) -> None:
        with self.lock:
            self.unread.append((keys, args))
            if self.connection is not None:
                self._try(self._write, keys, args)
            if self.connection is None:
                self._send_unread()

    def flush(self) -> None:
        """Read the replies that came, and write again what a lost connection took: the
        heartbeat calls it, so on an idle node too a lost acknowledgement waits a heartbeat
        at most. It skips a turn rather than keep a sending thread waiting."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            if self.unread and self.connection is not None:
                self._try(self._read, False)
            if self.unread and self.connection is None:
                self._send_unread()
        finally:
            self.lock.release()

    def close(self) -> None:
        """Read every reply (up to :data:`ACK_CLOSE_WAIT_S` each), writing again what a lost
        connection took, then give the connection back."""
        with _registry_lock:
            _registry.discard(self)
        with self.lock:
            for _ in range(ACK_CLOSE_TRIES):
                if self.unread and self.connection is None:
                    self._send_unread()
                if self.unread and self.connection is not None:
                    self._try(self._read, True, ACK_CLOSE_WAIT_S)
            if self.unread:
                logger.warning(
                    "%d acknowledgement(s) unconfirmed as the channel closed: their messages "
                    "stay held by this node and go back when it stops",
                    len(self.unread),
                )
            if self.connection is not None:
                self.channel.pool.release(self.connection)
                self.connection = None

    def _write(self, keys: list[str], args: list[Any]) -> None:
        self.connection.send_command("EVAL", _ACK, len(keys), *keys, *args, **_UNCHECKED)
        self._read(block=len(self.unread) >= MAX_UNREAD_ACKS)

    def _read(self, block: bool, wait_s: float | None = None) -> None:
        """Read the replies that came (``block``: every one, waiting up to ``wait_s`` for
        each when given, for ever when not)."""
        connection = self.connection
        while self.unread and (block or connection.can_read(timeout=0)):
            if wait_s is not None and not connection.can_read(timeout=wait_s):
                raise TimeoutError(f"no reply to an acknowledgement in {wait_s:g}s")
            try:
                connection.read_response()
            except self.channel.ResponseError as exc:  # the script failed; the rest go on
                logger.warning("acknowledgement of %s failed: %s", self.unread[0][1][0], exc)
            self.unread.popleft()

    def _try(self, step: Callable[..., None], *args: Any) -> None:
        """Run ``step``; on any error drop the connection, whose state is then unknown (what
        it did not answer is written again on a new one)."""
        try:
            step(*args)
        except BaseException as exc:
            self._drop()
            if not isinstance(exc, Exception):
                raise  # a shutdown: what is unread waits for the close
            logger.info("acknowledgement connection lost (%s): writing the unread again", exc)

    def _send_unread(self) -> None:
        """Write every unread acknowledgement on a new connection, in one write."""
        try:
            self.connection = self.channel.pool.get_connection()
            commands = [("EVAL", _ACK, len(keys), *keys, *args) for keys, args in self.unread]
            self.connection.send_packed_command(
                self.connection.pack_commands(commands), **_UNCHECKED
            )
        except Exception as exc:
            self._drop()
            if not self.failing:
                logger.warning(
                    "%d acknowledgement(s) wait for Redis (%s): sent with the next one, at "
                    "the next heartbeat or when the channel closes",
                    len(self.unread),
                    exc,
                )
            self.failing = True
            return
        self.failing = False

    def _drop(self) -> None:
        if self.connection is not None:
            with contextlib.suppress(Exception):
                self.connection.disconnect()
                self.channel.pool.release(self.connection)
        self.connection = None


def _forget_acks() -> None:
    """A forked process flushes no parent's channel, and its lock may have been taken."""
    global _registry, _registry_lock
    _registry, _registry_lock = weakref.WeakSet(), threading.Lock()


os.register_at_fork(after_in_child=_forget_acks)


def flush_acks() -> None:
    """:meth:`Acks.flush` every channel's acknowledgements in this process."""
    with _registry_lock:
        every = list(_registry)
    for acks in every:
        acks.flush()


def check_settings(settings: Settings) -> None:
    """Refuse a heartbeat that could not keep a live node alive."""
    beat, dead = settings.node_heartbeat_s, settings.node_dead_after_s
    if beat <= 0 or dead < MIN_BEATS_MISSED * beat:
        raise ConfigurationError(
            f"WM_NODE_DEAD_AFTER_S={dead:g} must be at least {MIN_BEATS_MISSED} × "
            f"WM_NODE_HEARTBEAT_S={beat:g} (and the heartbeat above 0): a node would count as "
            "dead between two heartbeats and its deliveries would run twice"
        )


def beat(channel: Any, node: str, dead_after_s: float) -> tuple[bool, list[str]]:
    """Renew ``node``'s liveness and the time of the messages it holds; returns whether its
    record was still there, and the dead nodes."""
    keys = [NODES_KEY, channel.unacked_index_key, HOLDERS_KEY]
    args = [node, max(1, round(dead_after_s * 1000)), time.time(), NODE_PREFIX]
    with channel.conn_or_acquire() as client:
        was, dead = channel._script(_BEAT)(keys=keys, args=args, client=client)
    return bool(int(was)), [bytes_to_str(other) for other in dead]


def restore_dead(channel: Any, node: str, dead: list[str]) -> int:
    """Claim the messages the ``dead`` nodes held and put them back; returns how many."""
    restored = 0
    for other in dead:
        with channel.conn_or_acquire() as client:
            args = [other, node, NODE_PREFIX]
            tags = channel._script(_CLAIM)(keys=[NODES_KEY, HOLDERS_KEY], args=args, client=client)
        for tag in tags:
            channel.qos.restore_by_tag(bytes_to_str(tag))
        if tags:
            logger.warning(
                "node %s missed its heartbeats: %d message(s) it held are back in their queues",
                other,
                len(tags),
            )
        restored += len(tags)
    return restored


class Heartbeat:
    """A node's heartbeat: a thread of its main process, so that neither a long reconcile
    nor a loaded machine makes the node look dead between two turns of its event loop. The
    loop calls :meth:`turn` (``wm.dataplane.node``); the record then lasts until
    WM_NODE_DEAD_AFTER_S after the last turn, so a node whose loop is wedged lapses, and what
    it holds goes back, though this thread beats on. Without a watched loop (before the first
    turn, a pool without an event loop) and while a warm shutdown drains the deliveries in
    flight (:meth:`drain`), the record lasts WM_NODE_DEAD_AFTER_S after each beat."""

    def __init__(
        self,
        settings: Settings,
        app: Any,
        node: str,
        on_beat: Callable[[str, list[str], int], None] | None = None,
    ) -> None:
        check_settings(settings)
        if settings.visibility_timeout_s <= MIN_BEATS_MISSED * settings.node_heartbeat_s:
            logger.warning(
                "WM_VISIBILITY_TIMEOUT_S=%s is not above %d heartbeats (WM_NODE_HEARTBEAT_S=%g):"
                " a delivery running longer may be handed out again while it runs",
                settings.visibility_timeout_s,
                MIN_BEATS_MISSED,
                settings.node_heartbeat_s,
            )
        self.settings, self.app, self.node = settings, app, node
        #: Told of each beat that renewed the record: the node, the dead nodes it found and
        #: how many of their messages it put back (``wm.dataplane.infra``'s heartbeat event).
        self.on_beat = on_beat
        self.connection: Any = None
        #: When the node's event loop last turned (monotonic); None: no loop is watched.
        self.turned: float | None = None
        self.draining = False
        self.lapsed = False  # the loop stood still too long; said once
        self.first = True  # the next beat is the first of this life: no record yet
        self.thread = threading.Thread(target=self._run, name="wm-heartbeat", daemon=True)

    def start(self) -> None:
        """The first beat (the record exists before the node takes a message), then the
        thread; from now on this process records itself as the holder of what it takes."""
        self._beat()
        hold_as(self.node)
        _beating.append(self)
        self.thread.start()

    def new_life(self) -> None:
        """The node reconnected to the broker: Celery dropped the messages it had reserved
        and not started, which it could not put back if Redis was away. They are held under
        the old name, which this node no longer renews: they go back when it lapses (with
        any delivery that was running then, as a closed connection gives back on RabbitMQ;
        its outputs stay effectively once)."""
        old, self.node = self.node, f"{self.node.rpartition('.')[0]}.{uuid.uuid4().hex[:12]}"
        self.first = True
        hold_as(self.node)
        logger.info(
            "node %s reconnected as %s: what %s held goes back as it lapses", old, self.node, old
        )

    def turn(self) -> None:
        """The node's event loop turned (a timer entry of the loop calls this)."""
        self.turned = time.monotonic()

    def drain(self) -> None:
        """A warm shutdown began: the loop stops, the deliveries in flight run to their end
        (WM_SHUTDOWN_GRACE_S at most) and the node keeps their messages until then."""
        self.draining = True

    def life_s(self) -> float:
        """How much longer the node counts as alive from now."""
        dead_after = self.settings.node_dead_after_s
        if self.turned is None or self.draining:
            return dead_after
        return dead_after - (time.monotonic() - self.turned)

    def _run(self) -> None:
        while True:
            # Closer to the end of the record's life, sooner: a loop that turns again just
            # before it lapses is seen in time.
            life = self.life_s()
            beat_s = self.settings.node_heartbeat_s
            time.sleep(beat_s if life <= 0 else min(beat_s, max(life / 2, 0.1)))
            self._beat()
            flush_acks()

    def _beat(self) -> None:
        try:
            self.once()
        except Exception as exc:  # Redis away: the next beat tries again
            self._drop_connection()
            logger.warning(
                "heartbeat of node %s failed (%s); next try in %gs",
                self.node,
                exc,
                self.settings.node_heartbeat_s,
            )

    def once(self) -> int:
        """One beat; returns how many messages of dead nodes it put back."""
        if self.connection is None:
            self.connection = self.app.connection_for_write()
        life = self.life_s()
        if life <= 0:
            self._lapse()
            return 0
        self.lapsed = False
        channel = self.connection.default_channel
        node, first, self.first = self.node, self.first, False
        alive, dead = beat(channel, node, life)
        if not alive:
            # Its first beat, or this node could not beat (it stalled, or Redis was away,
            # when every record may have lapsed): the others get one beat to renew theirs.
            if not first:
                logger.warning(
                    "node %s missed its own heartbeats for WM_NODE_DEAD_AFTER_S=%gs: what it "
                    "held may have gone to other nodes, and deliveries running here may run "
                    "there too",
                    node,
                    self.settings.node_dead_after_s,
                )
            return 0
        others = [d for d in dead if d != node]
        restored = restore_dead(channel, node, others)
        self._tell(node, others, restored)
        return restored

    def _tell(self, node: str, dead: list[str], restored: int) -> None:
        if self.on_beat is None:
            return
        try:
            self.on_beat(node, dead, restored)
        except Exception:  # telemetry never stops a heartbeat
            logger.exception("node %s: telling of its heartbeat failed", node)

    def _lapse(self) -> None:
        """Renew nothing: the loop that would run what the node holds stands still."""
        if not self.lapsed:
            self.lapsed = True
            logger.warning(
                "node %s: its event loop has not turned for WM_NODE_DEAD_AFTER_S=%gs; its "
                "liveness lapses and the other nodes put back the messages it holds",
                self.node,
                self.settings.node_dead_after_s,
            )

    def _drop_connection(self) -> None:
        if self.connection is not None:
            with contextlib.suppress(Exception):
                self.connection.close()
        self.connection = None
