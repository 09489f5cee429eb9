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
_REFUSALS: dict[str, type[Exception]] = {
    "InvalidCode": InvalidCode,
    "NativeOutputRefused": NativeOutputRefused,
}


class Sinks(Protocol):
    deadline: threading.local

    def log(self, level: int, message: str) -> None: ...

    def gateway(self, service: str, method: str, request: bytes) -> tuple[int, bytes]: ...


class HelperProcess:
    """A helper that loaded ``package``'s library, with ``env`` set over the host's."""

    def __init__(self, package: Package, env: dict[str, str | None], sinks: Sinks) -> None:
        self.package, self.sinks = package, sinks
        self.env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _start(self) -> None:
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
        self._buffer = b""
        try:
            self._send(frames.INIT, json.dumps(spec).encode() + b"\n" + self.package.library)
            self._wait(time.monotonic() + LOAD_TIMEOUT_S, frames.READY, "loading its library")
        except WorkerExecutionError as exc:
            self.close()
            raise InvalidCode(
                f"the native library could not be loaded in isolation: {exc}"
            ) from exc
        except BaseException:
            self.close()
            raise
        logger.info("native helper pid %s loaded %s", self.pid, self.package.entry)

    def call(self, request: bytes, timeout_s: float) -> bytes:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._discard()
                self._start()
            deadline = time.monotonic() + timeout_s
            self.sinks.deadline.value = deadline
            try:
                self._send(frames.CALL, request)
                return self._wait(deadline, frames.ANSWER, "processing an event")
            except WorkerTimeout:
                self._discard()
                raise WorkerTimeout(
                    f"the native worker did not answer within {timeout_s:g} s; its helper "
                    "process was killed and a fresh one starts with the next message"
                ) from None
            except (frames.FrameError, WorkerExecutionError) as exc:
                if not isinstance(exc, NativeCallFailed | NativeOutputRefused):
                    self._discard()
                raise

    def close(self) -> None:
        with self._lock:
            self._discard()

    def _discard(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
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
            chunk = os.read(fd, max(65536, count - len(self._buffer)))
            if not chunk:
                raise self._died(doing)
            self._buffer += chunk
        data, self._buffer = self._buffer[:count], self._buffer[count:]
        return data

    def _died(self, doing: str) -> WorkerExecutionError:
        assert self._process is not None
        pid = self._process.pid
        try:
            code = self._process.wait(timeout=5)
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
