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
of the live nodes drops it (refreshed every WM_NODE_HEARTBEAT_S by :class:`Watcher`, which
also puts the names left in a dead node's inbox back in the shared ready list). One live node
places every worker on itself: it behaves as without placement.

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

from wm.dataplane.liveness import NODES_KEY, record_key

logger = logging.getLogger(__name__)

#: A node's inbox is ``<ready list><INBOX><node>``.
INBOX = ".inbox."

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
        return bool(self.node) and self.spill > 0


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


def live_nodes(client: Any) -> tuple[list[str], list[str]]:
    """(The nodes that may hold messages, those of them whose liveness record exists), from
    ``wm.dataplane.liveness``'s keys, sorted."""
    known = sorted(bytes_to_str(node) for node in client.smembers(NODES_KEY))
    if not known:
        return [], []
    with client.pipeline(transaction=False) as pipe:
        for node in known:
            pipe.exists(record_key(node))
        alive = pipe.execute()
    return known, [node for node, exists in zip(known, alive, strict=True) if exists]


def give_back(client: Any, ready_key: str, gone: Sequence[str]) -> int:
    """Move the names left in the inboxes of the ``gone`` nodes to the shared ready list;
    returns how many (each moves in one atomic RPOPLPUSH)."""
    moved = 0
    for node in gone:
        while client.rpoplpush(inbox_key(ready_key, node), ready_key) is not None:
            moved += 1
    return moved


class Watcher:
    """A node's view of the live nodes, refreshed from the event loop every heartbeat:
    what the take scripts place by (:data:`VIEW`)."""

    #: Refreshes during which a departed node's inbox is still given back (a node whose
    #: view lagged may have put names in it after it left).
    LINGER = 5

    def __init__(self, node: str, spill: int) -> None:
        VIEW.node, VIEW.spill, VIEW.nodes = node, spill, (node,)
        self.departed: dict[str, int] = {}

    def rename(self, node: str) -> None:
        """The node reconnected under a new name (``Heartbeat.new_life``)."""
        VIEW.node = node

    def refresh(self, channel: Any) -> None:
        """Read the live nodes; give back the inboxes of nodes that left the view."""
        if not channel.ready_key:
            return
        with channel.conn_or_acquire() as client:
            known, live = live_nodes(client)
            nodes = tuple(sorted({*live, VIEW.node}))
            for node in {*VIEW.nodes, *known} - set(nodes):
                self.departed.setdefault(node, self.LINGER)
            if nodes != VIEW.nodes:
                logger.info("placement over %d live node(s): %s", len(nodes), ", ".join(nodes))
            VIEW.nodes = nodes
            moved = give_back(client, channel.ready_key, list(self.departed))
        self.departed = {node: n - 1 for node, n in self.departed.items() if n > 1}
        if moved:
            logger.warning("%d name(s) left in the inbox of a dead node listed again", moved)
