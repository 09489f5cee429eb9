"""The frames between a host and its child process, both sides.

A frame is one kind byte, a little-endian uint32 payload length, then the payload. Frames go
over two pipes of their own (host → child, child → host), whose descriptors the child gets as
its last two arguments: never over its stdin, stdout or stderr, so what its code prints cannot
corrupt them.

Host → child: ``INIT`` (a JSON object, ``\\n``, a blob: what to load and the code),
``CALL`` (a request), ``BATCH`` (a JSON array of requests), ``PROBE`` (run the code's
health probe), ``GATEWAY_REPLY`` (an int32 code, the response). Child → host: ``READY``
(the code loaded), ``ANSWER`` (to a CALL or a PROBE), ``FAILED`` (a JSON object with
``type`` and ``message``: the code refused at INIT, or a failed call or probe), ``LOG``
(an int32 Python logging level, a UTF-8 message), ``GATEWAY`` (a JSON object naming
``service`` and ``method``, ``\\n``, the request).

The child answers INIT with READY or FAILED, each CALL and PROBE with one ANSWER or
FAILED, and a BATCH with one ANSWER or FAILED per request, in order (the host times each);
any number of LOG and GATEWAY frames may come first, each GATEWAY answered by one
GATEWAY_REPLY. What a CALL, an ANSWER, a READY or a probe's answer holds is the engine's
business.

Standard library only: the Python sandbox imports this module before anything else.
"""

from __future__ import annotations

import collections
import json
import os
import select
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

from wm.events import parse_json

HEADER = struct.Struct("<cI")
CODE = struct.Struct("<i")
#: Largest frame either side accepts (a worker's code, or an answer plus slack).
MAX_FRAME_BYTES = 300 * 1024 * 1024
#: Bytes read from a pipe at once: a Linux pipe's default capacity, so one read takes what
#: the pipe holds. ``os.read`` allocates this much before it reads: at 1 MiB, past malloc's
#: mmap threshold, the allocation cost 20 µs a read, on the host's side of every round
#: trip; at 64 KiB, 1 µs.
READ_CHUNK_BYTES = 64 * 1024

# host -> child
INIT = b"I"
CALL = b"C"
BATCH = b"B"
PROBE = b"P"
GATEWAY_REPLY = b"g"
# child -> host
READY = b"R"
ANSWER = b"A"
FAILED = b"F"
LOG = b"L"
GATEWAY = b"G"

#: A frame: its kind and its payload.
Frame = tuple[bytes, bytes]


class FrameError(Exception):
    """Raised when the other side sends something that is not a frame of the protocol (too
    large, of a kind not expected, a payload that does not decode), or closes the pipe."""


def encode(kind: bytes, payload: bytes = b"") -> bytes:
    """One frame."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(
            f"a frame of {len(payload)} bytes is over the {MAX_FRAME_BYTES}-byte limit"
        )
    return HEADER.pack(kind, len(payload)) + payload


def with_header(header: Mapping[str, Any], blob: bytes = b"") -> bytes:
    """An INIT or GATEWAY payload: ``header`` as a line of JSON, then ``blob``."""
    return json.dumps(header, separators=(",", ":")).encode("utf-8") + b"\n" + blob


def split_header(payload: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and the blob of an INIT or GATEWAY payload."""
    line, newline, blob = payload.partition(b"\n")
    if not newline:
        raise FrameError("a payload without its header line")
    return json_object(line), blob


def with_code(code: int, body: bytes) -> bytes:
    """A LOG or GATEWAY_REPLY payload: an int32, then ``body``."""
    return CODE.pack(code) + body


def split_code(payload: bytes) -> tuple[int, bytes]:
    if len(payload) < CODE.size:
        raise FrameError(f"a payload of {len(payload)} bytes has no {CODE.size}-byte code")
    (code,) = CODE.unpack_from(payload)
    return code, payload[CODE.size :]


