"""Worker placement on a Redis broker: each worker's messages go to one node of the live
nodes, chosen by rendezvous hashing over them, so a pool process loads the facts and code of
its node's share of the workers instead of every worker's; a worker whose queue grows past
WM_PLACEMENT_SPILL is served by every node.

Every node still consumes every running worker's queue (``wm.dataplane.node``): placement is
decided where a node takes a message from the ready list (``wm.dataplane.transport``), in the
script that takes it. A name it pops there whose queue is placed on another node, and holds
no more than WM_PLACEMENT_SPILL messages, goes to that node's *inbox* (``<ready list>.inbox.
<node>``), a ready list only that node reads; a name in a node's inbox is that node's to
take, whatever its own view of the live nodes, so a name moves at most once. Nothing moves a
consumer or a message: a node that dies holds messages that come back to their queues as
before (``wm.dataplane.liveness``), and its share goes to the others as soon as their view
of the live nodes drops it. The view is a membership each node renews every
WM_NODE_HEARTBEAT_S from its event loop and that lapses WM_NODE_DEAD_AFTER_S after (as its
liveness does), and leaves when it stops (:class:`Watcher`); the names left in a departed
node's inbox go back to the shared ready list. A node alone places every worker on itself
and reads no inbox: it behaves as without placement.

The owner of a queue is the live node whose ``sha1(node + "/" + queue)`` is largest, in
Python (:func:`owner`) as in Lua (:data:`PLACE`), so a node joining or leaving moves only its
own share.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kombu.utils.encoding import bytes_to_str

logger = logging.getLogger(__name__)

#: A node's inbox is ``<ready list><INBOX><node>``.
INBOX = ".inbox."
#: The live members of placement are the sorted set ``<ready list><MEMBERS>`` (node → when
#: its membership ends, in ms of the Redis clock).
MEMBERS = ".members"
# KEYS: the members. ARGV: this node, its membership's life (ms). Renews it on the Redis
# clock, removes the members whose life ended; returns {live members, those removed}.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return {redis.call('ZRANGE', KEYS[1], 0, -1), dead}
"""

# Lua, prepended to the transport's take scripts, as liveness.HOLD is. P: {the inbox prefix
# ('' when placement is off), this node, the spill, the live nodes...}. relist(queue, left)
# lists again a queue that still holds ``left`` messages: in the shared ready list (KEYS[1])
# when any node may take it, else in its owner's inbox. placed(queue) says whether this node
# takes the message of a name popped from the shared list; when not, the name is in the
# owner's inbox.
PLACE = """
local function owner(queue, P)
  local best, top = P[2], ''
  for i = 4, #P do
    local h = redis.sha1hex(P[i] .. '/' .. queue)
    if h > top then best, top = P[i], h end
  end
  return best
end
local function depth(lists)
  local n = 0
  for _, key in ipairs(lists) do n = n + redis.call('LLEN', key) end
  return n
end
local function relist(queue, left, P)
  if left == 0 then return end
  if P[1] == '' or left > tonumber(P[3]) then
    redis.call('LPUSH', KEYS[1], queue)
  else
    redis.call('LPUSH', P[1] .. owner(queue, P), queue)
  end
end
local function placed(queue, lists, P)
  if P[1] == '' or #P < 5 then return true end
  local o = owner(queue, P)
  if o == P[2] or depth(lists) > tonumber(P[3]) then return true end
  redis.call('LPUSH', P[1] .. o, queue)
  return false
end
"""


class View:
    """What this process knows of placement: off until a node's :class:`Watcher` sets it."""

    def __init__(self) -> None:
        self.node = ""
        self.spill = 0
        self.nodes: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """Placement is on and another node is live: alone, a node takes as without it."""
        return bool(self.node) and self.spill > 0 and len(self.nodes) > 1


#: This process's view (a node's main process; elsewhere placement is off).
VIEW = View()


def inbox_key(ready_key: str, node: str) -> str:
    return f"{ready_key}{INBOX}{node}"


