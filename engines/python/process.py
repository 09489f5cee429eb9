"""Host side: one sandboxed child running one version of a worker's code.

The child gets two dedicated pipes for frames, a third pipe for its stdout and stderr (read
while waiting for a reply, forwarded line by line to the logger with the worker id), a fresh
temporary directory as cwd (removed afterwards), an empty environment and its own session,
so ``os.killpg`` reaches everything it runs. Every wait is bounded by a deadline; the child
is killed with SIGKILL and always reaped, also when its owner forgets to (``weakref``
finalizer), so no zombie or directory is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from engines.python.protocol import (
    READ_CHUNK_BYTES,
    FrameBuffer,
    FrameError,
    pack,
    pack_body,
    unpack,
)
from wm.errors import WorkerExecutionError, WorkerTimeout

logger = logging.getLogger(__name__)

#: Lines of the child's output kept to explain a crash.
OUTPUT_TAIL_LINES = 20
#: bytes of one output line forwarded to the log.
MAX_LOG_LINE_BYTES = 4096
#: seconds to wait for a child that closed its pipe to exit before killing it.
EXIT_WAIT_S = 1.0
#: bwrap exits with this plus the signal number when the interpreter was killed by a signal.
BWRAP_SIGNAL_BASE = 128
#: Processes between the spawned one and the interpreter at most (bwrap, its pid 1).
WRAPPER_DEPTH = 2
#: How a child that could not import part of its own code says so on its way out.
_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")

_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

#: Handles a ``gateway`` frame: (request, seconds left) -> ``gateway_reply`` frame.
GatewayHandler = Callable[[dict[str, Any], float], dict[str, Any]]
#: The child's directory -> (argv placed before the interpreter, fds to pass then close).
Wrapper = Callable[[str], tuple[list[str], tuple[int, ...]]]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as handle:
            return [int(p) for p in handle.read().split()]
    except (OSError, ValueError):
        return []


def _terminate(popen: subprocess.Popen[bytes], fds: list[int], directory: str) -> None:
    """Kill the child's process group, reap the child, close pipes, remove its directory.

    Under bwrap the namespace's pid 1 is killed first: the kernel then kills everything in
    the PID namespace and bwrap exits once it is gone, so the interpreter is dead when the
    wait returns (killing bwrap first would leave that to an asynchronous parent-death
    signal).
    """
    inner = _children(popen.pid)
    for pid in inner if popen.poll() is None else ():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if inner:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(EXIT_WAIT_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        popen.kill()
    popen.wait()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    if popen.stdout is not None:
        popen.stdout.close()
    shutil.rmtree(directory, ignore_errors=True)


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


class SandboxProcess:
    """A running child; :meth:`request` sends a frame and waits for the final reply."""

    def __init__(
        self,
        argv: list[str],
        worker_id: str,
        gateway: GatewayHandler,
        *,
        wrapper: Wrapper | None = None,
        files: Mapping[str, str] | None = None,
    ) -> None:
        """``files`` (name -> text) are written into the child's directory before it starts;
        ``wrapper`` puts a per-child command (bwrap, which binds them) before ``argv``."""
        self.worker_id = worker_id
        self.broken = False
        #: Entry point the child reported (``process`` or a WorkerBase subclass name).
        self.entry = ""
        #: Whether the child reported a health probe in the worker's code.
        self.probe = False
        #: CPU seconds the child may use in its lifetime (RLIMIT_CPU).
        self.cpu_limit_s = float("inf")
        self._gateway = gateway
        self._buffer = FrameBuffer()
        self._pending: list[bytes] = []
        self._partial_line = b""
        #: The sys.path sent with ``init``, kept until the child's first reply (see _raise_died).
        self._startup_sys_path: list[str] | None = None
        self.output_tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        self.directory = tempfile.mkdtemp(prefix="wm-py-")
        try:
            self._write_files(files or {})
            self._popen, self._to_child, self._from_child = self._spawn(argv, wrapper)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._output = self._popen.stdout.fileno() if self._popen.stdout else -1
        self._finalizer = weakref.finalize(
            self, _terminate, self._popen, [self._to_child, self._from_child], self.directory
        )
        self._poll = select.poll()
        self._poll.register(self._from_child, select.POLLIN)
        self._poll.register(self._output, select.POLLIN)

    def _write_files(self, files: Mapping[str, str]) -> None:
        for name, text in files.items():
            with open(os.path.join(self.directory, name), "w", encoding="utf-8") as handle:
                handle.write(text)

    def _spawn(
        self, argv: list[str], wrapper: Wrapper | None
    ) -> tuple[subprocess.Popen[bytes], int, int]:
        prefix, extra_fds = wrapper(self.directory) if wrapper is not None else ([], ())
        try:
            return self._popen_child([*prefix, *argv], extra_fds)
        finally:
            for fd in extra_fds:
                os.close(fd)

    def _popen_child(
        self, argv: list[str], extra_fds: tuple[int, ...]
    ) -> tuple[subprocess.Popen[bytes], int, int]:
        child_reads, host_writes = os.pipe()
        host_reads, child_writes = os.pipe()
        try:
            popen = subprocess.Popen(
                [*argv, str(child_reads), str(child_writes)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(child_reads, child_writes, *extra_fds),
                cwd=self.directory,
                env={},
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            for fd in (child_reads, host_writes, host_reads, child_writes):
                os.close(fd)
            raise WorkerExecutionError(f"cannot start the Python sandbox: {exc}") from exc
        os.close(child_reads)
        os.close(child_writes)
        os.set_blocking(host_writes, False)
        return popen, host_writes, host_reads

    @property
    def pid(self) -> int:
        """Host pid of the interpreter: under bwrap, the grandchild of the spawned process
        (bwrap's reaper is pid 1 of the namespace, the interpreter its child)."""
        pid = self._popen.pid
        for _ in range(WRAPPER_DEPTH):
            children = _children(pid)
            if len(children) != 1:
                break
            pid = children[0]
        return pid

    @property
    def exited(self) -> bool:
        """Whether the child ended on its own (e.g. killed by an rlimit while idle)."""
        return self._popen.poll() is not None

    def kill(self) -> None:
        """Kill and reap the child and remove its directory (idempotent)."""
        self.broken = True
        self._finalizer()

    def request(self, message: dict[str, Any] | bytes, deadline: float) -> dict[str, Any]:
        """Send ``message`` (a dict or an encoded body) and return the child's final reply.

        ``log`` and ``gateway`` frames are served while waiting. Raises WorkerTimeout when
        ``deadline`` (a ``time.monotonic`` value) passes, WorkerExecutionError when the child
        dies or breaks the protocol; either way the process is marked broken.
        """
        try:
            if isinstance(message, dict) and message.get("op") == "init":
                self._startup_sys_path = list(message.get("sys_path", []))
            frame = pack(message) if isinstance(message, dict) else pack_body(message)
            self._send(frame, deadline)
            reply = self._await_reply(deadline)
            self._startup_sys_path = None
            return reply
        except (WorkerExecutionError, FrameError, OSError) as exc:
            self.broken = True
            if isinstance(exc, WorkerExecutionError):
                raise
            raise WorkerExecutionError(f"protocol failure with the Python sandbox: {exc}") from exc

    def _await_reply(self, deadline: float) -> dict[str, Any]:
        while True:
            message = self._next_message(deadline)
            op = message["op"]
            if op == "log":
                self._log(message)
            elif op == "gateway":
                reply = self._gateway(message, deadline - time.monotonic())
                self._send(pack(reply), deadline)
            else:
                return message

    def _send(self, frame: bytes, deadline: float) -> None:
        view = memoryview(frame)
        while view:
            try:
                view = view[os.write(self._to_child, view) :]
            except BlockingIOError:
                self._wait_writable(deadline)
            except BrokenPipeError:
                self._raise_died()

    def _wait_writable(self, deadline: float) -> None:
        poll = select.poll()
        poll.register(self._to_child, select.POLLOUT)
        while not poll.poll(self._remaining_ms(deadline)):
            pass

    def _remaining_ms(self, deadline: float) -> int:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.broken = True
            raise WorkerTimeout("time limit exceeded")
        return max(1, int(remaining * 1000))

    def _next_message(self, deadline: float) -> dict[str, Any]:
        while not self._pending:
            for fd, _ in self._poll.poll(self._remaining_ms(deadline)):
                if fd == self._output:
                    self._read_output()
                    continue
                chunk = os.read(self._from_child, READ_CHUNK_BYTES)
                if not chunk:
                    self._raise_died()
                self._pending.extend(self._buffer.feed(chunk))
        return unpack(self._pending.pop(0))

    def _raise_died(self) -> None:
        self.broken = True
        try:
            returncode: int | None = self._popen.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        while self._output >= 0 and select.select([self._output], [], [], 0)[0]:
            self._read_output()
        summary = self.output_summary()
        raise WorkerExecutionError(
            f"the Python sandbox process {describe_exit(returncode)}{self._startup_hint()}{summary}"
        )

    def _startup_hint(self) -> str:
        """Why a child died importing its own code: the worker-side ModuleNotFoundError alone
        does not say where the child looked."""
        if self._startup_sys_path is None:
            return ""
        for line in reversed(self.output_tail):
            found = _MISSING_MODULE.search(line)
            if found:
                return (
                    f" while starting: module {found.group(1)!r} was not found (sys.path sent "
                    f"to it: {self._startup_sys_path}, interpreter {sys.executable})"
                )
        return " while starting"

    def output_summary(self) -> str:
        """The last lines the child printed, for error messages."""
        if self._partial_line:
            self._emit_line(self._partial_line)
            self._partial_line = b""
        return "; last output: " + " | ".join(self.output_tail) if self.output_tail else ""

    def _read_output(self) -> None:
        """Forward what the child printed (its stdout/stderr pipe is readable)."""
        chunk = os.read(self._output, READ_CHUNK_BYTES)
        if not chunk:
            self._poll.unregister(self._output)
            self._output = -1
            return
        lines = (self._partial_line + chunk).split(b"\n")
        self._partial_line = lines.pop()
        for line in lines:
            self._emit_line(line)

    def _emit_line(self, raw: bytes) -> None:
        line = raw[:MAX_LOG_LINE_BYTES].decode("utf-8", "replace").rstrip()
        self.output_tail.append(line)
        logger.info("python worker %s output: %s", self.worker_id, line)

    def _log(self, message: dict[str, Any]) -> None:
        level = _LOG_LEVELS.get(str(message.get("level")), logging.INFO)
        logger.log(level, "python worker %s: %s", self.worker_id, message.get("message"))


def interpreter_argv(
    prefix: tuple[str, ...] | list[str], bootstrap: str, executable: str | None = None
) -> list[str]:
    """The child's command line, without the two pipe fds the spawn appends.

    The host's own interpreter, also inside a virtualenv: ``-I -S`` keep the venv's
    site-packages off the child's path, its standard library comes from the base installation
    either way, and ``init`` replaces ``sys.path`` before anything else is imported.
    ``executable`` overrides it (bwrap execs the real file behind a venv's symlink).
    """
    if not sys.executable:
        raise WorkerExecutionError(
            "cannot start the Python sandbox: this process does not know its interpreter "
            "(sys.executable is empty)"
        )
    return [*prefix, executable or sys.executable, "-I", "-S", "-B", bootstrap]