def json_object(payload: bytes) -> dict[str, Any]:
    """A payload that is one JSON object (FAILED's, and an INIT or GATEWAY header)."""
    try:
        value = parse_json(payload)
    except ValueError as exc:
        raise FrameError(f"a payload is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise FrameError(f"a payload is not a JSON object: {payload[:80]!r}")
    return value


def failure(type_name: str, message: str, **details: Any) -> bytes:
    """A FAILED payload."""
    return json.dumps({"type": type_name, "message": message, **details}).encode("utf-8")


#: Most waits a :class:`Spin` sleeps through at once after a poll that came to nothing.
MAX_SPIN_SKIPS = 64


class Spin:
    """How one side waits for the other's next frame: polling without sleeping for up to
    ``seconds`` first, then asleep.

    A process asleep on a pipe is woken on its own CPU; where that CPU is idle, on a
    virtual machine above all, the wake-up costs tens of µs, and a host asking its child
    one short question pays it twice (the child woken for the question, the host for the
    answer): more than the work on both sides. A side still polling when the frame comes
    takes it at once. It polls only where that pays: after a poll that came to nothing it
    sleeps at once for the next 1, 2, 4 … ``MAX_SPIN_SKIPS`` waits, doubling with each
    such poll in a row (a child whose host has more to do between calls, a worker that
    takes long, a machine with no CPU to spare), until a poll catches its frame. 0 never
    polls."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._skips = 0
        self._penalty = 0

    def wait(self, poll: select.poll, timeout_ms: int) -> list[tuple[int, int]]:
        """``poll.poll(timeout_ms)``, spinning first when that pays."""
        if self._skips:
            self._skips -= 1
        elif self.seconds > 0:
            end = time.perf_counter() + self.seconds
            while True:
                ready = poll.poll(0)
                if ready:
                    self._penalty = 0
                    return ready
                if time.perf_counter() >= end:
                    break
            self._penalty = min(2 * self._penalty or 1, MAX_SPIN_SKIPS)
            self._skips = self._penalty
        return poll.poll(timeout_ms)


class FrameBuffer:
    """Reassembles frames from the chunks a pipe gives."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[Frame]:
        """Add ``chunk``; the frames it completed, in order."""
        self._buffer += chunk
        done: list[Frame] = []
        while len(self._buffer) >= HEADER.size:
            kind, length = HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise FrameError(
                    f"a frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit"
                )
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            done.append((kind, bytes(self._buffer[HEADER.size : end])))
            del self._buffer[:end]
        return done


class Channel:
    """The child's end of the pipes: blocking reads and writes. The loaded code may log or
    call the gateway from threads of its own: frames are written whole, and a gateway call
    holds the pipes until its reply is read."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._read_fd, self._write_fd = read_fd, write_fd
        self._spin = Spin(0.0)
        self._poll = select.poll()
        self._poll.register(read_fd, select.POLLIN)
        self._buffer = FrameBuffer()
        self._pending: collections.deque[Frame] = collections.deque()
        self._sending = threading.Lock()
        self._calling = threading.Lock()

    def receive(self) -> Frame | None:
        """The next frame, or None when the host closed the pipe."""
        while not self._pending:
            if self._spin.seconds > 0:
                self._spin.wait(self._poll, -1)
            chunk = os.read(self._read_fd, READ_CHUNK_BYTES)
            if not chunk:
                return None
            self._pending.extend(self._buffer.feed(chunk))
        return self._pending.popleft()

    def spin(self, seconds: float) -> None:
        """Poll for up to ``seconds`` before sleeping on the next frame (:class:`Spin`): what
        the host's INIT asks."""
        self._spin = Spin(seconds)

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        view = memoryview(encode(kind, payload))
        with self._sending:
            while view:
                view = view[os.write(self._write_fd, view) :]

    def log(self, level: int, message: str) -> None:
        self.send(LOG, with_code(level, message.encode("utf-8", "replace")))

    def call_gateway(self, header: Mapping[str, Any], request: bytes) -> tuple[int, bytes]:
        """A gateway call through the host: its code and response."""
        with self._calling:
            self.send(GATEWAY, with_header(header, request))
            frame = self.receive()
        if frame is None:
            raise FrameError("the host closed the pipe during a gateway call")
        kind, payload = frame
        if kind != GATEWAY_REPLY:
            raise FrameError(f"expected a gateway reply, got a {kind!r} frame")
        return split_code(payload)

    def failed(self, type_name: str, message: str, **details: Any) -> None:
        self.send(FAILED, failure(type_name, message, **details))
