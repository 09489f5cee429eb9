"""An event on its way through :meth:`wm.dataplane.bus.Bus.publish`: encoded for its topic
(:class:`Encoded`), then with its topic's routes and what the pending-ledger write returned
(:class:`Outgoing`)."""

from __future__ import annotations

from typing import Any, NamedTuple

from wm.dataplane import tracing
from wm.dataplane.routes import DROPPED, READY, ROUTES, Route, topic_key
from wm.events import CloudEvent, encode, key_of
from wm.state.ledger import Entries

#: Events one ``publish_many`` round trip carries at most (ledger payloads and messages
#: are held in memory per batch; more per batch buys little once the round trip is shared).
PUBLISH_BATCH = 500


class Encoded(NamedTuple):
    """An event encoded for its topic: its payload, key (:func:`wm.events.key_of`), id and
    type (Flower's labels) and ``partitionkey`` (ordered workers number it). A named tuple,
    as :class:`Outgoing` is: a third of a frozen dataclass's time to make, once per event of
    a ``publish_many``."""

    topic: str
    payload: str
    key: str
    about: tuple[str, str]
    partition: str | None


class Outgoing(NamedTuple):
    """An event ready to send: its topic's routes and what the ledger write returned."""

    payload: str
    key: str | None
    about: tuple[str, str] | None
    routes: list[Route]
    entries: Entries


def encoded(event: CloudEvent, topic: str) -> Encoded:
    partition = event.get_extension("partitionkey")
    return Encoded(
        topic,
        encode(event),
        key_of(event),
        (event.get_id(), event.get_type()),
        partition if isinstance(partition, str) and partition else None,
    )


def traced(event: CloudEvent, topic: str) -> Encoded:
    """The event of a batch, encoded inside its own publish span (which ends before the
    batch is sent: a span left open would be the parent of the next event's)."""
    with tracing.publishing(event, topic) as traced:
        return encoded(traced, topic)


def route_keys(topic: str) -> tuple[str, str, str]:
    return topic_key(topic, READY), topic_key(topic, ROUTES), topic_key(topic, DROPPED)


def parsed_routes(flat: list[Any]) -> list[tuple[int, Route]]:
    """The routes of HGETALL's list, by queue, each with its place in that list: parsed
    once for every event of a topic that one round trip recorded."""
    pairs = zip(flat[::2], flat[1::2], strict=True)
    return sorted(enumerate(Route.parse(q, w) for q, w in pairs), key=lambda row: row[1].queue)


def outgoing(
    event: Encoded, routes: list[tuple[int, Route]], done: list[tuple[int, int]]
) -> Outgoing:
    """``event`` with its routes (:func:`parsed_routes`) and, per route in HGETALL's order,
    whether its ledger entry was created and its number (0: none)."""
    created = tuple(r.worker_id for i, r in routes if done[i][0] and r.worker_id is not None)
    numbers = {r.worker_id: done[i][1] for i, r in routes if done[i][1] and r.worker_id is not None}
    return Outgoing(
        event.payload, event.key, event.about, [r for _, r in routes], Entries(numbers, created)
    )
