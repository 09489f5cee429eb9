"""The FlatBuffers wire format of the native ABI (``native_abi/worker_api.fbs``), by hand.

A native worker is called once per event, so the codec is on the hot path: the generated
Python builder costs ~95 µs per event, this codec a few. It writes exactly the bytes that
``flatc -b`` writes for the same fields in schema order (objects created in field order,
back to front, every string padded after its terminator, one vtable shared by all
``Extension`` tables), which the tests check byte for byte. Every string sits on a 4-byte
boundary whatever came before it, so a string's bytes depend on the string alone and the
recurring ones (source, type, extension keys) are cached.

Reading trusts nothing: every offset, length and vtable is checked against the buffer, so
a malformed answer raises :class:`CodecError` and never another exception, an endless loop
or a large allocation.
"""

from __future__ import annotations

import base64
import re
import struct
from datetime import datetime
from operator import sub
from typing import Any, Final, NamedTuple

from cloudevents.core.v1.event import CloudEvent

from wm.events import json_writer, parse_json, rfc3339

__all__ = ["CodecError", "Encoder", "Response", "decode_response", "encode_event"]


class CodecError(ValueError):
    """Raised when an event cannot be written as a FlatBuffer (its data is not
    JSON-serializable) or a worker's answer is not a well-formed WorkerResponse; the
    message names the defect."""


class Response(NamedTuple):
    """A worker's answer: exactly one of ``event`` and ``error`` is set. A named tuple, so
    ``event, error = decode_response(buf)`` works too."""

    event: CloudEvent | None
    error: str | None


#: Strings of these fields recur from event to event (per worker, per topic).
_RECURRING: Final = frozenset({"source", "type", "specversion", "datacontenttype"})
#: CloudEvent string fields in schema order: (field id, attribute name, cached).
_STRING_FIELDS: Final = tuple(
    (1 << index, name, name in _RECURRING)
    for index, name in enumerate(
        ("id", "source", "type", "specversion", "datacontenttype", "subject")
    )
)
#: The same for reading: (field id, attribute name, what an error message calls it).
_READ_FIELDS: Final = tuple(
    (bit.bit_length() - 1, name, f"result_event.{name}") for bit, name, _ in _STRING_FIELDS
)
_TIME, _DATA, _EXTENSIONS = 6, 7, 8
_TIME_BIT, _DATA_BIT, _EXTENSIONS_BIT = 1 << _TIME, 1 << _DATA, 1 << _EXTENSIONS
#: Number of CloudEvent fields this codec knows; later ones (added to the schema at the
#: end) are ignored when reading.
_CE_FIELDS: Final = 9
#: Attributes that are table fields; every other attribute travels as an extension.
_FIELD_NAMES: Final = frozenset(name for _, name, _ in _STRING_FIELDS) | {"time"}
#: Strings cached per Encoder before the cache is emptied and starts over.
DEFAULT_CACHE_SIZE: Final = 256

