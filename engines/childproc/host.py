"""The host's end of a child process: the Python sandbox, or an isolated worker's helper.

A :class:`ChildProcess` is started as its :class:`Launch` says, with the two frame pipes
(:mod:`engines.childproc.frames`), its own session (so ``os.killpg`` reaches everything it
starts), and optionally a fresh private directory as its working directory and its output
read through a third pipe, line by line. Every wait is bounded by a deadline; while waiting
for a reply the host serves the child's LOG and GATEWAY frames through its :class:`Sinks`
and reads what it prints. The child is killed with SIGKILL and always reaped, its pipes
closed and its directory removed, also when its owner forgets to (``weakref`` finalizer), so
no zombie or directory is left behind.

It reports facts, not words: :class:`ChildExited` (with the exit status),
:class:`~wm.errors.WorkerTimeout` (the deadline passed),
:class:`~engines.childproc.frames.FrameError` (the child broke the protocol). Each engine
says in its own words what they mean for its users, and decides what to restart.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from engines.childproc import frames
from engines.childproc.limits import Cgroups, Limits, cgroups_for
from wm.engine import child_pids
from wm.errors import WorkerExecutionError, WorkerTimeout

#: Lines of the child's output kept to explain its end.
OUTPUT_TAIL_LINES = 20
#: bytes of one output line passed on.
MAX_OUTPUT_LINE_BYTES = 4096
#: seconds to wait for a child that closed its pipe (or was told to finish) to exit.
EXIT_WAIT_S = 1.0

#: The child's directory -> (argv placed before the command, fds to pass then close).
Wrapper = Callable[[str], tuple[list[str], tuple[int, ...]]]


class Sinks(Protocol):
    """What the host does for the child's code: its log lines and its gateway calls. A
    gateway call gets the GATEWAY header (``service``, ``method`` and what else the engine
    sends), the request, and the deadline of the exchange it is part of; it answers the
    GATEWAY_REPLY's code and response."""

    def log(self, level: int, message: str) -> None: ...

    def gateway(
        self, call: dict[str, Any], request: bytes, deadline: float
    ) -> tuple[int, bytes]: ...


