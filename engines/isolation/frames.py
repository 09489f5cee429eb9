"""Frames between the host and an isolated worker's helper process: one kind byte, a
little-endian uint32 length, then the payload. Shared by both sides; what a call's payload
and an init blob hold is the engine's business, the frames only carry them."""

from __future__ import annotations

import struct
from typing import BinaryIO

HEADER = struct.Struct("<cI")
CODE = struct.Struct("<i")
#: Largest frame either side accepts (a worker's code, or an answer plus slack).
MAX_FRAME_BYTES = 300 * 1024 * 1024

# host -> helper
INIT = b"I"  # JSON header, b"\n", the blob the helper loads (the worker's code)
CALL = b"C"  # the request, in the engine's encoding
PROBE = b"P"  # empty: run the code's health probe (answered with ANSWER, a PROBE_ANSWERS value)
GATEWAY_REPLY = b"g"  # int32 code, the response JSON
# helper -> host
READY = b"R"  # empty
LOG = b"L"  # int32 level (Python logging), UTF-8 message
GATEWAY = b"G"  # JSON {"service", "method"}, b"\n", the request JSON
ANSWER = b"A"  # the answer, in the engine's encoding
FAILED = b"F"  # JSON {"type", "message", "code"}: a refusal or a failed call or probe

#: The ANSWER to a PROBE: the code has no probe (None), it passed (True), it answered False.
PROBE_ANSWERS: dict[bool | None, bytes] = {None: b"", True: b"1", False: b"0"}


class FrameError(Exception):
    """Raised when the other side sends something that is not a frame, or closes the pipe."""


def write_frame(stream: BinaryIO, kind: bytes, payload: bytes = b"") -> None:
    stream.write(HEADER.pack(kind, len(payload)))
    stream.write(payload)
    stream.flush()


def parse_header(header: bytes) -> tuple[bytes, int]:
    if len(header) != HEADER.size:
        raise FrameError("the pipe closed")
    kind, length = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return kind, length


def read_frame(stream: BinaryIO) -> tuple[bytes, bytes]:
    """The next frame (blocking); :class:`FrameError` at the end of the stream."""
    kind, length = parse_header(stream.read(HEADER.size))
    payload = stream.read(length) if length else b""
    if len(payload) != length:
        raise FrameError("the pipe closed inside a frame")
    return kind, payload
