"""Host side: one sandboxed child running one version of a worker's code.

The child is a :class:`~engines.childproc.host.ChildProcess` started as the sandbox wants it:
the kernel layers' command (bwrap) before the interpreter, a fresh temporary directory as
cwd holding the worker's code (removed afterwards), an empty environment, its own session
(so ``os.killpg`` reaches everything it runs), and its stdout and stderr read through a pipe
of their own, forwarded line by line to the logger with the worker id. Every wait is bounded
by a deadline; the child is killed with SIGKILL and always reaped. What is Python here: the
JSON payloads (:mod:`engines.python.protocol`), the worker's log and gateway calls, and how
a child's end is told.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from engines.childproc import frames
from engines.childproc.host import ChildExited, ChildProcess, Launch, Wrapper
from engines.childproc.limits import Limits
from engines.python.protocol import GATEWAY_FAILED, GATEWAY_OK
from wm.engine import child_pids
from wm.errors import WorkerExecutionError

logger = logging.getLogger(__name__)

#: bwrap exits with this plus the signal number when the interpreter was killed by a signal.
BWRAP_SIGNAL_BASE = 128
#: Processes between the spawned one and the interpreter at most (bwrap, its pid 1).
WRAPPER_DEPTH = 2
#: What a send or a receive fails with (see ``SandboxProcess._fail``).
_FAILURES = (ChildExited, WorkerExecutionError, frames.FrameError, OSError)
#: How a child that could not import part of its own code says so on its way out.
_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")
#: The DevKit's log levels, as the child sends them; another level is logged as INFO.
LOG_LEVELS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)

#: Handles a gateway call: (request with ``host``, ``port``, ``service``, ``method`` and
#: ``data``, seconds left) -> ``{"ok": True, "data": ...}`` or ``{"ok": False, "error": ...}``.
GatewayHandler = Callable[[dict[str, Any], float], dict[str, Any]]

_SIGNAL_HINTS = {
    signal.SIGXCPU: " (its CPU time limit, worker setting cpu_limit_s)",
    signal.SIGKILL: " (a hard limit, or killed from outside)",
    signal.SIGSEGV: " (an interpreter crash)",
}


def describe_exit(returncode: int | None) -> str:
    """How a child ended, for error messages."""
    if returncode is None:
        return "stopped answering"
    if BWRAP_SIGNAL_BASE < returncode < BWRAP_SIGNAL_BASE + signal.NSIG:
        returncode = BWRAP_SIGNAL_BASE - returncode  # bwrap's pid 1 reports 128 + signal
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        number = signal.Signals(-returncode)
    except ValueError:
        return f"was killed by signal {-returncode}"
    return f"was killed by {number.name}{_SIGNAL_HINTS.get(number, '')}"


class WorkerSinks:
    """The worker's log lines and gateway calls, as the host performs them."""

    def __init__(self, worker_id: str, gateway: GatewayHandler) -> None:
        self.worker_id, self._gateway = worker_id, gateway

    def log(self, level: int, message: str) -> None:
        level = level if level in LOG_LEVELS else logging.INFO
        logger.log(level, "python worker %s: %s", self.worker_id, message)

    def output(self, line: str) -> None:
        logger.info("python worker %s output: %s", self.worker_id, line)

    def gateway(self, call: dict[str, Any], request: bytes, deadline: float) -> tuple[int, bytes]:
        try:
            data = json.loads(request) if request else None
        except ValueError as exc:
            return GATEWAY_FAILED, _error(f"gateway request data is not JSON: {exc}")
        reply = self._gateway({**call, "data": data}, deadline - time.monotonic())
        if reply.get("ok"):
            return GATEWAY_OK, json.dumps(reply.get("data")).encode("utf-8")
        return GATEWAY_FAILED, _error(str(reply.get("error")))


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode("utf-8")


