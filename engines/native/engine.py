"""The native engine (``application/x-native-dll``): a worker library called in-process over
cffi, or in a helper process when isolated (see the package docs)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from engines.isolation.host import HelperProcess
from engines.native import codec
from engines.native.isolated import start_helper
from engines.native.library import (
    GATEWAY_BAD_REQUEST,
    GATEWAY_FAILED,
    GATEWAY_OK,
    NativeLibrary,
    NativeOutputRefused,
    error_json,
)
from engines.native.package import ISOLATION_MODES, Package, library_file, read_package
from wm.config import Settings
from wm.devkit.gateway import GatewayCaller
from wm.devkit.worker import ERROR_TYPE_SUFFIX
from wm.engine import Engine, Outputs, WorkerSpec
from wm.errors import (
    EventDecodeError,
    GatewayError,
    InvalidCode,
    WorkerExecutionError,
    WorkerTimeout,
)
from wm.events import CloudEvent, make_event
from wm.workersettings import SettingRule

logger = logging.getLogger(__name__)
worker_logger = logging.getLogger("engines.native.worker")

#: Environment variables that tell a native worker who it is (set before its library loads).
IDENTITY = (
    "VIRTUFIN_WORKER_ID",
    "VIRTUFIN_WORKER_GROUP",
    "VIRTUFIN_WORKER_TOPIC",
    "VIRTUFIN_TENANT_ID",
)
#: Worker settings read by this engine.
ISOLATION, API_HOST, API_PORT = "isolation", "api_host", "api_port"

T = TypeVar("T")


class Runner(Protocol):
    def call(self, request: bytes, timeout_s: float) -> bytes: ...

    def probe(self, timeout_s: float) -> bool | None: ...

    def close(self) -> None: ...


def identity(worker: WorkerSpec) -> dict[str, str | None]:
    facts = (worker.worker_id, worker.group, worker.topic, worker.tenant)
    return dict(zip(IDENTITY, facts, strict=True))


class Sinks:
    """The host callbacks of one loaded worker: its log and its gateway."""

    def __init__(self, settings: Settings, worker: WorkerSpec) -> None:
        self.worker = worker
        self.gateway_caller = GatewayCaller(settings)
        self.deadline = threading.local()

    def log(self, level: int, message: str) -> None:
        worker_logger.log(level, "native worker %s: %s", self.worker.worker_id, message)

    def gateway(self, service: str, method: str, request: bytes) -> tuple[int, bytes]:
        """``host->gateway_call``: the JSON request to the worker's api_host:api_port."""
        try:
            data = json.loads(request) if request else None
        except (UnicodeDecodeError, ValueError) as exc:
            return GATEWAY_BAD_REQUEST, error_json(f"gateway request is not JSON: {exc}")
        host, port = self.worker.settings.get(API_HOST), self.worker.settings.get(API_PORT)
        if host is None or port is None:
            return GATEWAY_FAILED, error_json(
                f"worker {self.worker.worker_id} has no {API_HOST} and {API_PORT} settings "
                "for gateway calls"
            )
        deadline = getattr(self.deadline, "value", None)
        remaining_s = deadline - time.monotonic() if deadline else float("inf")
        call = {"host": host, "port": port, "service": service, "method": method, "data": data}
        try:
            answer = self.gateway_caller.call(call, remaining_s)
        except GatewayError as exc:
            logger.info("native worker %s: gateway call failed: %s", self.worker.worker_id, exc)
            return GATEWAY_FAILED, error_json(str(exc))
        return GATEWAY_OK, json.dumps(answer).encode()


