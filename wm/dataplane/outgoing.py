"""An event on its way through :meth:`wm.dataplane.bus.Bus.publish`: encoded for its topic
(:class:`Encoded`), then with its topic's routes and what the pending-ledger write returned
(:class:`Outgoing`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wm.dataplane import tracing
from wm.dataplane.routes import DROPPED, READY, ROUTES, Route, topic_key
from wm.events import CloudEvent, encode, key_of
from wm.state.ledger import Entries

#: Events one ``publish_many`` round trip carries at most (ledger payloads and messages
#: are held in memory per batch; more per batch buys little once the round trip is shared).
PUBLISH_BATCH = 500


@dataclass(frozen=True)
class Encoded:
    """An event encoded for its topic: its payload, key (:func:`wm.events.key_of`), id and
    type (Flower's labels) and ``partitionkey`` (ordered workers number it)."""

    topic: str
    payload: str
    key: str
    about: tuple[str, str]
    partition: str | None


@dataclass(frozen=True)
class Outgoing:
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


def outgoing(event: Encoded, flat: list[Any], done: list[tuple[int, int]]) -> Outgoing:
    """``event`` with its routes (HGETALL's list) and, per route, whether its ledger entry
    was created and its number (0: none)."""
    pairs = zip(flat[::2], flat[1::2], strict=True)
    rows = sorted(
        ((Route.parse(q, w), *written) for (q, w), written in zip(pairs, done, strict=True)),
        key=lambda row: row[0].queue,
    )
    created = tuple(r.worker_id for r, new, _ in rows if new and r.worker_id is not None)
    numbers = {r.worker_id: n for r, _, n in rows if n and r.worker_id is not None}
    routes = [r for r, _, _ in rows]
    return Outgoing(event.payload, event.key, event.about, routes, Entries(numbers, created))