@dataclass(frozen=True)
class Launch:
    """How a child starts: ``argv`` with the descriptors of its two frame pipes appended (it
    reads frames from the first, writes them to the second), and the whole environment."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    #: Files (name -> text) of a fresh directory that is the child's working directory and
    #: is removed with it; None: no directory, the host's working directory.
    files: Mapping[str, str] | None = None
    directory_prefix: str = "wm-child-"
    #: A per-child command put before ``argv`` (bwrap, binding the directory). Its own child
    #: (a PID namespace's init) is killed first, so everything under it is gone at the reap.
    wrapper: Wrapper | None = None
    #: Gets each line the child prints (stdout and stderr); None: they are the host's own.
    output: Callable[[str], None] | None = None
    #: What the child and everything it starts may use together, enforced by cgroups of
    #: its own where the host has them (:mod:`engines.childproc.limits`); None: no cgroups.
    limits: Limits | None = None
    #: Seconds the host polls for the child's reply before it sleeps on it
    #: (:class:`~engines.childproc.frames.Spin`); 0: it sleeps at once.
    spin_s: float = 0.0

    def __post_init__(self) -> None:
        if self.wrapper is not None and self.files is None:
            raise ValueError("a wrapper binds the child's directory: give it files (maybe {})")


class ChildExited(WorkerExecutionError):
    """Raised when the child closed its pipe or ended; ``returncode`` is None when it had not
    ended within EXIT_WAIT_S after closing its pipe."""

    def __init__(self, pid: int, returncode: int | None) -> None:
        super().__init__(f"child process {pid} ended (status {returncode})")
        self.pid, self.returncode = pid, returncode


def _terminate(
    popen: subprocess.Popen[bytes],
    fds: list[int],
    directory: str | None,
    wrapped: bool,
    cgroups: Cgroups | None,
) -> None:
    """Kill the child's process group, reap the child, close pipes, remove its directory
    and its cgroups (killing what is left in them: processes that left its session).

    Under a wrapper the spawned process's own children are killed first: for bwrap that is
    the PID namespace's init, whose end makes the kernel kill everything in the namespace,
    so the interpreter is dead when the wait returns (killing bwrap first would leave that
    to an asynchronous parent-death signal).
    """
    inner = child_pids(popen.pid) if wrapped and popen.poll() is None else []
    for pid in inner:
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
    if cgroups is not None:
        cgroups.remove()
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())
    if popen.stdout is not None:
        popen.stdout.close()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class ChildProcess:
    """A running child; :meth:`request` sends a frame and returns the child's reply."""

    def __init__(self, launch: Launch, sinks: Sinks) -> None:
        """Start the child; OSError (with nothing left behind) if it cannot be."""
        self.launch, self.sinks = launch, sinks
        self.output_tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        self._partial_line = b""
        self._buffer = frames.FrameBuffer()
        self._pending: collections.deque[frames.Frame] = collections.deque()
        self._spin = frames.Spin(launch.spin_s)
        self.directory = self._make_directory()
        self._cgroups: Cgroups | None = None
        try:
            self._cgroups = cgroups_for(launch.limits)
            self._popen, self._to_child, self._from_child = self._spawn()
        except BaseException:
            if self._cgroups is not None:
                self._cgroups.remove()
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._fds = [self._to_child, self._from_child]
        self._output = self._popen.stdout.fileno() if self._popen.stdout else -1
        wrapped = launch.wrapper is not None
        self._finalizer = weakref.finalize(
            self, _terminate, self._popen, self._fds, self.directory, wrapped, self._cgroups
        )
        self._poll = select.poll()
        self._poll.register(self._from_child, select.POLLIN)
        if self._output >= 0:
            self._poll.register(self._output, select.POLLIN)

    def _make_directory(self) -> str | None:
        if self.launch.files is None:
            return None
        directory = tempfile.mkdtemp(prefix=self.launch.directory_prefix)
        try:
            for name, text in self.launch.files.items():
                with open(os.path.join(directory, name), "w", encoding="utf-8") as handle:
                    handle.write(text)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return directory

    def _spawn(self) -> tuple[subprocess.Popen[bytes], int, int]:
        prefix: list[str] = []
        extra_fds: tuple[int, ...] = ()
        if self.launch.wrapper is not None:
            assert self.directory is not None  # Launch refuses a wrapper without files
            prefix, extra_fds = self.launch.wrapper(self.directory)
        if self._cgroups is not None:
            prefix = [*self._cgroups.join_argv(), *prefix]
        try:
            return self._popen_child([*prefix, *self.launch.argv], extra_fds)
        finally:
            for fd in extra_fds:
                os.close(fd)

    def _popen_child(
        self, argv: list[str], extra_fds: tuple[int, ...]
    ) -> tuple[subprocess.Popen[bytes], int, int]:
        child_reads, host_writes = os.pipe()
        host_reads, child_writes = os.pipe()
        captured = self.launch.output is not None
        try:
            popen = subprocess.Popen(
                [*argv, str(child_reads), str(child_writes)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if captured else None,
                stderr=subprocess.STDOUT if captured else None,
                pass_fds=(child_reads, child_writes, *extra_fds),
                cwd=self.directory,
                env=dict(self.launch.env),
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            for fd in (host_writes, host_reads):
                os.close(fd)
            raise
        finally:
            os.close(child_reads)
            os.close(child_writes)
        os.set_blocking(host_writes, False)
        return popen, host_writes, host_reads

    @property
    def pid(self) -> int:
        """The spawned process's pid (under a wrapper, the wrapper's)."""
        return self._popen.pid

    @property
    def exited(self) -> bool:
        """Whether the child ended (on its own, e.g. killed by an rlimit while idle, or
        closed)."""
        return self._popen.poll() is not None

    @property
    def returncode(self) -> int | None:
        """The child's exit status once it ended (negative: killed by that signal)."""
        return self._popen.poll()

    def close(self, grace_s: float = 0.0) -> None:
        """End the child: with ``grace_s``, its frame pipe is closed first (an idle child
        then unloads its code and exits) and it gets that long to; then it is killed,
        reaped, its pipes closed and its directory removed. Idempotent."""
        if grace_s > 0 and self._finalizer.alive and not self.exited:
            if self._to_child in self._fds:
                self._fds.remove(self._to_child)
                os.close(self._to_child)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(grace_s)
        self._finalizer()

    def request(self, kind: bytes, payload: bytes, deadline: float) -> frames.Frame:
        """Send a frame, then :meth:`receive` the reply."""
        self.send(kind, payload, deadline)
        return self.receive(deadline)

    def send(self, kind: bytes, payload: bytes, deadline: float) -> None:
        """Write a frame by ``deadline`` (a ``time.monotonic`` value)."""
        view = memoryview(frames.encode(kind, payload))
        while view:
            try:
                view = view[os.write(self._to_child, view) :]
            except BlockingIOError:
                self._wait_writable(deadline)
            except BrokenPipeError:
                raise self._gone() from None

    def receive(self, deadline: float) -> frames.Frame:
        """The child's next frame other than LOG and GATEWAY, which are served meanwhile.

        Raises WorkerTimeout when ``deadline`` passes, ChildExited when the child closes its
        pipe, FrameError when it breaks the protocol.
        """
        while True:
            kind, payload = self._next_frame(deadline)
            if kind == frames.LOG:
                level, message = frames.split_code(payload)
                self.sinks.log(level, message.decode("utf-8", "replace"))
            elif kind == frames.GATEWAY:
                call, request = frames.split_header(payload)
                code, answer = self.sinks.gateway(call, request, deadline)
                self.send(frames.GATEWAY_REPLY, frames.with_code(code, answer), deadline)
            else:
                return kind, payload

    def _wait_writable(self, deadline: float) -> None:
        poll = select.poll()
        poll.register(self._to_child, select.POLLOUT)
        while not poll.poll(_remaining_ms(deadline)):
            pass

    def _next_frame(self, deadline: float) -> frames.Frame:
        while not self._pending:
            for fd, _ in self._spin.wait(self._poll, _remaining_ms(deadline)):
                if fd == self._output:
                    self._read_output()
                    continue
                chunk = os.read(self._from_child, frames.READ_CHUNK_BYTES)
                if not chunk:
                    raise self._gone()
                self._pending.extend(self._buffer.feed(chunk))
        return self._pending.popleft()

    def _gone(self) -> ChildExited:
        """What to raise for a child that closed its pipe: its exit status (once it ended),
        with everything it printed read."""
        try:
            returncode: int | None = self._popen.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        while self._output >= 0 and select.select([self._output], [], [], 0)[0]:
            self._read_output()
        return ChildExited(self._popen.pid, returncode)

    # -- what the child prints ---------------------------------------------------------------

    def output_summary(self) -> str:
        """The last lines the child printed, for error messages."""
        if self._partial_line:
            self._emit_line(self._partial_line)
            self._partial_line = b""
        return "; last output: " + " | ".join(self.output_tail) if self.output_tail else ""

    def _read_output(self) -> None:
        chunk = os.read(self._output, frames.READ_CHUNK_BYTES)
        if not chunk:
            self._poll.unregister(self._output)
            self._output = -1
            return
        lines = (self._partial_line + chunk).split(b"\n")
        self._partial_line = lines.pop()
        for line in lines:
            self._emit_line(line)

    def _emit_line(self, raw: bytes) -> None:
        line = raw[:MAX_OUTPUT_LINE_BYTES].decode("utf-8", "replace").rstrip()
        self.output_tail.append(line)
        if self.launch.output is not None:
            self.launch.output(line)


def _remaining_ms(deadline: float) -> int:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise WorkerTimeout("time limit exceeded")
    return max(1, int(remaining * 1000))
