"""The routing table's layout in Redis and its values: one :class:`Route` per subscription of
a topic (DESIGN.md §5.1), where a shared group's members are one subscription
(``wm.store.shares``). :class:`wm.dataplane.bus.Bus` reads and maintains it."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from wm.dataplane.queues import worker_queue_name
from wm.state.connection import text
from wm.store.models import Worker
from wm.store.shares import share_of
from wm.workersettings import WorkerSettings

#: The routing table, one set of keys per topic, each tagged with the topic: on a Redis
#: Cluster every topic lives on one shard (topics spread over the shards), and a lookup's
#: script touches one slot.
#:
#: - ``wm:topic:{<topic>}:routes``: hash, queue → worker id ('' for a plain subscription);
#: - ``wm:topic:{<topic>}:ready``: the topic's routes were loaded from the database. It is
#:   lost with its shard's data, or ends :data:`READY_TTL_S` after the load, and a lookup
#:   that misses it loads the topic first;
#: - ``wm:topic:{<topic>}:dropped``: events published to the topic while nobody subscribed,
#:   ending :data:`DROPPED_TTL_S` after the last.
#:
#: So a topic that publishers named once, and nobody subscribes to, leaves nothing for ever.
TOPIC = "wm:topic:"
ROUTES, READY, DROPPED = "routes", "ready", "dropped"
#: Seconds a topic's ready flag lasts past the load that set it; every reconcile period's
#: rebuild of the table sets it again for each topic with a route.
READY_TTL_S = 24 * 3600
#: Seconds a topic's drop counter lasts past its last drop.
DROPPED_TTL_S = 7 * 24 * 3600
#: What each script that counts drops runs after its count.
COUNT_ENDS = f"redis.call('EXPIRE', KEYS[3], {DROPPED_TTL_S})"
#: The layout of earlier releases, across several slots: a hash per topic and one flag for
#: the whole table, and one hash of drop counts (field ``*``: all topics). Processes of an
#: earlier release still read it during an upgrade: :meth:`Bus.add_route` writes it too
#: while its flag exists, and a full rebuild deletes the flag, so they rebuild theirs from
#: the database. Drops counted there are still reported by :meth:`Bus.dropped`.
LEGACY_ROUTES = "wm:routes:"
LEGACY_READY = "wm:routes-ready"
LEGACY_DROPPED = "wm:stats:dropped"
# KEYS: the topic's ready flag, routes, drop counter. ARGV: "1" to count a drop.
# Returns false when the topic's routes must be loaded first, else the routes (HGETALL's
# list); an empty one is counted as a drop in the same round trip.
ROUTES_OR_DROP = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local routes = redis.call('HGETALL', KEYS[2])
if #routes == 0 and ARGV[1] == '1' then redis.call('INCR', KEYS[3]) <ends> end
return routes
""".replace("<ends>", COUNT_ENDS)


def topic_key(topic: str, kind: str) -> str:
    """The key of ``topic``'s routes, ready flag or drop counter (``kind``)."""
    return f"{TOPIC}{{{topic}}}:{kind}"


@dataclass(frozen=True)
class Route:
    """One subscription of a topic: its queue and, for a worker, the worker id, its name and
    whether it orders its events by ``partitionkey`` (``wm.state.ordering``). A shared
    group's one route (``wm.store.shares``) carries the share's id as its worker id and the
    group's name as ``share``."""

    queue: str
    worker_id: str | None
    ordered: bool = False
    name: str | None = None
    share: str | None = None

    @property
    def value(self) -> str:
        """The route's value in the routing table: '' for a plain subscription, the worker id
        (the format of earlier releases), or JSON with the worker's name and ordering, or the
        shared group's name."""
        if self.worker_id is None:
            return ""
        if not (self.name or self.ordered or self.share):
            return self.worker_id
        found: dict[str, Any] = {"id": self.worker_id}
        if self.name:
            found["name"] = self.name
        if self.ordered:
            found["ordering"] = "key"
        if self.share:
            found["share"] = self.share
        return json.dumps(found, separators=(",", ":"))

    @classmethod
    @functools.lru_cache(maxsize=4096)  # a batch's events of one topic share their routes
    def parse(cls, queue: Any, value: Any) -> Route:
        worker = text(value)
        if not worker.startswith("{"):
            return cls(text(queue), worker or None)
        found = json.loads(worker)
        return cls(
            text(queue),
            found["id"],
            found.get("ordering") == "key",
            found.get("name"),
            found.get("share"),
        )

    @property
    def label(self) -> str:
        """Who the route delivers to, as Flower shows it."""
        if self.share:
            return f"group {self.share}"
        return self.name or self.worker_id or self.queue

    @property
    def topic(self) -> str:
        """The topic a worker's queue is named after (``<topic>::<worker id>``)."""
        return self.queue.rpartition("::")[0] or self.queue


def ordered(settings: dict[str, Any] | None) -> bool:
    """A worker with these settings orders its events by ``partitionkey``."""
    return WorkerSettings.of(settings).ordered


def worker_route(
    worker_id: str,
    topic: str,
    group: str | None,
    settings: dict[str, Any] | None,
    name: str | None = None,
) -> Route:
    """The route a worker's events come through: its own queue, or its shared group's on the
    topic, which every member consumes (``wm.store.shares``)."""
    share = share_of(topic, group, settings)
    if share is not None:
        return Route(worker_queue_name(topic, share), share, share=group)
    return Route(worker_queue_name(topic, worker_id), worker_id, ordered(settings), name)


def route_of(worker: Worker) -> Route:
    """:func:`worker_route` of a worker's row."""
    return worker_route(str(worker.id), worker.topic, worker.group, worker.settings, worker.name)
