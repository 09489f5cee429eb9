"""The helper process of an isolated native worker: ``python -m engines.native.helper``.

It loads the library the host sends, then answers CALL frames with the ABI round trip of
:class:`engines.native.library.NativeLibrary`, relaying the worker's log and gateway calls to
the host. If the library crashes or hangs, only this process dies (or is killed by the host).
It takes no core dumps and is killed when the host dies (precisely: when the host thread that
started it ends; the host starts a fresh helper on its next call then).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
from typing import BinaryIO

from engines.native import frames
from engines.native.library import NativeCallFailed, NativeLibrary, NativeOutputRefused
from wm.errors import WorkManagerError

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        from cffi import FFI

        local = FFI()
        local.cdef("int prctl(int option, unsigned long arg2, ...);")
        local.dlopen(None).prctl(PR_SET_PDEATHSIG, local.cast("unsigned long", signal.SIGKILL))


class Host:
    """The host at the other end of the pipes. A library may log or call the gateway from
    threads of its own: frames are written whole, and a gateway call holds the pipes until
    its reply is read."""

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


def serve(host: Host) -> int:
    kind, payload = frames.read_frame(host.incoming)
    if kind != frames.INIT:
        raise frames.FrameError(f"expected an init frame, got {kind!r}")
    header, image = payload.split(b"\n", 1)
    spec = json.loads(header)
    try:
        library = NativeLibrary(
            image,
            spec["file_name"],
            spec["entry_point"],
            spec["free_result"],
            host.log,
            host.gateway,
        )
    except WorkManagerError as exc:
        host.failed(exc)
        return 1
    try:
        host.send(frames.READY)
        while True:
            try:
                kind, payload = frames.read_frame(host.incoming)
            except frames.FrameError:
                return 0  # the host closed the pipe: done
            if kind != frames.CALL:
                raise frames.FrameError(f"expected a call frame, got {kind!r}")
            try:
                answer = library.call(payload)
            except NativeCallFailed as exc:
                host.failed(exc, exc.code)
            except NativeOutputRefused as exc:
                host.failed(exc)
            else:
                host.send(frames.ANSWER, answer)
    finally:
        library.close()


def main() -> int:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _die_with_parent()
    # Frames own the real stdout; what the library prints goes to stderr instead.
    outgoing = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return serve(Host(sys.stdin.buffer, outgoing))


if __name__ == "__main__":
    sys.exit(main())
