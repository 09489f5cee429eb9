"""Host side of isolation mode: the worker library runs in a helper process
(:mod:`engines.native.helper`), so a crash or a hang costs one failed delivery, not the node.

One helper per loaded worker per host process, started by ``load``, reused across messages;
one call at a time per helper. A call past its time limit kills the helper (WorkerTimeout);
a helper that died (a signal, an exit) fails the call with the cause; the next call starts a
fresh helper.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Protocol

from engines.native import frames
from engines.native.library import NativeCallFailed, NativeOutputRefused
from engines.native.package import Package, library_file
from wm.errors import InvalidCode, WorkerExecutionError, WorkerTimeout

logger = logging.getLogger(__name__)
#: seconds a helper may take to start and load its library.
LOAD_TIMEOUT_S = 30.0
#: seconds an idle helper gets to exit on its own when it is closed.
CLOSE_GRACE_S = 1.0
#: bytes read from a helper's pipe at once, at least.
READ_CHUNK_BYTES = 65536
_REFUSALS: dict[str, type[Exception]] = {
    "InvalidCode": InvalidCode,
    "NativeOutputRefused": NativeOutputRefused,
}


class Callbacks(Protocol):
    """What the host does for a helper's worker: its log and its gateway calls."""

    deadline: threading.local

    def log(self, level: int, message: str) -> None: ...

    def gateway(self, service: str, method: str, request: bytes) -> tuple[int, bytes]: ...


class HelperProcess:
    """A helper that loaded ``package``'s library, with ``env`` set over the host's."""

    def __init__(self, package: Package, env: dict[str, str | None], sinks: Callbacks) -> None:
        self.package, self.sinks = package, sinks
        self.env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._buffer = bytearray()
        try:
            self._start()
        except WorkerExecutionError as exc:
            raise InvalidCode(
                f"the native library could not be loaded in isolation: {exc}"
            ) from exc

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _start(self) -> None:
        """A fresh helper with the library loaded; WorkerExecutionError if it fails."""
        manifest = self.package.manifest
        spec = {
            "file_name": library_file(manifest.library),
            "entry_point": manifest.entry_point,
            "free_result": manifest.free_result,
        }
        self._process = subprocess.Popen(
            [sys.executable, "-m", "engines.native.helper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            start_new_session=True,
        )
        self._buffer = bytearray()
        try:
            self._send(frames.INIT, json.dumps(spec).encode() + b"\n" + self.package.library)
            self._wait(time.monotonic() + LOAD_TIMEOUT_S, frames.READY, "loading its library")
        except BaseException:
            self._discard()
            raise
        logger.info("native helper pid %s loaded %s", self.pid, self.package.entry)

    def call(self, request: bytes, timeout_s: float) -> bytes:
        """One Process call in the helper. Only a clean refusal or failure code keeps the
        helper; anything else (a timeout, a death, a broken frame) discards it, so the next
        call never reads what was meant for this one."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._discard()
                try:
                    self._start()
                except InvalidCode as exc:  # it loaded before: a failed restart is transient
                    raise WorkerExecutionError(
                        f"restarting the native helper failed: {exc}"
                    ) from exc
            deadline = time.monotonic() + timeout_s
            self.sinks.deadline.value = deadline
            try:
                self._send(frames.CALL, request)
                return self._wait(deadline, frames.ANSWER, "processing an event")
            except (NativeCallFailed, NativeOutputRefused):
                raise
            except WorkerTimeout:
                self._discard()
                raise WorkerTimeout(
                    f"the native worker did not answer within {timeout_s:g} s; its helper "
                    "process was killed and a fresh one starts with the next message"
                ) from None
            except frames.FrameError as exc:
                self._discard()
                raise WorkerExecutionError(f"the native helper broke the protocol: {exc}") from exc
            except BaseException:
                self._discard()
                raise

    def close(self) -> None:
        with self._lock:
            self._discard(graceful=True)

    def _discard(self, *, graceful: bool = False) -> None:
        """End the helper: killed at once, or, ``graceful``, told to finish (its stdin
        closes, so an idle helper unloads its library and exits) and killed only if it has
        not within CLOSE_GRACE_S."""
        process, self._process = self._process, None
        if process is None:
            return
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            process.wait(timeout=CLOSE_GRACE_S if graceful else 0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    # -- frames ------------------------------------------------------------------------------

    def _send(self, kind: bytes, payload: bytes) -> None:
        assert self._process is not None and self._process.stdin is not None
        try:
            frames.write_frame(self._process.stdin, kind, payload)  # type: ignore[arg-type]
        except (BrokenPipeError, ValueError):
            raise self._died("receiving a frame") from None

    def _wait(self, deadline: float, expected: bytes, doing: str) -> bytes:
        """Serve log and gateway frames until the ``expected`` one arrives."""
        while True:
            kind, payload = self._read_frame(deadline, doing)
            if kind == expected:
                return payload
            try:
                self._serve(kind, payload)
            except (ValueError, KeyError, TypeError, struct.error) as exc:
                raise frames.FrameError(f"a malformed {kind!r} frame: {exc}") from exc

    def _serve(self, kind: bytes, payload: bytes) -> None:
        """Act on a frame the helper sent in the middle of a call."""
        if kind == frames.LOG:
            (level,) = frames.CODE.unpack_from(payload)
            self.sinks.log(level, payload[frames.CODE.size :].decode("utf-8", "replace"))
        elif kind == frames.GATEWAY:
            header, request = payload.split(b"\n", 1)
            names = json.loads(header)
            code, answer = self.sinks.gateway(names["service"], names["method"], request)
            self._send(frames.GATEWAY_REPLY, frames.CODE.pack(code) + answer)
        elif kind == frames.FAILED:
            raise _failure(json.loads(payload))
        else:
            raise frames.FrameError(f"unexpected frame {kind!r} from the native helper")

    def _read_frame(self, deadline: float, doing: str) -> tuple[bytes, bytes]:
        kind, length = frames.parse_header(self._read(frames.HEADER.size, deadline, doing))
        return kind, self._read(length, deadline, doing)

    def _read(self, count: int, deadline: float, doing: str) -> bytes:
        assert self._process is not None and self._process.stdout is not None
        fd = self._process.stdout.fileno()
        while len(self._buffer) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout(f"the native helper timed out {doing}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, max(READ_CHUNK_BYTES, count - len(self._buffer)))
            if not chunk:
                raise self._died(doing)
            self._buffer += chunk
        data = bytes(self._buffer[:count])
        del self._buffer[:count]
        return data

    def _died(self, doing: str) -> WorkerExecutionError:
        assert self._process is not None
        pid = self._process.pid
        try:
            code = self._process.wait(timeout=CLOSE_GRACE_S)
        except subprocess.TimeoutExpired:
            code = None
        self._discard()
        return WorkerExecutionError(
            f"the native worker's helper process (pid {pid}) died while {doing}: {_cause(code)}"
        )


def _cause(code: int | None) -> str:
    if code is None:
        return "it closed its pipe"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} ({signal.strsignal(-code) or 'unknown signal'})"
    return f"exit status {code}"


def _failure(body: dict[str, Any]) -> Exception:
    message = str(body.get("message"))
    code = body.get("code")
    if isinstance(code, int):
        return NativeCallFailed(code, message)
    return _REFUSALS.get(str(body.get("type")), WorkerExecutionError)(message)
