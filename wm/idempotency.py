"""Business idempotency keys (seed 002): what a worker's recorded outcome is keyed on.

By default a delivery's outcome is keyed on its event's identity (``source`` + ``id``), so a
producer that sends one business operation again under a new event id has it run again. A
worker may declare where the business key of its events is (its ``idempotency_key``
setting): an attribute of the event (``orderid``: an extension, or ``subject``) or a path
into its JSON ``data`` (``$.orderId``, ``$.items[0].sku``). Seed 002's key is
``sha256(eventId:handlerName:targetAggregateId)``; the business key takes the place of
``eventId`` (keeping the event id there would make every new id a new operation), the
worker's id is the handler, and the event's ``subject`` (CloudEvents: what the event is
about, for its producer) the target aggregate, empty when the event has none.

An event that lacks the declared key is refused (:class:`~wm.errors.IdempotencyKeyMissing`),
never run under its event id instead: that would quietly drop the guarantee the worker asked
for.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from wm.errors import IdempotencyKeyMissing, InvalidArgument
from wm.events import CloudEvent

#: The setting that declares it.
IDEMPOTENCY_KEY = "idempotency_key"
#: A CloudEvents attribute name: lower-case letters and digits.
_ATTRIBUTE = re.compile(r"[a-z0-9]+")
#: One step of a path: ``.name`` (letters, digits, ``_``, ``-``) or ``[index]``.
_STEP = re.compile(r"\.([A-Za-z0-9_-]+)|\[(0|[1-9][0-9]*)\]")
#: Attributes that hold the data itself: name a path into it instead.
_DATA_ATTRIBUTES = frozenset({"data", "data_base64"})
_EXAMPLES = "an attribute name such as 'orderid' or a path into data such as '$.orderId'"


@dataclass(frozen=True)
class KeySource:
    """Where a worker's business key is: an ``attribute``, or a ``path`` into the data."""

    text: str
    attribute: str | None = None
    path: tuple[str | int, ...] = ()

    def value(self, event: CloudEvent) -> str:
        """The event's business key as text; :class:`IdempotencyKeyMissing` naming why
        when it has none (absent, ``null`` or empty)."""
        if self.attribute is not None:
            found = event.get_attributes().get(self.attribute)
            return _text(found, event, f"has no attribute {self.attribute!r}")
        node = _json_data(event)
        for step in self.path:
            if isinstance(step, int):
                node = node[step] if isinstance(node, list) and step < len(node) else None
            else:
                node = node.get(step) if isinstance(node, dict) else None
        return _text(node, event, f"has nothing at {self.text!r} in its data")


@functools.lru_cache(maxsize=256)
def key_source(text: str) -> KeySource:
    """Parse a declared key; :class:`InvalidArgument` naming what is wrong with it."""
    if not text.startswith("$"):
        if text in _DATA_ATTRIBUTES:
            raise InvalidArgument(_invalid(text, "the data is no attribute: name a path into it"))
        if not _ATTRIBUTE.fullmatch(text):
            why = "not an attribute name (CloudEvents: lower-case letters and digits)"
            raise InvalidArgument(_invalid(text, why))
        return KeySource(text, attribute=text)
    path: list[str | int] = []
    at = 1
    while at < len(text):
        step = _STEP.match(text, at)
        if step is None:
            raise InvalidArgument(_invalid(text, f"a path step is expected at character {at}"))
        name, index = step.groups()
        path.append(name if name is not None else int(index))
        at = step.end()
    if not path:
        raise InvalidArgument(_invalid(text, "a path names at least one member"))
    return KeySource(text, path=tuple(path))


def operation_key(declared: str | None, event: CloudEvent, worker_id: str, event_key: str) -> str:
    """What the worker's outcome of ``event`` is keyed on: ``event_key`` (the event's
    identity) without a declared key, else seed 002's digest with the business key."""
    if declared is None:
        return event_key
    business = key_source(declared).value(event)
    aggregate = event.get_subject() or ""
    digest = hashlib.sha256(f"{business}:{worker_id}:{aggregate}".encode("utf-8", "surrogatepass"))
    return "op:" + digest.hexdigest()


def _json_data(event: CloudEvent) -> Any:
    data = event.get_data()
    if isinstance(data, str | bytes):
        try:
            return json.loads(data)
        except ValueError:  # includes UnicodeDecodeError
            return None
    return data


def _text(value: Any, event: CloudEvent, lacks: str) -> str:
    if value is None or value == "":
        raise IdempotencyKeyMissing(
            f"event {event.get_id()} {lacks}, the business key its worker declares "
            f"({IDEMPOTENCY_KEY}); it is parked unrun: fix the producer, or the setting, "
            "then replay it"
        )
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _invalid(text: str, why: str) -> str:
    return f"worker setting {IDEMPOTENCY_KEY!r} must be {_EXAMPLES}; {text!r}: {why}"
