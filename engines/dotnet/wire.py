"""Events between Python and the host helper (``csharp/Host/Host.cs``), as UTF-8 bytes in
and out: the event crosses through the host's function pointer (``Host.ProcessCall``; the
crossing costs a third of pythonnet's call with strings), and the answer comes back as
UTF-8 in a buffer the caller owns.

Request: a header of the fields ``id, source, type, subject, datacontenttype,
time, data kind`` then extension names and values, all joined by NUL; the data as a second
buffer. Data kinds: ``j`` JSON text, ``t`` text, ``b`` base64 bytes, ``n`` none. A UTC time
crosses as ``@`` and its microseconds since the Unix epoch, any other as its text.

Answer: ``none`` (no output), ``error\\0<.NET exception type>\\0<message>``,
``pending\\0<call>`` (an unfinished task), or ``ok`` then ``id, source, type, subject,
datacontenttype, time, data kind, answered-error flag (empty: none; ``1``: an error the
worker answered with; else the .NET type of the exception a ``CommandWorker`` answered),
answered-error message, extension count``, the extension names and values, and the data last
(it may hold NUL).

A health probe (``Host.Probe``) answers ``noprobe`` (the worker has none), ``healthy``,
``unhealthy``, ``error…`` or ``pending…`` as above.

An isolated worker's helper gets a :class:`Request`: an event to process or the probe to run.
"""

from __future__ import annotations

import base64
import re
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from wm.errors import EventDecodeError, WorkerExecutionError
from wm.events import CloudEvent, json_writer, parse_json

SEP = "\0"
_CORE = frozenset(("id", "source", "type", "specversion", "subject", "datacontenttype", "time"))
_dumps = json_writer(separators=(",", ":"))
_HEAD_FIELDS = 10
_EPOCH, _MICROSECOND = datetime(1970, 1, 1, tzinfo=UTC), timedelta(microseconds=1)
#: A request to an isolated worker's helper: its kind, the event header's length in bytes,
#: the time limit in ms; then the event's header and data (nothing for a probe).
_REQUEST = struct.Struct("<cIQ")
#: The kinds of :class:`Request`.
EVENT, PROBE = b"E", b"P"
_PROBE_ANSWERS = {"noprobe": None, "healthy": True, "unhealthy": False}


def encode_event(event: CloudEvent) -> tuple[bytes, bytes]:
    """The header and data of ``event`` in UTF-8; EventDecodeError when an attribute holds
    a NUL (it could not be told apart from the separator) or text holds a lone surrogate
    (it has no UTF-8 form, nor a .NET string's)."""
    attributes = event.get_attributes()
    content_type = attributes.get("datacontenttype") or ""
    kind, text = _body(event.get_data(), content_type)
    time = attributes.get("time")
    fields = [
        attributes["id"],
        attributes["source"],
        attributes["type"],
        attributes.get("subject") or "",
        content_type,
        "" if time is None else _time_field(time),
        kind,
    ]
    if not _CORE.issuperset(attributes):  # extensions, in order of their names
        names = [name for name in attributes if name not in _CORE]
        names.sort()
        for name in names:
            value = attributes[name]
            if type(value) is str:
                fields += (name, value)
            elif value is not None:
                fields += (name, _text(value))
    header = SEP.join(fields)
    if header.count(SEP) != len(fields) - 1:
        raise EventDecodeError(
            f"event {attributes['id']} has an attribute holding a NUL character, which a .NET "
            "worker cannot receive"
        )
    try:
        return header.encode(), text.encode()
    except UnicodeEncodeError as exc:
        raise EventDecodeError(
            f"event {attributes['id']} holds a lone surrogate ({exc.object[exc.start]!r}), "
            "which a .NET worker cannot receive"
        ) from None


def _body(data: Any, content_type: str) -> tuple[str, str]:
    """The data's kind (see the module's docstring) and its text."""
    if data is None:
        return "n", ""
    if isinstance(data, bytes | bytearray):
        return "b", base64.b64encode(data).decode("ascii")
    if isinstance(data, str):
        return ("j" if _is_json(content_type) else "t"), data
    return "j", _dumps(data)


def _time_field(value: Any) -> str:
    """The header's time: a UTC datetime as ``@`` and its microseconds since the epoch (the
    host writes its text only when the worker reads it; ``isoformat`` was a quarter of the
    encoding), any other as its text."""
    if type(value) is datetime and value.tzinfo is UTC:
        return f"@{(value - _EPOCH) // _MICROSECOND}"
    return _text(value)


def _text(value: Any) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


class Answer(NamedTuple):
    """A decoded answer: the output (or None), the error the worker answered with through
    ``WorkerBase.Error`` (or None). (A tuple: a frozen dataclass took a sixth of the
    decode to build.)"""

    event: CloudEvent | None
    answered_error: str | None = None
    #: The .NET type of the exception answered with ``answered_error`` (None: the worker's own).
    answered_error_type: str | None = None


