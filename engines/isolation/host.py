"""Host side of isolation mode: a worker's code runs in a helper process (the engine's module,
built on :mod:`engines.isolation.helper`), so a crash or a hang costs one failed delivery,
not the node.

One helper per loaded worker per host process, started when the engine loads the worker,
reused across messages; one call (or health probe) at a time per helper. A call past its
time limit kills the helper (WorkerTimeout); a helper that died (a signal, an exit) fails the
call with the cause; the next call starts a fresh helper. The process itself, its pipes and
frames are a :class:`~engines.childproc.host.ChildProcess`; this module adds the load
handshake, the restarts and the words. The engine supplies what is its own: the helper's
module, what it loads, the words its messages use, and how its refusals map to exceptions.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from engines.childproc import frames
from engines.childproc.host import ChildExited, ChildProcess, Launch
from engines.childproc.limits import Limits
from engines.isolation.helper import PROBE_ANSWERS, SPIN
from wm.errors import InvalidCode, WorkerExecutionError, WorkerTimeout

logger = logging.getLogger(__name__)
#: seconds a helper may take to start and load its library.
LOAD_TIMEOUT_S = 30.0
#: seconds an idle helper gets to exit on its own when it is closed.
CLOSE_GRACE_S = 1.0

#: ``(code, message) -> exception``: a failure the helper reported with an integer code.
CodedFailure = Callable[[int, str], Exception]


class Callbacks(Protocol):
    """What the host does for a helper's worker: its log and its gateway calls.
    ``deadline.value`` is set to the running call's deadline (``time.monotonic()``), so a
    gateway call can be given no more than the time left."""

    deadline: threading.local

    def log(self, level: int, message: str) -> None: ...

    def gateway(self, service: str, method: str, request: bytes) -> tuple[int, bytes]: ...


class _Relay:
    """The child's LOG and GATEWAY frames, handed to the engine's callbacks (with the
    deadline of the exchange in ``deadline.value``)."""

    def __init__(self, callbacks: Callbacks) -> None:
        self.callbacks = callbacks

    def log(self, level: int, message: str) -> None:
        self.callbacks.log(level, message)

    def gateway(self, call: dict[str, Any], request: bytes, deadline: float) -> tuple[int, bytes]:
        service, method = call.get("service"), call.get("method")
        if not isinstance(service, str) or not isinstance(method, str):
            raise frames.FrameError(f"a gateway frame without service and method names: {call}")
        self.callbacks.deadline.value = deadline
        return self.callbacks.gateway(service, method, request)


class HelperProcess:
    """A helper (``python -m module``) that loaded ``blob`` as ``header`` describes, with
    ``env`` set over the host's (None unsets a variable).

    ``description`` names the engine in messages, as an adjective: "native" gives "the native
    worker did not answer…", "restarting the native helper failed…". A FAILED frame becomes
    ``coded_failure(code, message)`` when it carries an integer code, else the class that
    ``refusals`` maps its type name to (WorkerExecutionError for a name not there). ``loads``
    says what was loaded, for the log. ``limits`` bound the helper and what it starts
    (:mod:`engines.childproc.limits`); ``spin_s`` is how long each side polls for the other's
    next frame before it sleeps on it (:class:`~engines.childproc.frames.Spin`).
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
        limits: Limits | None = None,
        spin_s: float = 0.0,
    ) -> None:
        self.module, self.sinks, self.description = module, sinks, description
        self.refusals = dict(refusals or {})
        self.coded_failure, self.loads = coded_failure, loads
        self._init = frames.with_header({**header, SPIN: spin_s}, blob)
        merged = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        self.launch = Launch((sys.executable, "-m", module), merged, limits=limits, spin_s=spin_s)
        self._relay = _Relay(sinks)
        self._lock = threading.Lock()
        self._child: ChildProcess | None = None
        try:
            self._start()
        except WorkerExecutionError as exc:
            raise InvalidCode(
                f"the {description} library could not be loaded in isolation: {exc}"
            ) from exc

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def _start(self) -> None:
        """A fresh helper with the code loaded; WorkerExecutionError if it fails, or the
        helper's own refusal."""
        self._child = ChildProcess(self.launch, self._relay)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        try:
            ready = self._ask(
                frames.INIT, self._init, deadline, frames.READY, "loading its library"
            )
        except BaseException:
            self._discard()
            raise
        if isinstance(ready, Exception):
            self._discard()
            raise ready
        logger.info("%s helper pid %s loaded %s", self.description, self.pid, self.loads)

    def _restart_if_gone(self) -> None:
        if self._child is not None and not self._child.exited:
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
        doing = "running its probe" if probing else "processing an event"
        with self._lock:
            self._restart_if_gone()
            deadline = time.monotonic() + timeout_s
            try:
                answer = self._ask(kind, payload, deadline, frames.ANSWER, doing)
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
        """End the helper: killed at once, or, ``graceful``, told to finish (its frame pipe
        closes, so an idle helper unloads its code and exits) and killed only if it has not
        within CLOSE_GRACE_S."""
        child, self._child = self._child, None
        if child is not None:
            child.close(CLOSE_GRACE_S if graceful else 0.0)

    def _ask(
        self, kind: bytes, payload: bytes, deadline: float, expected: bytes, doing: str
    ) -> bytes | Exception:
        """Send a frame and wait for the ``expected`` one (its payload), or a FAILED one (its
        failure, returned: the helper is still in step with the host)."""
        assert self._child is not None
        try:
            reply, answer = self._child.request(kind, payload, deadline)
        except ChildExited as exc:
            raise self._died(exc, doing) from None
        except WorkerTimeout:
            raise WorkerTimeout(f"the {self.description} helper timed out {doing}") from None
        if reply == expected:
            return answer
        if reply == frames.FAILED:
            return self._failure(frames.json_object(answer))
        raise frames.FrameError(f"unexpected frame {reply!r} from the {self.description} helper")

    def _failure(self, body: dict[str, Any]) -> Exception:
        message = str(body.get("message"))
        code = body.get("code")
        if isinstance(code, int) and self.coded_failure is not None:
            return self.coded_failure(code, message)
        return self.refusals.get(str(body.get("type")), WorkerExecutionError)(message)

    def _died(self, exited: ChildExited, doing: str) -> WorkerExecutionError:
        self._discard()
        return WorkerExecutionError(
            f"the {self.description} worker's helper process (pid {exited.pid}) died while "
            f"{doing}: {_cause(exited.returncode)}",
            process_exited=True,
        )


_PROBE_RESULTS = {answer: result for result, answer in PROBE_ANSWERS.items()}


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
