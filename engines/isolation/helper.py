"""Helper-process side of isolation mode: what every engine's helper does around its own
loading and calling, so an engine's helper module is a ``load`` function and
``sys.exit(run(load))``.

The helper loads the code the host sends in the INIT frame, then answers CALL and PROBE
frames, relaying the worker's log and gateway calls to the host (the frames and the child's
end of the pipes are :mod:`engines.childproc.frames`). If the code crashes or hangs, only
this process dies (or is killed by the host). It takes no core dumps and is killed when the
host dies (precisely: when the host thread that started it ends; the host starts a fresh
helper on its next call then). Only the standard library is used here (prctl through
ctypes), so an engine's helper needs no more than the engine itself does.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Any, Protocol

from engines.childproc import frames
from wm.errors import WorkManagerError

PR_SET_PDEATHSIG = 1
#: The INIT header's entry that says how long the helper polls for the host's next frame
#: before it sleeps on it (:class:`~engines.childproc.frames.Spin`); the rest is the engine's.
SPIN = "spin_s"
#: The ANSWER to a PROBE: the code has no probe (None), it passed (True), it answered False.
PROBE_ANSWERS: dict[bool | None, bytes] = {None: b"", True: b"1", False: b"0"}


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


class Host(frames.Channel):
    """The host at the other end of the pipes, as the loaded code sees it."""

    def gateway(self, service: str, method: str, request: bytes) -> tuple[int, bytes]:
        return self.call_gateway({"service": service, "method": method}, request)

    def refused(self, exc: WorkManagerError, code: int | None = None) -> None:
        self.failed(type(exc).__name__, str(exc), code=code)


def serve(host: Host, load: Loader) -> int:
    """Load the code from the INIT frame, then answer calls until the host closes the pipe.
    The exit status: 0 when the host is done, 1 when the code was refused."""
    header, blob = _read_init(host)
    host.spin(header.pop(SPIN, 0.0))
    try:
        handler = load(header, blob, host)
    except WorkManagerError as exc:
        host.refused(exc)
        return 1
    try:
        host.send(frames.READY)
        _answer_calls(host, handler)
    finally:
        handler.close()
    return 0


def _read_init(host: Host) -> tuple[dict[str, Any], bytes]:
    frame = host.receive()
    if frame is None:
        raise frames.FrameError("the pipe closed before the init frame")
    kind, payload = frame
    if kind != frames.INIT:
        raise frames.FrameError(f"expected an init frame, got {kind!r}")
    return frames.split_header(payload)


def _answer_calls(host: Host, handler: Handler) -> None:
    while True:
        try:
            frame = host.receive()
        except frames.FrameError:
            return
        if frame is None:
            return  # the host closed the pipe: done
        kind, payload = frame
        if kind not in (frames.CALL, frames.PROBE):
            raise frames.FrameError(f"expected a call or probe frame, got {kind!r}")
        try:
            answer = handler.call(payload) if kind == frames.CALL else _probe(handler)
        except WorkManagerError as exc:
            code = getattr(exc, "code", None)
            host.refused(exc, code if isinstance(code, int) else None)
        else:
            host.send(frames.ANSWER, answer)


def _probe(handler: Handler) -> bytes:
    probe = getattr(handler, "probe", None)
    healthy = None if probe is None else probe()
    return PROBE_ANSWERS[None if healthy is None else bool(healthy)]


def run(load: Loader) -> int:
    """The helper process (``python -m module READ_FD WRITE_FD``, the frame pipes):
    ``sys.exit(run(load))`` in the engine's helper module."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _die_with_parent()
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    os.dup2(2, 1)  # what the loaded code prints goes to stderr, as the host's own would
    return serve(Host(read_fd, write_fd), load)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None)
        libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL))
