"""The Python engine (``text/x-python``): worker code in a persistent sandboxed subprocess.

One child per loaded worker per host process, started by ``load`` (which is also the
contract check: the module body runs in the sandbox and must define ``process(event)`` or a
``wm.devkit.WorkerBase`` subclass), reused across messages, replaced on hot reload, killed on
timeout or crash and started again lazily by the next message. A lock keeps one message (or
health probe) in flight per child; ``load`` takes it too, so messages in flight finish on the
old code.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from engines.childproc import frames
from engines.childproc.limits import Limits
from engines.python import isolation
from engines.python.process import GatewayHandler, SandboxProcess, interpreter_argv
from engines.python.protocol import answer_event, event_body
from wm.config import Settings
from wm.devkit.gateway import GatewayCaller
from wm.engine import Engine, Outputs, WorkerSpec
from wm.errors import EventDecodeError, InvalidCode, WorkerExecutionError, WorkerTimeout
from wm.events import CloudEvent
from wm.workersettings import SettingRule

logger = logging.getLogger(__name__)

#: seconds added to the message time limit for starting a child and running the module body.
STARTUP_ALLOWANCE_S = 10.0
#: Name of the worker's code file in its sandbox directory (shown in tracebacks).
WORKER_FILE = "worker.py"
#: Share of a child's lifetime CPU limit after which it is replaced between messages.
CPU_RECYCLE_SHARE = 0.5


class PythonWorkerError(WorkerExecutionError):
    """Raised when Python worker code raises; ``error_type`` and ``traceback`` say where."""

    def __init__(self, message: str, error_type: str, traceback: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.traceback = traceback


def _refuse_gateway(request: dict[str, Any], remaining_s: float) -> dict[str, Any]:
    return {
        "ok": False,
        "error": "gateway calls are not made while code is being validated",
    }


def check_source(code: bytes) -> str:
    """Decode and compile ``code`` on the host (no execution): syntax errors with a line."""
    try:
        source = code.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidCode(f"Python worker code must be UTF-8: {exc}") from exc
    try:
        compile(source, "worker.py", "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise InvalidCode(
            f"Python worker code does not compile: {exc.msg} (line {exc.lineno}, "
            f"column {exc.offset})"
        ) from exc
    except (ValueError, RecursionError, MemoryError) as exc:
        raise InvalidCode(f"Python worker code does not compile: {exc}") from exc
    return source


class PythonEngine(Engine):
    """Runs Python worker code in a sandboxed subprocess (see the package docs)."""

    mime_type = "text/x-python"
    worker_settings = {
        "memory_mb": SettingRule(),
        "cpu_limit_s": SettingRule((int, float)),
    }

    @classmethod
    def check_host(cls, settings: Settings) -> None:
        """WM_SANDBOX_REQUIRE: every named layer is active here (they are logged), or the
        node refuses to start."""
        isolation.check_required(settings.sandbox_require)

    @classmethod
    def host_facts(cls, settings: Settings) -> dict[str, Any]:
        layers = isolation.kernel_isolation().layers
        return {
            "sandbox_layers": list(layers),
            "sandbox_missing": [name for name in isolation.WANTED_LAYERS if name not in layers],
            "limit_layers": list(isolation.limit_layers()),
        }

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        isolation.check_required(settings.sandbox_require)
        self._lock = threading.Lock()
        self._gateway = GatewayCaller(settings)
        self._source: str | None = None
        self._worker: WorkerSpec | None = None
        self._process: SandboxProcess | None = None

    @property
    def pid(self) -> int | None:
        """Process id of the current child (None before the first spawn or after a kill)."""
        process = self._process
        return process.pid if process is not None else None

    @property
    def isolation_layers(self) -> tuple[str, ...]:
        """Kernel-level layers this host permits (probed once per process)."""
        return isolation.kernel_isolation().layers

    def validate(self, code: bytes, worker: WorkerSpec) -> None:
        """Compile on the host, run the contract check in a throwaway sandbox; no side effects.

        The engine's loaded worker is untouched, and gateway calls made by the module body are
        refused (validation must not reach backends).
        """
        source = check_source(code)
        self._start(source, worker, _refuse_gateway).kill()

    def load(self, code: bytes, worker: WorkerSpec) -> None:
        source = check_source(code)
        fresh = self._start(source, worker)
        with self._lock:
            previous, self._process = self._process, fresh
            self._source, self._worker = source, worker
        if previous is not None:
            previous.kill()
        logger.info(
            "python worker %s v%s loaded in sandbox pid %s (entry %s)",
            worker.worker_id,
            worker.version,
            fresh.pid,
            fresh.entry,
        )

    def process(self, event: CloudEvent, timeout_s: float) -> list[CloudEvent]:
        with self._lock:
            process = self._ready()
            try:
                return self._exchange(process, event, timeout_s)
            finally:
                self._drop_if_broken(process)

    def process_batch(
        self, events: Sequence[CloudEvent], timeout_s: float
    ) -> list[list[CloudEvent] | Exception]:
        """One frame with the events and one answer each, each event within ``timeout_s``.
        An event that fails, outlives its limit or ends the sandbox fails alone: the events
        after one that ended (or broke) the sandbox go to a fresh one."""
        results: list[list[CloudEvent] | Exception] = []
        with self._lock:
            while len(results) < len(events):
                try:
                    process = self._ready()
                except WorkerExecutionError as exc:  # no sandbox: every event left fails
                    return results + [exc] * (len(events) - len(results))
                try:
                    results += self._exchange_batch(process, events[len(results) :], timeout_s)
                finally:
                    self._drop_if_broken(process)
        return results

    def probe(self, timeout_s: float) -> bool | None:
        """The code's ``probe()`` (a function, or a WorkerBase method), run in the sandbox
        after the messages in flight, like a message: past ``timeout_s`` its sandbox is killed
        and :class:`~wm.errors.WorkerTimeout` raised. True when it passed, None without a
        probe. Never False: a probe that raised is a :class:`PythonWorkerError`, a false
        answer a :class:`~wm.errors.WorkerExecutionError` naming it (``probe() returned
        None``: the worker forgot to return True)."""
        with self._lock:
            process = self._ready()
            if not process.probe:
                return None
            try:
                return self._ask_probe(process, timeout_s)
            finally:
                self._drop_if_broken(process)

    def _ready(self) -> SandboxProcess:
        """The child that runs the code, started again if it ended (call with the lock)."""
        if self._source is None or self._worker is None:
            raise WorkerExecutionError("PythonEngine called before load()")
        process = self._process
        if process is not None and process.exited:
            process.kill()
            process = None
        if process is None:
            process = self._process = self._restart(self._source, self._worker)
        return process

    def _drop_if_broken(self, process: SandboxProcess) -> None:
        if process.broken:
            process.kill()
            self._process = None

    def close(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            process.kill()

    def stops_calls(self) -> bool:
        return True  # the code runs in a sandbox process, killed at the limit

    def processes(self) -> list[int]:
        process = self._process
        return [process.pid] if process is not None and not process.exited else []

    def _start(
        self, source: str, worker: WorkerSpec, gateway: GatewayHandler | None = None
    ) -> SandboxProcess:
        """A child that ran the module body and passed the contract check."""
        config = self._launch_config(source, worker)
        code = config.pop("code")
        process = self._spawn(worker, gateway or self._gateway_handler(worker), source)
        process.cpu_limit_s = config["limits"]["cpu_s"]
        config["write_root"] = process.directory
        config["filename"] = os.path.join(process.directory, WORKER_FILE)
        load_timeout_s = self.settings.message_handling_timeout_seconds + STARTUP_ALLOWANCE_S
        try:
            kind, reply = process.init(config, code, time.monotonic() + load_timeout_s)
        except WorkerTimeout as exc:
            process.kill()
            raise InvalidCode(
                f"Python worker code did not finish loading within {load_timeout_s:g} s"
            ) from exc
        except BaseException:
            process.kill()
            raise
        return self._accept(process, kind, reply)

    def _spawn(self, worker: WorkerSpec, gateway: GatewayHandler, source: str) -> SandboxProcess:
        """A started child with the worker's code in its directory (before any wrapper binds
        that directory)."""
        layers = isolation.kernel_isolation()
        paths = isolation.sandbox_paths(tuple(self.settings.python_allowed_packages))
        # The wrapper puts the kernel layers' command (bwrap, or the fixed prefix) first.
        argv = interpreter_argv((), isolation.BOOTSTRAP, isolation.interpreter(layers))

        def wrapper(directory: str) -> tuple[list[str], tuple[int, ...]]:
            return isolation.child_wrapper(layers, paths, directory)

        return SandboxProcess(
            argv,
            worker.worker_id,
            gateway,
            wrapper=wrapper,
            files={WORKER_FILE: source},
            limits=Limits.from_settings(self.settings),
            spin_s=self.settings.engine_spin_s,
        )

    def _accept(
        self, process: SandboxProcess, kind: bytes, reply: dict[str, Any]
    ) -> SandboxProcess:
        if kind == frames.READY:
            process.entry = str(reply.get("entry"))
            process.probe = reply.get("probe") is True
            return process
        process.kill()
        if kind == frames.FAILED:
            raise InvalidCode(f"Python worker code refused: {reply.get('message')}")
        raise WorkerExecutionError(
            f"the Python sandbox failed to start: a {kind!r} frame {reply}"
            f"{process.output_summary()}"
        )

    def _restart(self, source: str, worker: WorkerSpec) -> SandboxProcess:
        try:
            process = self._start(source, worker)
        except InvalidCode as exc:
            raise WorkerExecutionError(f"restarting the Python sandbox failed: {exc}") from exc
        logger.info("python worker %s restarted in sandbox pid %s", worker.worker_id, process.pid)
        return process

    def _launch_config(self, source: str, worker: WorkerSpec) -> dict[str, Any]:
        allowed = tuple(self.settings.python_allowed_packages)
        paths = isolation.sandbox_paths(allowed)
        limits = isolation.resource_limits(
            worker.settings, self.settings.message_handling_timeout_seconds
        )
        return {
            "worker_id": worker.worker_id,
            "code": source,
            "sys_path": list(paths.sys_path),
            "packages": dict(paths.packages),
            "read_roots": list(paths.read_roots),
            "list_roots": list(paths.list_roots),
            "native_roots": list(paths.native_roots),
            "allowed": list(allowed),
            "allow_ctypes": paths.third_party,
            "limits": limits,
        }

    def _gateway_handler(self, worker: WorkerSpec) -> GatewayHandler:
        def handle(request: dict[str, Any], remaining_s: float) -> dict[str, Any]:
            return self._gateway.reply(request, remaining_s, worker.worker_id)

        return handle

    def _exchange(
        self, process: SandboxProcess, event: CloudEvent, timeout_s: float
    ) -> list[CloudEvent]:
        what = f"Python worker {process.worker_id} did not finish event {event.get_id()}"
        reply = self._request(process, frames.CALL, event_body(event), timeout_s, what, "failed")
        return self._outputs(process, reply)

    def _exchange_batch(
        self, process: SandboxProcess, events: Sequence[CloudEvent], timeout_s: float
    ) -> Iterator[list[CloudEvent] | Exception]:
        """Send ``events`` in one BATCH frame, then yield each one's outcome as its answer
        comes, each within ``timeout_s``; stop after one that breaks the sandbox."""
        payload = b"[" + b",".join(event_body(event) for event in events) + b"]"
        try:
            try:
                process.send(frames.BATCH, payload, time.monotonic() + timeout_s)
            except WorkerTimeout as exc:
                raise _late(process, timeout_s, "the batch was not taken") from exc
        except WorkerExecutionError as exc:
            yield exc  # the first event's failure: the rest go to a fresh sandbox
            return
        for event in events:
            what = f"Python worker {process.worker_id} did not finish event {event.get_id()}"
            try:
                deadline = time.monotonic() + timeout_s
                reply = self._reply(process, deadline, timeout_s, what, "failed")
                yield self._outputs(process, reply)
            except WorkerExecutionError as exc:
                yield exc
            if process.broken:
                return

    def _ask_probe(self, process: SandboxProcess, timeout_s: float) -> bool:
        what = f"the probe of Python worker {process.worker_id} did not finish"
        reply = self._request(process, frames.PROBE, b"", timeout_s, what, "probe failed")
        self._recycle_if_spent(process, reply)
        if reply.get("ok") is not True:  # raised rather than False: the reason says why
            raise WorkerExecutionError(
                f"Python worker {process.worker_id}'s probe failed: {reply.get('message')}"
            )
        return True

    def _request(
        self,
        process: SandboxProcess,
        kind: bytes,
        payload: bytes,
        timeout_s: float,
        late: str,
        failed: str,
    ) -> dict[str, Any]:
        """The child's ANSWER to a frame; its FAILED reply raised as the worker's error
        (``failed``), a timeout as :class:`WorkerTimeout` (``late`` says what did not
        finish: the child is killed, a fresh one answers the next call)."""
        deadline = time.monotonic() + timeout_s
        try:
            process.send(kind, payload, deadline)
        except WorkerTimeout as exc:
            raise _late(process, timeout_s, late) from exc
        return self._reply(process, deadline, timeout_s, late, failed)

    def _reply(
        self, process: SandboxProcess, deadline: float, timeout_s: float, late: str, failed: str
    ) -> dict[str, Any]:
        """The child's next ANSWER, as :meth:`_request` reads it."""
        try:
            answered, reply = process.receive(deadline)
        except WorkerTimeout as exc:
            raise _late(process, timeout_s, late) from exc
        if answered == frames.FAILED:
            self._raise_worker_error(process, reply, failed)
        if answered != frames.ANSWER:
            process.broken = True
            raise WorkerExecutionError(f"protocol violation: unexpected {answered!r} frame")
        return reply

    @staticmethod
    def _raise_worker_error(process: SandboxProcess, reply: dict[str, Any], what: str) -> NoReturn:
        if reply.get("fatal"):
            process.broken = True
        raise PythonWorkerError(
            f"Python worker {process.worker_id} {what}: {reply.get('message')}",
            str(reply.get("type")),
            str(reply.get("traceback", "")),
        )

    @staticmethod
    def _recycle_if_spent(process: SandboxProcess, reply: dict[str, Any]) -> None:
        """Mark the child for replacement once it used its share of its CPU limit."""
        cpu_s = reply.get("cpu_s")
        if isinstance(cpu_s, int | float) and cpu_s > CPU_RECYCLE_SHARE * process.cpu_limit_s:
            logger.info(
                "python worker %s used %.1f s CPU; recycling its sandbox", process.worker_id, cpu_s
            )
            process.broken = True

    def _outputs(self, process: SandboxProcess, reply: dict[str, Any]) -> list[CloudEvent]:
        self._recycle_if_spent(process, reply)
        try:
            events = [answer_event(raw) for raw in reply.get("events", [])]
        except (EventDecodeError, TypeError) as exc:
            raise WorkerExecutionError(f"Python worker returned an invalid event: {exc}") from exc
        done = reply.get("done")
        return events if done is None else Outputs(events, done=str(done))


def _late(process: SandboxProcess, timeout_s: float, late: str) -> WorkerTimeout:
    """The WorkerTimeout raised again saying what did not finish (``late``); a plain
    ``try`` at each call, not a context manager: this is on every round trip."""
    return WorkerTimeout(
        f"{late} within {timeout_s:g} s; its sandbox (pid {process.pid}) was killed and "
        "a fresh one starts with the next call"
    )
