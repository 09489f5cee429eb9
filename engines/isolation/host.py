"""Host side of isolation mode: a worker's code runs in a helper process (the engine's module,
built on :mod:`engines.isolation.helper`), so a crash or a hang costs one failed delivery,
not the node.

One helper per loaded worker per host process, started when the engine loads the worker,
reused across messages; one call (or health probe) at a time per helper. A call past its
time limit kills the helper (WorkerTimeout); a helper that died (a signal, an exit) fails the
call with the cause; the next call starts a fresh helper. The engine supplies what is its
own: the helper's module, what it loads, the words its messages use, and how its refusals
map to exceptions.
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
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from engines.isolation import frames
from wm.errors import InvalidCode, WorkerExecutionError, WorkerTimeout

logger = logging.getLogger(__name__)
#: seconds a helper may take to start and load its library.
LOAD_TIMEOUT_S = 30.0
#: seconds an idle helper gets to exit on its own when it is closed.
CLOSE_GRACE_S = 1.0
#: bytes read from a helper's pipe at once, at least.
READ_CHUNK_BYTES = 65536

#: ``(code, message) -> exception``: a failure the helper reported with an integer code.
CodedFailure = Callable[[int, str], Exception]


class Callbacks(Protocol):
    """What the host does for a helper's worker: its log and its gateway calls.
    ``deadline.value`` is set to the running call's deadline (``time.monotonic()``), so a
    gateway call can be given no more than the time left."""

    deadline: threading.local

    def log(self, level: int, message: str) -> None: ...

    def gateway(self, service: str, method: str, request: bytes) -> tuple[int, bytes]: ...


class HelperProcess:
    """A helper (``python -m module``) that loaded ``blob`` as ``header`` describes, with
    ``env`` set over the host's (None unsets a variable).

    ``description`` names the engine in messages, as an adjective: "native" gives "the native
    worker did not answer…", "restarting the native helper failed…". A FAILED frame becomes
    ``coded_failure(code, message)`` when it carries an integer code, else the class that
    ``refusals`` maps its type name to (WorkerExecutionError for a name not there). ``loads``
    says what was loaded, for the log.
    """

    def __init__(
        self,
        module: str,
        header: Mapping[str, Any],
        blob: bytes,
        env: Mapping[str, str | None],
        sinks: Callbacks,
        *,
        description: str,
        refusals: Mapping[str, type[Exception]] | None = None,
        coded_failure: CodedFailure | None = None,
        loads: str = "",
    ) -> None:
        self.module, self.sinks, self.description = module, sinks, description
        self.refusals = dict(refusals or {})
        self.coded_failure, self.loads = coded_failure, loads
        self._header, self._blob = dict(header), blob
        self.env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._buffer = bytearray()
        try:
            self._start()
        except WorkerExecutionError as exc:
            raise InvalidCode(
                f"the {description} library could not be loaded in isolation: {exc}"
            ) from exc

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _start(self) -> None:
        """A fresh helper with the code loaded; WorkerExecutionError if it fails, or the
        helper's own refusal."""
        self._process = subprocess.Popen(
            [sys.executable, "-m", self.module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            start_new_session=True,
        )
        self._buffer = bytearray()
        try:
            self._send(frames.INIT, json.dumps(self._header).encode() + b"\n" + self._blob)
            ready = self._wait(
                time.monotonic() + LOAD_TIMEOUT_S, frames.READY, "loading its library"
            )
        except BaseException:
            self._discard()
            raise
        if isinstance(ready, Exception):
            self._discard()
            raise ready
        logger.info("%s helper pid %s loaded %s", self.description, self.pid, self.loads)

    def _restart_if_gone(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self._discard()
        try:
            self._start()
        except InvalidCode as exc:  # it loaded before: a failed restart is transient
            raise WorkerExecutionError(
                f"restarting the {self.description} helper failed: {exc}"
            ) from exc

    def call(self, request: bytes, timeout_s: float) -> bytes:
        """One call in the helper. Only a FAILED frame (a clean refusal or failure) keeps
        the helper; anything else (a timeout, a death, a broken frame) discards it, so the
        next call never reads what was meant for this one."""
        return self._exchange(frames.CALL, request, timeout_s)

    def probe(self, timeout_s: float) -> bool | None:
        """The code's health probe, run in the helper as a call is (after the call in
        flight, killed past ``timeout_s``): True when it passed, False when it answered
        so, None when the code has no probe; a failure is raised as a call's is."""
        answer = self._exchange(frames.PROBE, b"", timeout_s)
        if answer not in _PROBE_RESULTS:
            raise WorkerExecutionError(
                f"the {self.description} helper answered a probe with {answer[:40]!r}"
            )
        return _PROBE_RESULTS[answer]

    def _exchange(self, kind: bytes, payload: bytes, timeout_s: float) -> bytes:
        probing = kind == frames.PROBE
        with self._lock:
            self._restart_if_gone()
            deadline = time.monotonic() + timeout_s
            self.sinks.deadline.value = deadline
            try:
                self._send(kind, payload)
                doing = "running its probe" if probing else "processing an event"
                answer = self._wait(deadline, frames.ANSWER, doing)
            except WorkerTimeout:
                self._discard()
                raise WorkerTimeout(self._timed_out(probing, timeout_s)) from None
            except frames.FrameError as exc:
                self._discard()
                raise WorkerExecutionError(
                    f"the {self.description} helper broke the protocol: {exc}"
                ) from exc
            except BaseException:
                self._discard()
                raise
            if isinstance(answer, Exception):
                raise answer
            return answer

    def _timed_out(self, probing: bool, timeout_s: float) -> str:
        if probing:
            return (
                f"the {self.description} worker's probe did not finish within {timeout_s:g} s; "
                "its helper process was killed and a fresh one starts with the next call"
            )
        return (
            f"the {self.description} worker did not answer within {timeout_s:g} s; "
            "its helper process was killed and a fresh one starts with the next message"
        )

    def close(self) -> None:
        with self._lock:
            self._discard(graceful=True)

    def _discard(self, *, graceful: bool = False) -> None:
        """End the helper: killed at once, or, ``graceful``, told to finish (its stdin
        closes, so an idle helper unloads its code and exits) and killed only if it has not
        within CLOSE_GRACE_S."""
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

    def _wait(self, deadline: float, expected: bytes, doing: str) -> bytes | Exception:
        """Serve log and gateway frames until the ``expected`` one arrives (its payload), or
        a FAILED one (its failure, returned: the helper is still in step with the host)."""
        while True:
            kind, payload = self._read_frame(deadline, doing)
            if kind == expected:
                return payload
            try:
                if kind == frames.FAILED:
                    return self._failure(json.loads(payload))
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
        else:
            raise frames.FrameError(f"unexpected frame {kind!r} from the {self.description} helper")

    def _failure(self, body: Any) -> Exception:
        if not isinstance(body, dict):
            raise TypeError(f"expected a JSON object, got {type(body).__name__}")
        message = str(body.get("message"))
        code = body.get("code")
        if isinstance(code, int) and self.coded_failure is not None:
            return self.coded_failure(code, message)
        return self.refusals.get(str(body.get("type")), WorkerExecutionError)(message)

    def _read_frame(self, deadline: float, doing: str) -> tuple[bytes, bytes]:
        kind, length = frames.parse_header(self._read(frames.HEADER.size, deadline, doing))
        return kind, self._read(length, deadline, doing)

    def _read(self, count: int, deadline: float, doing: str) -> bytes:
        assert self._process is not None and self._process.stdout is not None
        fd = self._process.stdout.fileno()
        while len(self._buffer) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout(f"the {self.description} helper timed out {doing}")
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
            f"the {self.description} worker's helper process (pid {pid}) died while {doing}: "
            f"{_cause(code)}"
        )


_PROBE_RESULTS = {answer: result for result, answer in frames.PROBE_ANSWERS.items()}


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