class SandboxProcess:
    """A running child; :meth:`init` loads the code, :meth:`request` sends a frame and waits
    for the reply."""

    def __init__(
        self,
        argv: list[str],
        worker_id: str,
        gateway: GatewayHandler,
        *,
        wrapper: Wrapper | None = None,
        files: Mapping[str, str] | None = None,
        limits: Limits | None = None,
        spin_s: float = 0.0,
    ) -> None:
        """``files`` (name -> text) are written into the child's directory before it starts;
        ``wrapper`` puts a per-child command (bwrap, which binds them) before ``argv``; ``limits``
        bound the child and what it starts (its cgroups); ``spin_s``: how long each side polls
        for the other's next frame before it sleeps (the child is told with the INIT)."""
        self.worker_id = worker_id
        self.broken = False
        #: Entry point the child reported (``process`` or a WorkerBase subclass name).
        self.entry = ""
        #: Whether the child reported a health probe in the worker's code.
        self.probe = False
        #: CPU seconds the child may use in its lifetime (RLIMIT_CPU).
        self.cpu_limit_s = float("inf")
        #: The sys.path sent with INIT, kept until the child's first reply (see _died).
        self._startup_sys_path: list[str] | None = None
        sinks = WorkerSinks(worker_id, gateway)
        launch = Launch(
            tuple(argv),
            {},
            dict(files or {}),
            "wm-py-",
            wrapper=wrapper,
            output=sinks.output,
            limits=limits,
            spin_s=spin_s,
        )
        try:
            self._child = ChildProcess(launch, sinks)
        except OSError as exc:
            raise WorkerExecutionError(f"cannot start the Python sandbox: {exc}") from exc

    @property
    def directory(self) -> str:
        """The child's working directory, where its code is (and the only one it may write)."""
        assert self._child.directory is not None
        return self._child.directory

    @property
    def pid(self) -> int:
        """Host pid of the interpreter: under bwrap, the grandchild of the spawned process
        (bwrap's reaper is pid 1 of the namespace, the interpreter its child)."""
        pid = self._child.pid
        for _ in range(WRAPPER_DEPTH):
            found = child_pids(pid)
            if len(found) != 1:
                break
            pid = found[0]
        return pid

    @property
    def exited(self) -> bool:
        """Whether the child ended on its own (e.g. killed by an rlimit while idle)."""
        return self._child.exited

    def kill(self) -> None:
        """Kill and reap the child and remove its directory (idempotent)."""
        self.broken = True
        self._child.close()

    def init(
        self, config: dict[str, Any], code: str, deadline: float
    ) -> tuple[bytes, dict[str, Any]]:
        """Send INIT (``config``, with the launch's ``spin_s``, and the worker's ``code``);
        the reply, as :meth:`request`."""
        self._startup_sys_path = list(config.get("sys_path", []))
        config = {**config, "spin_s": self._child.launch.spin_s}
        return self.request(frames.INIT, frames.with_header(config, code.encode("utf-8")), deadline)

    def request(self, kind: bytes, payload: bytes, deadline: float) -> tuple[bytes, dict[str, Any]]:
        """Send a frame; the kind and JSON object of the child's reply.

        LOG and GATEWAY frames are served while waiting. Raises WorkerTimeout when
        ``deadline`` (a ``time.monotonic`` value) passes, WorkerExecutionError when the child
        dies or breaks the protocol; either way the process is marked broken.
        """
        self.send(kind, payload, deadline)
        return self.receive(deadline)

    def send(self, kind: bytes, payload: bytes, deadline: float) -> None:
        """Send a frame (a BATCH's replies are then read one by one with :meth:`receive`)."""
        try:
            self._child.send(kind, payload, deadline)
        except _FAILURES as exc:
            self._fail(exc)

    def receive(self, deadline: float) -> tuple[bytes, dict[str, Any]]:
        """The kind and JSON object of the child's next reply, as :meth:`request`."""
        try:
            kind, body = self._child.receive(deadline)
            reply = frames.json_object(body)
        except _FAILURES as exc:
            self._fail(exc)
        self._startup_sys_path = None
        return kind, reply

    def _fail(self, exc: BaseException) -> NoReturn:
        """Raise what a failure of a send or a receive means, the process marked broken:
        the child's death and protocol errors as WorkerExecutionError (called from a plain
        ``except`` at each call, not a context manager: this is on every round trip)."""
        self.broken = True
        if isinstance(exc, ChildExited):
            raise self._died(exc.returncode) from None
        if isinstance(exc, WorkerExecutionError):
            raise exc
        raise WorkerExecutionError(f"protocol failure with the Python sandbox: {exc}") from exc

    def _died(self, returncode: int | None) -> WorkerExecutionError:
        why = f"{describe_exit(returncode)}{self._startup_hint()}{self.output_summary()}"
        return WorkerExecutionError(f"the Python sandbox process {why}", process_exited=True)

    def _startup_hint(self) -> str:
        """Why a child died importing its own code: the worker-side ModuleNotFoundError alone
        does not say where the child looked."""
        if self._startup_sys_path is None:
            return ""
        for line in reversed(self._child.output_tail):
            found = _MISSING_MODULE.search(line)
            if found:
                return (
                    f" while starting: module {found.group(1)!r} was not found (sys.path sent "
                    f"to it: {self._startup_sys_path}, interpreter {sys.executable})"
                )
        return " while starting"

    def output_summary(self) -> str:
        """The last lines the child printed, for error messages."""
        return self._child.output_summary()


def interpreter_argv(
    prefix: tuple[str, ...] | list[str], bootstrap: str, executable: str | None = None
) -> list[str]:
    """The child's command line, without the two pipe fds the spawn appends.

    The host's own interpreter, also inside a virtualenv: ``-I -S`` keep the venv's
    site-packages off the child's path, its standard library comes from the base installation
    either way, and INIT replaces ``sys.path`` before anything else is imported.
    ``executable`` overrides it (bwrap execs the real file behind a venv's symlink).
    """
    if not sys.executable:
        raise WorkerExecutionError(
            "cannot start the Python sandbox: this process does not know its interpreter "
            "(sys.executable is empty)"
        )
    return [*prefix, executable or sys.executable, "-I", "-S", "-B", bootstrap]
