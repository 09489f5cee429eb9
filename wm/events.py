"""CloudEvents as immutable values: construction, structured-JSON encode/decode, lifecycle events.

Events are objects of the ``cloudevents`` SDK (v1.0). On the wire they travel in structured
JSON mode; binary ``data`` is base64-encoded into ``data_base64`` as the spec requires.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from cloudevents.core.exceptions import BaseCloudEventException
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from dateutil.parser import isoparse

from wm.errors import EventDecodeError
from wm.names import DEFAULT_TENANT

__all__ = [
    "GROUPLOCK_TOPIC",
    "HEARTBEAT_TOPIC",
    "INFRA_TYPE_PREFIX",
    "LIFECYCLE_SOURCE",
    "LIFECYCLE_TOPIC",
    "LIFECYCLE_TYPE_PREFIX",
    "CloudEvent",
    "decode",
    "decode_object",
    "derive_id",
    "encode",
    "event_key",
    "event_to_dict",
    "infra_event",
    "key_of",
    "lifecycle_event",
    "make_event",
    "parse_json",
    "with_attributes",
]

#: Topic every lifecycle event is published to.
LIFECYCLE_TOPIC = "workmanager.lifecycle"
#: Prefix of lifecycle event types; the suffix names the event (created, started, …).
LIFECYCLE_TYPE_PREFIX = "com.virtufin.workmanager.lifecycle."
LIFECYCLE_SOURCE = "/workmanager"
#: Topics of the finer-grained infrastructure events (``WM_INFRA_EVENTS``): node heartbeats
#: and group-lock changes.
HEARTBEAT_TOPIC = "workmanager.infra.heartbeat"
GROUPLOCK_TOPIC = "workmanager.infra.grouplock"
#: Prefix of infrastructure event types: ``…heartbeat``, ``…grouplock.lock_acquired``, ….
INFRA_TYPE_PREFIX = "com.virtufin.workmanager.infra."
#: Namespace of deterministic output ids (input id + worker id + index).
_OUTPUT_ID_NAMESPACE = uuid.UUID("0f4c2a3e-5d1b-4b7e-9a61-3c8e2f7d9b10")
_NAMESPACE_SHA1 = hashlib.sha1(_OUTPUT_ID_NAMESPACE.bytes, usedforsecurity=False)
_FORMAT = JSONFormat()
#: The timestamps ``datetime.fromisoformat`` reads as dateutil does (RFC 3339's, with at
#: most microseconds).
_RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?(?:Z|[+-]\d\d:\d\d)\Z")


def make_event(
    type: str,
    source: str,
    data: Any = None,
    *,
    id: str | None = None,
    subject: str | None = None,
    datacontenttype: str | None = None,
    extensions: Mapping[str, Any] | None = None,
    time: datetime | None = None,
) -> CloudEvent:
    """Build a v1.0 CloudEvent; ``id`` and ``time`` are generated when not given."""
    attributes: dict[str, Any] = {"type": type, "source": source}
    if id is not None:
        attributes["id"] = id
    if time is not None:
        attributes["time"] = time
    if subject is not None:
        attributes["subject"] = subject
    if datacontenttype is not None:
        attributes["datacontenttype"] = datacontenttype
    elif data is not None and not isinstance(data, bytes | str):
        attributes["datacontenttype"] = "application/json"
    attributes.update(extensions or {})
    try:
        return CloudEvent(attributes, data)
    except BaseCloudEventException as exc:
        raise EventDecodeError(f"invalid CloudEvent: {exc}") from exc


def with_attributes(event: CloudEvent, **attributes: Any) -> CloudEvent:
    """Return a copy of ``event`` with attributes or extensions set (None removes one)."""
    merged = dict(event.get_attributes())
    for name, value in attributes.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    try:
        return CloudEvent(merged, event.get_data())
    except BaseCloudEventException as exc:
        raise EventDecodeError(f"invalid CloudEvent attribute: {exc}") from exc


#: The CloudEvents extension naming the tenant an event was published in, set by WorkManager
#: whatever the publisher set (``wm`` like ``wmhops``: a publisher's own ``tenant`` extension
#: is its own business); absent in the default tenant, whose events are as in earlier
#: releases.
TENANT_EXTENSION = "wmtenant"


def in_tenant(event: CloudEvent, tenant: str) -> CloudEvent:
    """``event`` as published in ``tenant``: its ``tenant`` extension says so (and is removed
    in the default tenant), whatever the publisher set."""
    wanted = None if tenant == DEFAULT_TENANT else tenant
    if event.get_extension(TENANT_EXTENSION) == wanted:
        return event
    return with_attributes(event, **{TENANT_EXTENSION: wanted})


def tenant_of(event: CloudEvent) -> str:
    """The tenant ``event`` was published in (by its ``tenant`` extension)."""
    return str(event.get_extension(TENANT_EXTENSION) or DEFAULT_TENANT)


def tenant_fields(tenant: str) -> dict[str, str]:
    """What the data of a lifecycle or infra event about something of ``tenant`` adds:
    ``{"tenant": tenant}``, nothing in the default tenant (its events are as before)."""
    return {} if tenant == DEFAULT_TENANT else {"tenant": tenant}


def encode(event: CloudEvent) -> str:
    """Structured-mode JSON text of ``event``: what the SDK's ``JSONFormat.write`` writes,
    and for JSON data (or none) without its per-call encoder class, pattern match and
    bytes round trip (half the time; a third of ``publish_many``'s encoding)."""
    data, attributes = event.get_data(), event.get_attributes()
    if isinstance(data, bytes | bytearray) or (
        data is not None
        and not _JSON_TYPE.match(attributes.get("datacontenttype", JSONFormat.DEFAULT_CONTENT_TYPE))
    ):
        return _FORMAT.write(event).decode("utf-8")
    found = dict(attributes)
    if data is not None:
        found["data"] = data
    return _ENCODER.encode(found)


def rfc3339(value: datetime) -> str:
    """``value`` as the SDK writes a time: ISO 8601, UTC as ``Z``. A time in
    :data:`~datetime.UTC` (the SDK's, and every time it parses with ``Z``) is written in one
    formatting pass; ``isoformat`` makes two, and replacing its ``+00:00`` a third string."""
    if value.tzinfo is UTC:
        fields = (value.year, value.month, value.day, value.hour, value.minute, value.second)
        if micro := value.microsecond:
            return _UTC_MICROS % (*fields, micro)
        return _UTC_SECONDS % fields
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


_UTC_SECONDS = "%04d-%02d-%02dT%02d:%02d:%02dZ"
_UTC_MICROS = "%04d-%02d-%02dT%02d:%02d:%02d.%06dZ"


def _json_time(value: object) -> str:
    """A datetime as the SDK writes it; anything else is no JSON."""
    if not isinstance(value, datetime):
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
    return rfc3339(value)


_ENCODER = json.JSONEncoder(default=_json_time)
_JSON_TYPE = JSONFormat.JSON_CONTENT_TYPE_PATTERN


def event_to_dict(event: CloudEvent) -> dict[str, Any]:
    """Structured-mode JSON object of ``event`` (what ``encode`` writes, as a dict)."""
    result: dict[str, Any] = json.loads(encode(event))
    return result


#: The C scanner behind ``json.loads``, called without the Python layers around it (an
#: instance attribute the stubs do not declare).
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def json_writer(**options: Any) -> Callable[[Any], str]:
    """``json.JSONEncoder(check_circular=False, **options).encode``, as the C encoder behind
    it kept from call to call where CPython has one (the Python layers around it, and the
    encoder built anew, were half the cost of a small document). Without the circular
    check a circular value recurses into a RecursionError."""
    encoder = json.JSONEncoder(check_circular=False, **options)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None or encoder.indent is not None:
        return encoder.encode
    strings = json.encoder.encode_basestring_ascii if encoder.ensure_ascii else _encode_string
    chunks = make(
        None,
        encoder.default,
        strings,
        None,
        encoder.key_separator,
        encoder.item_separator,
        encoder.sort_keys,
        encoder.skipkeys,
        encoder.allow_nan,
    )
    join = "".join
    return lambda value: join(chunks(value, 0))


_encode_string: Callable[[str], str] = json.encoder.encode_basestring


def parse_json(text: str | bytes) -> Any:
    """``json.loads(text)``: one JSON value with nothing around it (bytes: in UTF-8) is read
    by the C scanner alone (half the cost for a small document); anything else, errors
    included, by ``json.loads`` itself, so the result and the error are always its own."""
    source = text
    if type(text) is bytes:
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return json.loads(source)
    if type(text) is str:
        try:
            value, end = _SCAN(text, 0)
        except (StopIteration, ValueError):
            pass
        else:
            if end == len(text):
                return value
    return json.loads(source)


def decode(raw: str | bytes | Mapping[str, Any]) -> CloudEvent:
    """Parse a structured-mode CloudEvent; any defect raises :class:`EventDecodeError`."""
    try:
        parsed = parse_json(json.dumps(dict(raw)) if isinstance(raw, Mapping) else raw)
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise EventDecodeError(f"not a JSON CloudEvent: {exc}") from exc
    return decode_object(parsed)


def decode_object(parsed: Any) -> CloudEvent:
    """:func:`decode` of a structured-mode CloudEvent's JSON, parsed already (a dict it may
    change: its time and data are taken out)."""
    if not isinstance(parsed, dict):
        raise EventDecodeError("not a JSON CloudEvent: expected a JSON object")
    missing = [k for k in ("id", "source", "type", "specversion") if not parsed.get(k)]
    if missing:
        raise EventDecodeError(f"CloudEvent lacks required attribute(s): {', '.join(missing)}")
    if parsed["specversion"] != "1.0":
        raise EventDecodeError(f"unsupported specversion {parsed['specversion']!r}; expected 1.0")
    try:
        return _read(parsed)
    except (BaseCloudEventException, ValueError, TypeError, OverflowError) as exc:
        raise EventDecodeError(f"invalid CloudEvent: {exc}") from exc


def _read(parsed: dict[str, Any]) -> CloudEvent:
    """The event the SDK's ``JSONFormat.read`` makes of a v1.0 event's parsed JSON, from the
    parse already made (it parsed the text again, and read every ``time`` with dateutil)."""
    if "time" in parsed:
        parsed["time"] = _timestamp(parsed["time"])
    data = parsed.pop("data", None)
    if data is None:
        encoded = parsed.pop("data_base64", None)
        if encoded is not None:
            data = base64.b64decode(encoded)
    return CloudEvent(parsed, data)


def _timestamp(value: Any) -> datetime:
    """An RFC 3339 timestamp as the standard library reads it (a fifth of dateutil's time);
    anything else as the SDK reads it (dateutil's ``isoparse``: e.g. ``24:00``)."""
    if isinstance(value, str) and _RFC3339.match(value):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
    parsed: datetime = isoparse(value)
    return parsed


def event_key(source: str, event_id: str) -> str:
    """What identifies an event: CloudEvents makes ``source`` + ``id`` unique, not ``id``
    alone, so two producers that both number their events from 1 never collide."""
    return _uuid5(f"{source}\x00{event_id}")


def payload_key(payload: str) -> str | None:
    """The key (:func:`event_key`) of an encoded event, or None for a payload without
    a source and an id (it will be dead-lettered as malformed and needs no ledger entry)."""
    try:
        parsed = parse_json(payload)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    source, event_id = parsed.get("source"), parsed.get("id")
    if isinstance(source, str) and isinstance(event_id, str) and source and event_id:
        return event_key(source, event_id)
    return None


def payload_about(payload: str) -> tuple[str, str]:
    """The id and type of an encoded event ("?" where it has none)."""
    try:
        parsed = parse_json(payload)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return "?", "?"
    return str(parsed.get("id", "?")), str(parsed.get("type", "?"))


def payload_partition(payload: str) -> str | None:
    """The ``partitionkey`` extension of an encoded event (None: none, or not a string)."""
    try:
        parsed = parse_json(payload)
    except ValueError:
        return None
    found = parsed.get("partitionkey") if isinstance(parsed, dict) else None
    return found if isinstance(found, str) and found else None


def key_of(event: CloudEvent) -> str:
    return event_key(event.get_source(), event.get_id())


def _uuid5(name: str) -> str:
    """``uuid.uuid5`` in the namespace of WorkManager's ids, for any text: a lone surrogate
    (which ``uuid5`` cannot encode) is hashed as its own code point, so ids that differ only
    there still get different keys; valid text gets ``uuid5``'s id. Spelt out (version and
    variant bits set on the digest, formatted as hex): a third of ``uuid.UUID``'s time, and
    every delivery derives two to four of them."""
    hashed = _NAMESPACE_SHA1.copy()
    hashed.update(name.encode("utf-8", "surrogatepass"))
    raw = bytearray(hashed.digest()[:16])
    raw[6] = raw[6] & 0x0F | 0x50  # version 5
    raw[8] = raw[8] & 0x3F | 0x80  # RFC 4122 variant
    x = raw.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


def derive_id(input_key: str, worker_id: str, index: int) -> str:
    """Deterministic output id: the same input (its key), worker and position give the
    same id."""
    return _uuid5(f"{input_key}\x00{worker_id}\x00{index}")


def lifecycle_event(
    kind: str, worker_id: str, data: Mapping[str, Any], *, event_id: str | None = None
) -> CloudEvent:
    """A ``com.virtufin.workmanager.lifecycle.<kind>`` event about one worker."""
    payload = {"worker_id": worker_id, **data}
    return make_event(
        LIFECYCLE_TYPE_PREFIX + kind,
        LIFECYCLE_SOURCE,
        payload,
        id=event_id,
        subject=worker_id,
    )


def infra_event(kind: str, subject: str, data: Mapping[str, Any]) -> CloudEvent:
    """A ``com.virtufin.workmanager.infra.<kind>`` event about a node or a group."""
    return make_event(INFRA_TYPE_PREFIX + kind, LIFECYCLE_SOURCE, dict(data), subject=subject)