class InProcess:
    """Calls the library on the caller's thread. A call past its time limit cannot be
    stopped: the watchdog logs it, and when it returns its answer is dropped as a timeout.
    A probe is bounded the same way."""

    def __init__(self, library: NativeLibrary, sinks: Sinks) -> None:
        self.library, self.sinks = library, sinks

    def call(self, request: bytes, timeout_s: float) -> bytes:
        return self._bounded(self.library.call, timeout_s, "Process", request)

    def probe(self, timeout_s: float) -> bool | None:
        return self._bounded(self.library.probe, timeout_s, "Probe")

    def _bounded(self, run: Callable[..., T], timeout_s: float, export: str, *args: Any) -> T:
        started = time.monotonic()
        self.sinks.deadline.value = started + timeout_s
        token = WATCHDOG.enter(started + timeout_s, self.sinks.worker.worker_id, export)
        try:
            answer = run(*args)
        finally:
            WATCHDOG.leave(token)
        elapsed_s = time.monotonic() - started
        if elapsed_s > timeout_s:
            raise WorkerTimeout(
                f"native worker {self.sinks.worker.worker_id} took {elapsed_s:.3g} s in "
                f"{export}, over its {timeout_s:g} s limit; its answer is dropped (in-process "
                "calls cannot be stopped: use isolation 'subprocess' to kill it at the limit)"
            )
        return answer

    def close(self) -> None:
        self.library.close()


