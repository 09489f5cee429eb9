"""Frames between the host and the sandboxed runner.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON: an object
whose ``"op"`` names the frame. Frames travel over two dedicated pipes (host → child and
child → host), never over the child's stdout/stderr, so ``print`` in worker code cannot
corrupt the protocol. CloudEvents inside frames are in structured mode, spliced in as the
bytes the ``cloudevents`` JSON format writes, so an event is serialised once per hop.

Host → child: ``init`` (launch configuration and code), ``event``, ``probe`` (run the
worker's health probe), ``gateway_reply``.
Child → host: ``ready`` (says whether the code has a probe), ``invalid``, ``result``,
``probe_result``, ``error``, ``log``, ``gateway``.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

HEADER = struct.Struct("!I")
#: bytes; a larger frame is a protocol violation (events are limited far below this).
MAX_FRAME_BYTES = 256 * 1024 * 1024
#: bytes read per os.read call.
READ_CHUNK_BYTES = 1024 * 1024

_FORMAT = JSONFormat()


class FrameError(Exception):
    """Raised when a frame is truncated, too large or not a JSON object with an ``op``."""


def pack(message: dict[str, Any]) -> bytes:
    """One frame holding ``message`` as compact JSON."""
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return pack_body(body)


def pack_body(body: bytes) -> bytes:
    """One frame around an already encoded JSON body."""
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    """The JSON object of a frame body; anything else is a :class:`FrameError`."""
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise FrameError(f"frame is not JSON: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise FrameError("frame is not a JSON object with an 'op'")
    return message


class FrameBuffer:
    """Reassembles frames from arbitrary chunks of a byte stream."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add ``chunk``; return the bodies of the frames it completed, in order."""
        self._buffer += chunk
        bodies: list[bytes] = []
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            if size > MAX_FRAME_BYTES:
                raise FrameError(f"announced frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
            end = HEADER.size + size
            if len(self._buffer) < end:
                break
            bodies.append(bytes(self._buffer[HEADER.size : end]))
            del self._buffer[:end]
        return bodies


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a blocking ``fd``."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class BlockingChannel:
    """The child's end: blocking reads and writes on its two protocol pipes."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._buffer = FrameBuffer()
        self._pending: list[bytes] = []

    def send(self, message: dict[str, Any]) -> None:
        write_all(self._write_fd, pack(message))

    def send_body(self, body: bytes) -> None:
        write_all(self._write_fd, pack_body(body))

    def receive(self) -> dict[str, Any] | None:
        """The next message, or None when the host closed the pipe."""
        while not self._pending:
            chunk = os.read(self._read_fd, READ_CHUNK_BYTES)
            if not chunk:
                return None
            self._pending.extend(self._buffer.feed(chunk))
        return unpack(self._pending.pop(0))


def event_body(event: CloudEvent) -> bytes:
    """Body of an ``event`` frame (host → child)."""
    return b'{"op":"event","event":' + _FORMAT.write(event) + b"}"


def result_body(events: Iterable[CloudEvent], cpu_s: float, done: str | None = None) -> bytes:
    """Body of a ``result`` frame (child → host); ``done``: the worker declared it is done
    (``wm.devkit.done``), for this reason."""
    encoded = b",".join(_FORMAT.write(event) for event in events)
    tail = b"" if done is None else b',"done":' + json.dumps(done).encode("utf-8")
    return b'{"op":"result","cpu_s":%.3f,"events":[%s]%s}' % (cpu_s, encoded, tail)


def event_from_json(obj: Any) -> CloudEvent:
    """A CloudEvent from its structured-mode JSON object (as ``JSONFormat.read`` does)."""
    if not isinstance(obj, dict):
        raise FrameError("event is not a JSON object")
    attributes = dict(obj)
    data = attributes.pop("data", None)
    data_base64 = attributes.pop("data_base64", None)
    if data is None and data_base64 is not None:
        data = base64.b64decode(data_base64)
    if isinstance(attributes.get("time"), str):
        try:
            attributes["time"] = datetime.fromisoformat(attributes["time"])
        except ValueError as exc:
            raise FrameError(f"event time is not ISO 8601: {exc}") from exc
    return CloudEvent(attributes, data)