class WorkerFailed(Exception):
    """The worker's code threw: ``error_type`` is the .NET exception's full type name."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class _CheckedCloudEvent(CloudEvent):
    """An output whose attributes :func:`decode_answer` checked itself: the SDK's check
    would cost a third of the decode, and the delivery validates every output again when
    it stamps it."""

    @staticmethod
    def _validate_attribute(attributes: dict[str, Any]) -> None:
        pass


def _attributes(
    event_id: str,
    source: str,
    event_type: str,
    subject: str,
    content_type: str,
    time: str,
    kind: str,
) -> dict[str, Any]:
    """An output's context attributes; EventDecodeError without an id, source or type."""
    if not (event_id and source and event_type):
        missing = [
            n for n, v in (("Id", event_id), ("Source", source), ("Type", event_type)) if not v
        ]
        raise EventDecodeError(f"the .NET worker's output has no {' or '.join(missing)}")
    attributes: dict[str, Any] = {
        "id": event_id,
        "source": source,
        "type": event_type,
        "specversion": "1.0",
        "time": _time(time) if time else datetime.now(UTC),
    }
    if subject:
        attributes["subject"] = subject
    if content_type:
        attributes["datacontenttype"] = content_type
    elif kind == "j":
        attributes["datacontenttype"] = "application/json"
    return attributes


def decode_answer(answer: str) -> Answer:
    """The output of an ``ok`` or ``none`` answer; :class:`WorkerFailed` for ``error``;
    EventDecodeError for an output that is no valid CloudEvent."""
    if answer == "none":
        return Answer(None)
    status, _, rest = answer.partition(SEP)
    if status == "error":
        error_type, _, message = rest.partition(SEP)
        raise WorkerFailed(error_type, message)
    if status != "ok":
        raise ValueError(f"unexpected answer from the .NET host: {status[:40]!r}")
    head = rest.split(SEP, _HEAD_FIELDS)
    if len(head) <= _HEAD_FIELDS:
        raise ValueError(
            f"the answer holds {len(head)} of the {_HEAD_FIELDS + 1} fields of an output"
        )
    event_id, source, event_type, subject, content_type, time, kind, flag, error, count, text = head
    attributes = _attributes(event_id, source, event_type, subject, content_type, time, kind)
    pairs = int(count)
    plain = True
    if pairs:  # names and values, then the data
        fields = text.split(SEP, 2 * pairs)
        if len(fields) != 2 * pairs + 1:
            raise ValueError(f"the answer holds fewer than the {pairs} extensions it announces")
        text = fields.pop()
        names = fields[::2]
        plain = _PLAIN_EXTENSION.issuperset(names) or all(map(_plain_extension, names))
        attributes.update(zip(names, fields[1::2], strict=True))
    data = _data(kind, text)
    if plain:
        event: CloudEvent = _CheckedCloudEvent(attributes, data)
    else:
        try:
            event = CloudEvent(attributes, data)
        except Exception as exc:  # the SDK raises several types for bad attributes
            raise EventDecodeError(
                f"the .NET worker's output is not a valid CloudEvent: {exc}"
            ) from exc
    return Answer(event, error if flag else None, flag if flag not in ("", "1") else None)


#: Extension names already seen to be plain: lower-case letters and digits, no attribute
#: the CloudEvents spec defines (those the SDK checks in full).
_PLAIN_EXTENSION: set[str] = set()
_NAME = re.compile(r"[a-z0-9]+")
_DEFINED = frozenset({*_CORE, "data", "dataschema", "data_base64"})


def _plain_extension(name: str) -> bool:
    if name in _DEFINED or not _NAME.fullmatch(name):
        return False
    if len(_PLAIN_EXTENSION) < 1024:
        _PLAIN_EXTENSION.add(name)
    return True


def _time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise EventDecodeError(f"the .NET worker's output has an invalid Time: {exc}") from None
    if value.tzinfo is None:
        raise EventDecodeError(f"the .NET worker's output Time {text!r} has no time zone")
    return value


def _data(kind: str, text: str) -> Any:
    if kind == "j":
        try:
            return parse_json(text)
        except ValueError as exc:
            raise EventDecodeError(f"the .NET worker's output data is not JSON: {exc}") from exc
    if kind == "b":
        return base64.b64decode(text)
    return text if kind == "t" else None


def decode_probe(answer: str) -> bool | None:
    """What a probe answered: None (no probe), True or False; :class:`WorkerFailed` when it
    threw, ValueError for an answer no probe gives."""
    if answer in _PROBE_ANSWERS:
        return _PROBE_ANSWERS[answer]
    status, _, rest = answer.partition(SEP)
    if status == "error":
        error_type, _, message = rest.partition(SEP)
        raise WorkerFailed(error_type, message)
    raise ValueError(f"unexpected answer to a probe from the .NET host: {status[:40]!r}")


@dataclass(frozen=True)
class Request:
    """What the host asks an isolated worker's helper: process an event (``EVENT``, its
    header and data) or run the probe (``PROBE``), within ``limit_ms``."""

    kind: bytes
    limit_ms: int
    header: bytes = b""
    data: bytes = b""

    def encode(self) -> bytes:
        return _REQUEST.pack(self.kind, len(self.header), self.limit_ms) + self.header + self.data

    @classmethod
    def decode(cls, payload: bytes) -> Request:
        """The request in ``payload``; WorkerExecutionError when it is none (the host and
        the helper are of different versions)."""
        try:
            kind, length, limit_ms = _REQUEST.unpack_from(payload)
            start = _REQUEST.size
            header, data = payload[start : start + length], payload[start + length :]
        except struct.error as exc:
            raise WorkerExecutionError(f"the .NET helper got an unreadable request: {exc}") from exc
        if kind not in (EVENT, PROBE):
            raise WorkerExecutionError(f"the .NET helper got a request of unknown kind {kind!r}")
        return cls(kind, limit_ms, header, data)