_U32 = struct.Struct("<I")
_u32 = _U32.unpack_from
_I32 = struct.Struct("<i")
_i32 = _I32.unpack_from
_u16 = struct.Struct("<H").unpack_from
#: The first Extension table and its vtable: 8-byte vtable of a 12-byte table whose key is
#: at offset 4 and value at 8, then the table (soffset 8: its vtable right before it).
_FIRST_EXTENSION = struct.Struct("<HHHHiII")
#: An Extension's vtable with both fields: its size, its table's, the key's and value's offsets.
_PAIR_VTABLE = struct.Struct("<HHHH")
_NEXT_EXTENSION = struct.Struct("<iII")
#: A string's terminator and padding to the next 4-byte boundary, by ``len & 3``.
_STRING_TAIL: Final = (b"\0\0\0\0", b"\0\0\0", b"\0\0", b"\0")
#: A byte vector's padding to the next 4-byte boundary, by ``len & 3``.
_VECTOR_TAIL: Final = (b"", b"\0\0\0", b"\0\0", b"\0")
#: Packers of an offset vector (length, then offsets) by length.
_U32S: Final = tuple(struct.Struct(f"<{n + 1}I") for n in range(8))
_U16S: Final = tuple(struct.Struct(f"<{n}H") for n in range(_CE_FIELDS + 1))
_ZEROS: Final = tuple((0,) * n for n in range(_CE_FIELDS + 1))
#: A vtable's field offsets and its table's size, by the vtable's bytes and the number of
#: fields read (bounded like the Encoder's cache; see ``_fields``).
_Layout = tuple[tuple[int, ...], int]
_LAYOUTS: dict[tuple[bytes, int], _Layout] = {}
#: The largest vtable cached: this schema's take at most 22 bytes (a hostile answer's may
#: take 64 KiB, and is read every time).
_CACHED_VTABLE_BYTES: Final = 64
_EXTENSION_NAME = re.compile(r"[a-z0-9]+")
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
#: How data is read back, by datacontenttype (bounded like the Encoder's cache).
_BYTES, _TEXT, _JSON_DATA = 0, 1, 2
_DATA_KINDS: dict[str, int] = {}
#: Extension keys already found valid (bounded like the Encoder's cache).
_KEYS_SEEN: set[str] = set()


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return rfc3339(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


#: Data as the SDK's JSON format writes it, compact and UTF-8 (a circular value recurses
#: into a RecursionError, which is reported like any other unserializable data).
_write_json = json_writer(
    ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_json_default
)


def _string(text: str) -> bytes:
    """A string object: length, UTF-8 bytes, terminator, padding to 4 bytes."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CodecError(f"{text!r} cannot be written as UTF-8: {exc.reason}") from exc
    return _U32.pack(len(raw)) + raw + _STRING_TAIL[len(raw) & 3]


def _canonical(value: object) -> str:
    """An extension value in the CloudEvents canonical string form."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return rfc3339(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(value).decode("ascii")
    return str(value)


def _data_bytes(data: object) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    try:
        return (data if isinstance(data, str) else _write_json(data)).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise CodecError(f"data cannot be written as UTF-8 or JSON: {exc}") from exc


class _Head(NamedTuple):
    """Root offset, padding, vtable and soffset of a CloudEvent with a given set of fields,
    and the packer of its field offsets."""

    prefix: bytes
    offsets: struct.Struct


def _head(mask: int) -> _Head:
    present = [index for index in range(_CE_FIELDS) if mask >> index & 1]
    slots = [0] * (present[-1] + 1)
    for position, index in enumerate(present):
        slots[index] = 4 + 4 * position
    vtable_size = 4 + 2 * len(slots)
    pad = vtable_size & 3
    root = 4 + pad + vtable_size
    prefix = struct.pack(
        f"<I{pad}x{len(slots) + 2}Hi", root, vtable_size, 4 + 4 * len(present), *slots, vtable_size
    )
    return _Head(prefix, struct.Struct(f"<{len(present)}I"))


_HEADS: Final = tuple(_head(mask) if mask & 7 == 7 else None for mask in range(1 << _CE_FIELDS))


class Encoder:
    """Writes CloudEvents as FlatBuffers, caching the encoded form of recurring strings.

    One per worker: its source, types and extension keys repeat from event to event. The
    cache holds at most ``cache_size`` strings and starts over when full.
    """

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._cache_size = cache_size
        self._strings: dict[str, bytes] = {}

    def _cached(self, text: str) -> bytes:
        chunk = self._strings.get(text)
        if chunk is None:
            if len(self._strings) >= self._cache_size:
                self._strings.clear()
            chunk = self._strings[text] = _string(text)
        return chunk

    def encode(self, event: CloudEvent) -> bytes:
        """The FlatBuffer of ``event``; its root is a ``virtufin.worker.CloudEvent``."""
        attributes = event.get_attributes()
        # Written back to front like flatc: ``chunks`` are reversed at the end (so an object
        # of several chunks appends its last one first), ``size`` is the newest object's
        # distance from the end of the buffer and ``ends`` holds each field's.
        chunks: list[bytes] = []
        ends: list[int] = []
        size = mask = 0
        cache = self._strings
        for bit, name, recurring in _STRING_FIELDS:
            value = attributes.get(name)
            if value is not None:
                chunk = (cache.get(value) or self._cached(value)) if recurring else _string(value)
                chunks.append(chunk)
                size += len(chunk)
                ends.append(size)
                mask |= bit
        time = attributes.get("time")
        if time is not None:
            chunks.append(_string(rfc3339(time) if isinstance(time, datetime) else str(time)))
            size += len(chunks[-1])
            ends.append(size)
            mask |= _TIME_BIT
        fields = len(ends)
        data = event.get_data()
        if data is not None:
            raw = _data_bytes(data)
            chunks += (_VECTOR_TAIL[len(raw) & 3], raw, _U32.pack(len(raw)))
            size += (len(raw) + 7) & ~3
            ends.append(size)
            mask |= _DATA_BIT
        if len(attributes) > fields:  # attributes not written yet are extensions
            grown = self._extensions(attributes, chunks, size)
            if grown != size:
                size = grown
                ends.append(size)
                mask |= _EXTENSIONS_BIT
        return self._finish(mask, chunks, ends, size)

    def _extensions(self, attributes: dict[str, Any], chunks: list[bytes], size: int) -> int:
        """Write the Extension tables and their vector; return the new size (unchanged when
        every extension is None)."""
        tables: list[int] = []
        vtable = 0
        for name in sorted(attributes.keys() - _FIELD_NAMES):
            value = attributes[name]
            if value is None:
                continue
            key = self._strings.get(name) or self._cached(name)
            text = _string(value if type(value) is str else _canonical(value))
            size += len(key) + len(text)
            chunks += (key, text)
            table = size + 12
            if vtable:
                chunks.append(_NEXT_EXTENSION.pack(vtable - table, 8 + len(text), 4))
                size = table
            else:
                chunks.append(_FIRST_EXTENSION.pack(8, 12, 4, 8, 8, 8 + len(text), 4))
                size = vtable = table + 8
            tables.append(table)
        if tables:
            size += 4 + 4 * len(tables)
            count = len(tables)
            packer = _U32S[count] if count < 8 else struct.Struct(f"<{count + 1}I")
            # table i (from 1) is referred to from size - 4 * i
            chunks.append(
                packer.pack(count, *map(sub, range(size - 4, size - 4 * count - 4, -4), tables))
            )
        return size

    @staticmethod
    def _finish(mask: int, chunks: list[bytes], ends: list[int], size: int) -> bytes:
        head = _HEADS[mask]
        if head is None:
            missing = [name for bit, name, _ in _STRING_FIELDS[:3] if not mask & bit]
            raise CodecError(f"event lacks required attribute(s): {', '.join(missing)}")
        # With the table's fields written, field j (schema order) is size - 4 * j from the end.
        size += 4 * len(ends)
        chunks.append(head.offsets.pack(*map(sub, range(size, 0, -4), ends)))
        chunks.append(head.prefix)
        chunks.reverse()
        return b"".join(chunks)


_ENCODER = Encoder()


def encode_event(event: CloudEvent) -> bytes:
    """The FlatBuffer of ``event`` (root ``virtufin.worker.CloudEvent``), with a shared cache."""
    return _ENCODER.encode(event)


def decode_response(buf: bytes | memoryview) -> Response:
    """Read a worker's ``WorkerResponse``; any defect raises :class:`CodecError`.

    The result event's data is parsed per its datacontenttype: JSON (``application/json``
    or ``…+json``) into its value, ``text/*`` into a str, anything else (or none) stays bytes.
    """
    if type(buf) is not bytes:
        buf = bytes(buf)
    size = len(buf)
    if size < 8:
        raise CodecError(f"WorkerResponse: a {size}-byte buffer is too short for a FlatBuffer")
    root = _u32(buf, 0)[0]
    if root + 4 > size:
        raise CodecError(f"WorkerResponse: root offset {root} is outside the {size}-byte buffer")
    event_at, error_at = _fields(buf, root, 2, "WorkerResponse")
    if event_at and error_at:
        raise CodecError("WorkerResponse: both result_event and error_message are set")
    if error_at:
        return Response(None, _string_at(buf, root + error_at, "WorkerResponse.error_message"))
    if not event_at:
        raise CodecError("WorkerResponse: neither result_event nor error_message is set")
    at = root + event_at
    return Response(_event(buf, at + _u32(buf, at)[0]), None)


def _fields(buf: bytes, table: int, count: int, what: str) -> tuple[int, ...]:
    """The offsets of the first ``count`` fields of the table at ``table``, checked against
    the buffer. A vtable's reading is cached by its bytes: writers that do not share vtables
    (the C DevKit's builder gives each Extension table its own) repeat the same few."""
    size = len(buf)
    if table + 4 > size:
        raise CodecError(f"{what}: table offset {table} is outside the {size}-byte buffer")
    vtable = table - _i32(buf, table)[0]
    if vtable < 0 or vtable + 4 > size:
        raise CodecError(f"{what}: vtable offset {vtable} is outside the {size}-byte buffer")
    vtable_size = _u16(buf, vtable)[0]
    raw = buf[vtable : vtable + vtable_size]
    layout = _LAYOUTS.get((raw, count))
    if layout is None:
        layout = _layout(raw, vtable, vtable_size, count, what)
    fields, table_size = layout
    if table + table_size > size:
        raise CodecError(f"{what}: table of {table_size} bytes at {table} overruns the buffer")
    return fields


def _layout(raw: bytes, vtable: int, vtable_size: int, count: int, what: str) -> _Layout:
    """Read and check a vtable (``raw``: its bytes, short when it overruns the buffer)."""
    if vtable_size < 4 or vtable_size & 1 or len(raw) < vtable_size:
        raise CodecError(f"{what}: vtable of {vtable_size} bytes at {vtable} is malformed")
    table_size = _u16(raw, 2)[0]
    if table_size < 4:
        raise CodecError(f"{what}: table of {table_size} bytes is too small")
    present = min((vtable_size - 4) >> 1, count)
    fields = _U16S[present].unpack_from(raw, 4) + _ZEROS[count - present]
    if max(fields) > table_size - 4:
        raise CodecError(f"{what}: a field lies outside its {table_size}-byte table")
    layout = (fields, table_size)
    if vtable_size <= _CACHED_VTABLE_BYTES:
        if len(_LAYOUTS) >= DEFAULT_CACHE_SIZE:
            _LAYOUTS.clear()
        _LAYOUTS[(raw, count)] = layout
    return layout


def _text(buf: bytes, at: int, what: str) -> str:
    """The string the offset at ``at`` refers to."""
    size = len(buf)
    start = at + _u32(buf, at)[0]
    if start + 4 > size:
        raise CodecError(f"{what}: string offset {start} is outside the {size}-byte buffer")
    end = start + 4 + _u32(buf, start)[0]
    if end >= size or buf[end]:
        raise CodecError(f"{what}: string at {start} overruns the buffer or lacks its terminator")
    try:
        return buf[start + 4 : end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CodecError(f"{what}: string is not valid UTF-8 ({exc.reason})") from exc


class _DecodedCloudEvent(CloudEvent):
    """A CloudEvent whose attributes this codec has already checked against the rules the
    SDK's constructor enforces (the tests run the SDK's check on every decoded event); the
    constructor's own check would cost a quarter of the decode time."""

    @staticmethod
    def _validate_attribute(attributes: dict[str, Any]) -> None:
        pass


def _string_at(buf: bytes, where: int, what: str) -> str:
    """The string the offset at ``where`` refers to: the checks of :func:`_text` done by
    the reads themselves (an offset past the end fails ``unpack_from``, a missing terminator
    the index), and :func:`_text` called only to name a defect."""
    try:
        start = where + _u32(buf, where)[0] + 4
        end = start + _u32(buf, start - 4)[0]
        if not buf[end]:
            return buf[start:end].decode("utf-8")
    except (struct.error, IndexError, UnicodeDecodeError):
        pass
    return _text(buf, where, what)


def _event(buf: bytes, at: int) -> CloudEvent:
    fields = _fields(buf, at, _CE_FIELDS, "result_event")
    if not (fields[0] and fields[1] and fields[2]):
        missing = ("id", "source", "type")[fields.index(0)]
        raise CodecError(f"result_event: required field {missing!r} is missing")
    attributes: dict[str, Any] = {}
    for index, name, what in _READ_FIELDS:
        if offset := fields[index]:
            where = at + offset
            try:  # _string_at, inline: every answer reads its fields here
                start = where + _u32(buf, where)[0] + 4
                end = start + _u32(buf, start - 4)[0]
                text = "" if buf[end] else buf[start:end].decode("utf-8")
            except (struct.error, IndexError, UnicodeDecodeError):
                text = ""
            if not text and not (text := _text(buf, where, what)):
                raise CodecError(f"result_event: {name!r} is empty")
            attributes[name] = text
    specversion = attributes.setdefault("specversion", "1.0")
    if specversion != "1.0":
        raise CodecError(f"result_event: specversion {specversion!r} is not 1.0")
    if offset := fields[_TIME]:
        attributes["time"] = _time(_string_at(buf, at + offset, "result_event.time"))
    if offset := fields[_EXTENSIONS]:
        _extensions_into(attributes, buf, at + offset)
        if attributes.get("dataschema") == "":
            raise CodecError("result_event: 'dataschema' is empty")
    data = _data(buf, at + fields[_DATA], attributes) if fields[_DATA] else None
    return _DecodedCloudEvent(attributes, data)


def _time(text: str) -> datetime:
    if _RFC3339.fullmatch(text):
        try:
            return datetime.fromisoformat(text.upper())
        except ValueError:
            pass
    raise CodecError(f"result_event: time {text!r} is not an RFC 3339 timestamp")


def _vector(buf: bytes, at: int, width: int, what: str) -> tuple[int, int]:
    """Position of the first element and length of the vector the offset at ``at`` refers to."""
    start = at + _u32(buf, at)[0]
    if start + 4 > len(buf):
        raise CodecError(f"{what}: vector offset {start} is outside the {len(buf)}-byte buffer")
    length = _u32(buf, start)[0]
    if start + 4 + length * width > len(buf):
        raise CodecError(f"{what}: vector of {length} elements at {start} overruns the buffer")
    return start + 4, length


class _Unusual(Exception):
    """A shape the fast reading of extensions leaves to the checked one."""


def _extensions_into(attributes: dict[str, Any], buf: bytes, at: int) -> None:
    """The extensions vector at ``at`` read into ``attributes``: in one pass where every
    table's vtable holds exactly its two fields, every key was seen valid before, and no
    check fails (an answer's usual shape); anything else is read again by
    :func:`_extensions_checked`, which names the defect. Both accept the same buffers and
    read the same values (the tests compare them on fuzzed and edited buffers)."""
    try:
        found = _extensions_usual(buf, at)
    except (_Unusual, CodecError, struct.error, IndexError, UnicodeDecodeError):
        _extensions_checked(attributes, buf, at)
        return
    attributes.update(found)


def _extensions_usual(buf: bytes, at: int) -> dict[str, str]:
    """The one pass of :func:`_extensions_into`: :class:`_Unusual`, a :class:`CodecError` or
    the error of a read outside the buffer where it leaves the buffer to the checked
    reading. Every position read is a sum of unsigned offsets but a vtable's, checked not
    to be negative (``unpack_from`` reads a negative offset from the end)."""
    size = len(buf)
    found: dict[str, str] = {}
    start = at + _u32(buf, at)[0]
    end = start + 4 + 4 * _u32(buf, start)[0]
    if end > size:
        raise _Unusual
    budget = size  # as in _extensions_checked
    shared: dict[int, str] = {}
    for element in range(start + 4, end, 4):
        table = element + _u32(buf, element)[0]
        key_at, value_at = _pair_fields(buf, table, size)
        key = _string_at(buf, table + key_at, "key")
        if key not in _KEYS_SEEN or key in found:  # a key seen valid is no core attribute
            raise _Unusual
        budget -= len(key)
        value = ""
        if value_at:
            where = table + value_at
            text = where + _u32(buf, where)[0]
            if text in shared:
                value = shared[text]
            else:
                value = shared[text] = _string_at(buf, where, "value")
                budget -= len(value)
        if budget < 0:
            raise _Unusual
        found[key] = value
    return found


def _pair_fields(buf: bytes, table: int, size: int) -> tuple[int, int]:
    """The key's and value's offsets in the Extension table at ``table``, where its vtable
    holds both fields and no more, the key is set, and both lie inside the table."""
    vtable = table - _i32(buf, table)[0]
    if vtable < 0:
        raise _Unusual
    vtable_size, table_size, key_at, value_at = _PAIR_VTABLE.unpack_from(buf, vtable)
    if (
        vtable_size != 8
        or not key_at
        or key_at > table_size - 4
        or value_at > table_size - 4
        or table + table_size > size
    ):
        raise _Unusual
    return key_at, value_at


def _extensions_checked(attributes: dict[str, Any], buf: bytes, at: int) -> None:
    """:func:`_extensions_into` one check at a time: a defect raises a :class:`CodecError`
    that names the extension and the defect."""
    first, length = _vector(buf, at, 4, "result_event.extensions")
    # A string shared by several extensions is read once. Other strings never overlap in a
    # well-formed buffer, so more text than the buffer holds means a hostile one.
    budget = len(buf)
    shared: dict[int, str] = {}
    element = first
    try:
        for element in range(first, first + 4 * length, 4):
            table = element + _u32(buf, element)[0]
            key_at, value_at = _fields(buf, table, 2, "table")
            if not key_at:
                raise CodecError("required field 'key' is missing")
            key = _string_at(buf, table + key_at, "key")
            if key not in _KEYS_SEEN:
                _check_key(key)
            if key in attributes:
                raise CodecError(f"extension key {key!r} appears twice")
            budget -= len(key)
            value = ""
            if value_at:
                where = table + value_at
                start = where + _u32(buf, where)[0]
                if start in shared:
                    value = shared[start]
                else:
                    value = shared[start] = _string_at(buf, where, "value")
                    budget -= len(value)
            if budget < 0:
                raise CodecError("strings overlap (more text than the buffer holds)")
            attributes[key] = value
    except CodecError as exc:
        index = (element - first) // 4
        raise CodecError(f"result_event.extensions[{index}]: {exc}") from exc


def _check_key(key: str) -> None:
    if not _EXTENSION_NAME.fullmatch(key) or key == "data" or key in _FIELD_NAMES:
        raise CodecError(f"extension key {key!r} is not a valid CloudEvents attribute name")
    if len(_KEYS_SEEN) >= DEFAULT_CACHE_SIZE:
        _KEYS_SEEN.clear()
    _KEYS_SEEN.add(key)


def _data(buf: bytes, at: int, attributes: dict[str, Any]) -> Any:
    start, length = _vector(buf, at, 1, "result_event.data")
    raw = buf[start : start + length]
    kind = _data_kind(attributes.get("datacontenttype"))
    if kind == _BYTES:
        return raw
    try:
        text = raw.decode("utf-8")
        return parse_json(text) if kind == _JSON_DATA else text
    except UnicodeDecodeError as exc:
        raise CodecError(f"result_event.data: string is not valid UTF-8 ({exc.reason})") from exc
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"result_event.data: not valid JSON ({exc})") from exc


def _data_kind(content_type: str | None) -> int:
    if content_type is None:
        return _BYTES
    kind = _DATA_KINDS.get(content_type)
    if kind is None:
        media = content_type.partition(";")[0].strip().lower()
        if media == "application/json" or media.endswith("+json"):
            kind = _JSON_DATA
        else:
            kind = _TEXT if media.startswith("text/") else _BYTES
        if len(_DATA_KINDS) >= DEFAULT_CACHE_SIZE:
            _DATA_KINDS.clear()
        _DATA_KINDS[content_type] = kind
    return kind