def place_args(channel: Any) -> list[Any]:
    """The ``P`` of :data:`PLACE` for ``channel`` now (an inbox prefix of '' is off)."""
    if not (VIEW.active and channel.ready_key and not channel.global_keyprefix):
        return ["", "", 0]
    return [f"{channel.ready_key}{INBOX}", VIEW.node, VIEW.spill, *VIEW.nodes]


def my_inbox(channel: Any) -> str:
    """This node's inbox on ``channel``, or '' when placement is off."""
    if not (VIEW.active and channel.ready_key and not channel.global_keyprefix):
        return ""
    return inbox_key(channel.ready_key, VIEW.node)


def owner(queue: str, nodes: Iterable[str]) -> str:
    """The node ``queue`` is placed on among ``nodes`` (the same choice as :data:`PLACE`)."""

    def score(node: str) -> str:
        return hashlib.sha1(f"{node}/{queue}".encode(), usedforsecurity=False).hexdigest()

    return max(nodes, key=score)


def members_key(ready_key: str) -> str:
    return f"{ready_key}{MEMBERS}"


def renew(client: Any, ready_key: str, node: str, life_s: float) -> tuple[list[str], list[str]]:
    """Renew ``node``'s membership for ``life_s``; returns (the live members, sorted; the
    members that expired, now removed)."""
    args = [node, max(1, round(life_s * 1000))]
    live, dead = client.eval(_RENEW, 1, members_key(ready_key), *args)
    return sorted(map(bytes_to_str, live)), [bytes_to_str(node) for node in dead]


def give_back(client: Any, ready_key: str, gone: Sequence[str]) -> int:
    """Move the names left in the inboxes of the ``gone`` nodes to the shared ready list;
    returns how many (each moves in one atomic RPOPLPUSH)."""
    moved = 0
    for node in gone:
        while client.rpoplpush(inbox_key(ready_key, node), ready_key) is not None:
            moved += 1
    return moved


class Watcher:
    """A node's membership of placement and its view of the live members, renewed from the
    event loop every heartbeat (so a node whose loop stands still drops out, as its liveness
    lapses): what the take scripts place by (:data:`VIEW`). Members are per ready list, so
    nodes of another deployment sharing the broker place nothing here."""

    #: Renewals during which a departed node's inbox is still given back (a node whose view
    #: lagged may have put names in it after it left).
    LINGER = 5

    def __init__(self, node: str, spill: int, life_s: float) -> None:
        VIEW.node, VIEW.spill, VIEW.nodes = node, spill, (node,)
        self.life_s = life_s
        self.departed: dict[str, int] = {}

    def rename(self, node: str) -> None:
        """The node reconnected under a new name (``Heartbeat.new_life``); the old one left."""
        VIEW.node = node

    def refresh(self, channel: Any) -> None:
        """Renew the membership, read the live members; give back the inboxes of members
        that left."""
        if not channel.ready_key:
            return
        with channel.conn_or_acquire() as client:
            live, dead = renew(client, channel.ready_key, VIEW.node, self.life_s)
            nodes = tuple(sorted({*live, VIEW.node}))
            for node in {*VIEW.nodes, *dead} - set(nodes):
                self.departed.setdefault(node, self.LINGER)
            if nodes != VIEW.nodes:
                logger.info("placement over %d live node(s): %s", len(nodes), ", ".join(nodes))
            VIEW.nodes = nodes
            # Alone, the node reads no inbox: names put in its own while it was not go back.
            gone = [*self.departed, *([VIEW.node] if len(nodes) < 2 else [])]
            moved = give_back(client, channel.ready_key, gone)
        self.departed = {node: n - 1 for node, n in self.departed.items() if n > 1}
        if moved:
            logger.warning("%d name(s) left in the inbox of a node gone listed again", moved)

    def leave(self, channel: Any) -> None:
        """The node stops consuming (a warm shutdown, a broker reconnect): the others place
        its share at their next renewal, and what its inbox holds goes back."""
        if not channel.ready_key:
            return
        with channel.conn_or_acquire() as client:
            client.zrem(members_key(channel.ready_key), VIEW.node)
            give_back(client, channel.ready_key, [VIEW.node])
        VIEW.nodes = (VIEW.node,)
