"""Helper-process side of isolation mode: what every engine's helper does around its own
loading and calling, so an engine's helper module is a ``load`` function and
``sys.exit(run(load))``.

The helper loads the code the host sends in the INIT frame, then answers CALL and PROBE
frames, relaying the worker's log and gateway calls to the host. If the code crashes or
hangs, only this process dies (or is killed by the host). It takes no core dumps and is
killed when the host dies (precisely: when the host thread that started it ends; the host
starts a fresh helper on its next call then). Only the standard library is used here (prctl
through ctypes), so an engine's helper needs no more than the engine itself does.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO, Protocol

from engines.isolation import frames
from wm.errors import WorkManagerError

PR_SET_PDEATHSIG = 1


class Handler(Protocol):
    """The loaded code. ``call`` answers one request (both in the engine's encoding); a
    WorkManagerError it raises is reported to the host, with its ``code`` if it has an int
    one. ``close`` unloads the code when the host is done. A handler may also have
    ``probe() -> bool | None``, the code's health probe (failures reported as ``call``'s);
    without one, the code has no probe."""

    def call(self, payload: bytes) -> bytes: ...

    def close(self) -> None: ...


#: ``load(header, blob, host)``: the code in ``blob`` loaded as ``header`` says, logging and
#: calling the gateway through ``host``; a WorkManagerError refuses it.
Loader = Callable[[dict[str, Any], bytes, "Host"], Handler]


class Host:
    """The host at the other end of the pipes. The loaded code may log or call the gateway
    from threads of its own: frames are written whole, and a gateway call holds the pipes
    until its reply is read."""

    def __init__(self, incoming: BinaryIO, outgoing: BinaryIO) -> None:
        self.incoming, self.outgoing = incoming, outgoing
        self._sending = threading.Lock()
        self._calling = threading.Lock()

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        with self._sending:
            frames.write_frame(self.outgoing, kind, payload)

    def log(self, level: int, message: str) -> None:
        self.send(frames.LOG, frames.CODE.pack(level) + message.encode("utf-8", "replace"))

    def gateway(self, service: str, method: str, request: bytes) -> tuple[int, bytes]:
        header = json.dumps({"service": service, "method": method}).encode()
        with self._calling:
            self.send(frames.GATEWAY, header + b"\n" + request)
            kind, payload = frames.read_frame(self.incoming)
        if kind != frames.GATEWAY_REPLY or len(payload) < frames.CODE.size:
            raise frames.FrameError(f"expected a gateway reply, got {kind!r}")
        (code,) = frames.CODE.unpack_from(payload)
        return code, payload[frames.CODE.size :]

    def failed(self, exc: WorkManagerError, code: int | None = None) -> None:
        body = {"type": type(exc).__name__, "message": str(exc), "code": code}
        self.send(frames.FAILED, json.dumps(body).encode())


def serve(host: Host, load: Loader) -> int:
    """Load the code from the INIT frame, then answer calls until the host closes the pipe.
    The exit status: 0 when the host is done, 1 when the code was refused."""
    header, blob = _read_init(host)
    try:
        handler = load(header, blob, host)
    except WorkManagerError as exc:
        host.failed(exc)
        return 1
    try:
        host.send(frames.READY)
        _answer_calls(host, handler)
    finally:
        handler.close()
    return 0


def _read_init(host: Host) -> tuple[dict[str, Any], bytes]:
    kind, payload = frames.read_frame(host.incoming)
    if kind != frames.INIT:
        raise frames.FrameError(f"expected an init frame, got {kind!r}")
    header, blob = payload.split(b"\n", 1)
    spec = json.loads(header)
    if not isinstance(spec, dict):
        raise frames.FrameError(f"the init header is not a JSON object: {header!r}")
    return spec, blob


def _answer_calls(host: Host, handler: Handler) -> None:
    while True:
        try:
            kind, payload = frames.read_frame(host.incoming)
        except frames.FrameError:
            return  # the host closed the pipe: done
        if kind not in (frames.CALL, frames.PROBE):
            raise frames.FrameError(f"expected a call or probe frame, got {kind!r}")
        try:
            answer = handler.call(payload) if kind == frames.CALL else _probe(handler)
        except WorkManagerError as exc:
            code = getattr(exc, "code", None)
            host.failed(exc, code if isinstance(code, int) else None)
        else:
            host.send(frames.ANSWER, answer)


def _probe(handler: Handler) -> bytes:
    probe = getattr(handler, "probe", None)
    healthy = None if probe is None else probe()
    return frames.PROBE_ANSWERS[None if healthy is None else bool(healthy)]


def run(load: Loader) -> int:
    """The helper process: ``sys.exit(run(load))`` in the engine's helper module."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _die_with_parent()
    # Frames own the real stdout; what the loaded code prints goes to stderr instead.
    outgoing = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return serve(Host(sys.stdin.buffer, outgoing), load)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None)
        libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL))