class Watchdog:
    """Logs in-process calls still running past their time limit (once per call). Entering
    and leaving cost a dict write each: single dict operations are atomic in CPython."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[float, str, str]] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def enter(self, deadline: float, worker_id: str, export: str = "Process") -> int:
        token = next(self._tokens)
        self._calls[token] = (deadline, worker_id, export)
        if self._thread is None:
            self._start()
        return token

    def leave(self, token: int) -> None:
        self._calls.pop(token, None)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wm-native-watchdog")
                self._thread.daemon = True
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            for token, (deadline, worker_id, export) in list(self._calls.items()):
                if deadline < now and self._calls.pop(token, None) is not None:
                    logger.error(
                        "native worker %s is still in %s past its time limit; an "
                        "in-process call cannot be stopped apart from its process (the "
                        "node's watchdog ends a delivery's; isolation 'subprocess' kills it)",
                        worker_id,
                        export,
                    )


WATCHDOG = Watchdog()


class NativeEngine(Engine):
    """Runs a native worker zip (see the package docs)."""

    mime_type = "application/x-native-dll"
    worker_settings = {
        ISOLATION: SettingRule(text=True, choices=ISOLATION_MODES),
        API_HOST: SettingRule(text=True),
        API_PORT: SettingRule(),
    }

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._runner: Runner | None = None
        self._worker: WorkerSpec | None = None
        self._encoder = codec.Encoder()
        self._lock = threading.Lock()
        self._gate = threading.Condition(self._lock)  # the per-message path takes the lock alone
        self._in_flight = 0
        self._reloading = False
        self._saved_env: dict[str, str | None] | None = None

    def validate(self, code: bytes, worker: WorkerSpec) -> None:
        """Check the zip, then load the library and resolve its exports in a throwaway helper
        process: the library's initializers never run in the validating process."""
        package = read_package(code)
        _mode(package, worker)
        helper = start_helper(
            package, identity(worker), Sinks(self.settings, worker), self.settings
        )
        helper.close()

    def load(self, code: bytes, worker: WorkerSpec) -> None:
        package = read_package(code)
        mode = _mode(package, worker)
        sinks = Sinks(self.settings, worker)
        runner: Runner
        if mode == "subprocess":
            runner = start_helper(package, identity(worker), sinks, self.settings)
        else:
            self._set_identity(worker)
            runner = InProcess(_open(package, sinks, self.settings.max_output_bytes), sinks)
        with self._exclusive():
            previous, self._runner, self._worker = self._runner, runner, worker
        if previous is not None:
            previous.close()
        logger.info(
            "native worker %s v%s loaded: %s (%s, %s)",
            worker.worker_id,
            worker.version,
            package.entry,
            package.rid,
            mode,
        )

    def process(self, event: CloudEvent, timeout_s: float) -> list[CloudEvent]:
        try:
            request = self._encoder.encode(event)
        except codec.CodecError as exc:
            raise EventDecodeError(
                f"event {event.get_id()} cannot be written as a FlatBuffer CloudEvent: {exc}"
            ) from exc
        runner, worker = self._enter("process")
        try:
            answer = runner.call(request, timeout_s)
        finally:
            self._leave()
        try:
            response = codec.decode_response(answer)
        except codec.CodecError as exc:
            raise NativeOutputRefused(
                f"native worker {worker.worker_id} answered with an invalid WorkerResponse: {exc}"
            ) from exc
        if response.error is not None:
            return Outputs([_error_response(event, worker, response.error)], response.error)
        assert response.event is not None
        return [response.event]

    def probe(self, timeout_s: float) -> bool | None:
        """The library's optional Probe export (None without it), bounded as Process is: in a
        helper, killed past ``timeout_s``; in-process, its answer dropped as a WorkerTimeout
        when it returns late. A non-zero code is a NativeCallFailed that names it."""
        with self._loaded("probe") as (runner, _worker):
            return runner.probe(timeout_s)

    def close(self) -> None:
        with self._exclusive():
            runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()
        self._restore_identity()

    def stops_calls(self) -> bool:
        return isinstance(self._runner, HelperProcess)

    def processes(self) -> list[int]:
        runner = self._runner
        pid = runner.pid if isinstance(runner, HelperProcess) else None
        return [pid] if pid is not None else []

    @contextmanager
    def _loaded(self, method: str) -> Iterator[tuple[Runner, WorkerSpec]]:
        """The runner and worker loaded now, which a reload waits for until the block ends."""
        loaded = self._enter(method)
        try:
            yield loaded
        finally:
            self._leave()

    def _enter(self, method: str) -> tuple[Runner, WorkerSpec]:
        """The runner and worker loaded now, counted in flight until :meth:`_leave` (the
        per-message path, without a context manager's generator)."""
        with self._lock:
            while self._reloading:
                self._gate.wait()
            runner, worker = self._runner, self._worker
            if runner is None or worker is None:
                raise WorkerExecutionError(f"NativeEngine.{method}() called before load()")
            self._in_flight += 1
        return runner, worker

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._reloading and not self._in_flight:
                self._gate.notify_all()

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """No call in flight while inside; calls that arrive meanwhile wait, then see what
        was set inside (a reload applies to later calls only)."""
        with self._gate:
            while self._reloading:
                self._gate.wait()
            self._reloading = True
            while self._in_flight:
                self._gate.wait()
        try:
            yield
        finally:
            with self._gate:
                self._reloading = False
                self._gate.notify_all()

    def _set_identity(self, worker: WorkerSpec) -> None:
        """Set the identity variables, keeping the values they had before the first load."""
        if self._saved_env is None:
            self._saved_env = {name: os.environ.get(name) for name in IDENTITY}
        _apply_env(identity(worker))

    def _restore_identity(self) -> None:
        saved, self._saved_env = self._saved_env, None
        if saved is not None:
            _apply_env(saved)


def _apply_env(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _mode(package: Package, worker: WorkerSpec) -> str:
    mode: Any = worker.settings.get(ISOLATION) or package.manifest.isolation or "in-process"
    if mode not in ISOLATION_MODES:
        raise InvalidCode(
            f"worker setting {ISOLATION!r} is {mode!r}; use one of {', '.join(ISOLATION_MODES)}"
        )
    return str(mode)


def _open(package: Package, sinks: Sinks, max_output_bytes: int) -> NativeLibrary:
    manifest = package.manifest
    return NativeLibrary(
        package.library,
        library_file(manifest.library),
        manifest.entry_point,
        manifest.free_result,
        sinks.log,
        sinks.gateway,
        manifest.probe,
        max_output_bytes,
        worker_logger.isEnabledFor,
    )


def _error_response(event: CloudEvent, worker: WorkerSpec, message: str) -> CloudEvent:
    """The error response published for a worker's ``error_message``."""
    return make_event(
        event.get_type() + ERROR_TYPE_SUFFIX,
        f"/workers/{worker.worker_id}",
        {"error": message},
    )
