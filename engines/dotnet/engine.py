"""The .NET engines: ``application/x-dotnet-dll`` (a compiled worker, bare or in a nupkg) and
``text/x-csharp`` (source compiled in-process). One collectible AssemblyLoadContext per
loaded worker, driven through the host helper; in a helper process with ``isolation:
subprocess``. A worker's health probe is its public ``Task<bool> ProbeAsync()``, run as a
message is.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from engines.childproc.limits import Limits
from engines.dotnet import runtime as dotnet
from engines.dotnet.package import Package, read_package
from engines.dotnet.wire import (
    EVENT,
    PROBE,
    SEP,
    Request,
    WorkerFailed,
    decode_answer,
    decode_probe,
    encode_event,
)
from engines.isolation.host import Callbacks, HelperProcess
from wm.config import Settings
from wm.devkit.gateway import GatewayCaller
from wm.engine import WORKER_ANSWER, Engine, Outputs, WorkerSpec
from wm.errors import (
    EngineUnavailable,
    GatewayError,
    InvalidCode,
    WorkerExecutionError,
    WorkerTimeout,
)
from wm.events import CloudEvent
from wm.workersettings import SettingRule

logger = logging.getLogger(__name__)

ISOLATION = "isolation"
ISOLATION_MODES = ("in-process", "subprocess")
#: Seconds an isolated worker's helper waits past a call's limit before it gives up on the
#: call itself (by then the host has killed it).
HELPER_LIMIT_MARGIN_S = 2.0
#: The host's answer for an unfinished task, and for a handle that was unloaded meanwhile.
PENDING, NO_WORKER = "pending" + SEP, "error" + SEP + "WorkManager.DotNet.NoWorker"


class Image:
    """What a context is loaded from: compiled DLLs, or C# source compiled where it loads
    (in this process, or in the isolation helper)."""

    def __init__(self, package: Package | None = None, source: str | None = None) -> None:
        self.package, self.source = package, source

    def materialize(self, rt: dotnet.Runtime, folder: Path) -> str:
        """Write the DLLs into ``folder`` (compiling the source first); the main file's name."""
        if self.package is not None:
            for name, content in self.package.files.items():
                (folder / name).write_bytes(content)
            return self.package.main
        assert self.source is not None
        compile_source(rt, self.source, folder / "Worker.dll")
        return "Worker.dll"

    def to_blob(self) -> tuple[dict[str, Any], bytes]:
        if self.package is None:
            assert self.source is not None
            return {"source": True}, self.source.encode("utf-8")
        names = list(self.package.files)
        sizes = [len(self.package.files[name]) for name in names]
        header = {"main": self.package.main, "names": names, "sizes": sizes}
        return header, b"".join(self.package.files[name] for name in names)

    @classmethod
    def from_blob(cls, header: Mapping[str, Any], blob: bytes) -> Image:
        if header.get("source"):
            return cls(source=blob.decode("utf-8"))
        files, offset = {}, 0
        for name, size in zip(header["names"], header["sizes"], strict=True):
            files[name] = blob[offset : offset + size]
            offset += size
        return cls(Package(header["main"], files, ""))


def compile_source(rt: dotnet.Runtime, source: str, output: Path) -> None:
    """Compile a worker's C# source; :class:`InvalidCode` with each error's line, column,
    code and message."""
    folder = output.parent
    path = folder / "worker.cs"
    path.write_text(source, encoding="utf-8")
    try:
        diagnostics = rt.compile([path], output, [])
    except InvalidCode as exc:
        text = str(exc).replace(str(path), "worker.cs")
        errors = [
            line for line in text.splitlines() if ": error " in line or "error CS" in line
        ] or [text]
        listed = "\n".join(errors)
        raise InvalidCode(
            f"the C# worker does not compile:\n{listed}\n(compiler: {rt.compiler.name})"
        ) from None
    finally:
        path.unlink(missing_ok=True)
    warnings = diagnostics.replace(str(path), "worker.cs").strip()
    if warnings:
        logger.info("C# worker compiled with warnings:\n%s", warnings)


class Sinks:
    """The host side of one loaded worker: its log and its gateway calls. A gateway request
    is JSON ``{"host", "port", "data", "remaining_ms"}``: the DevKit's ApiClient names the
    backend, the host checks it against WM_GATEWAY_ALLOWED_HOSTS and performs the call."""

    def __init__(self, settings: Settings, worker: WorkerSpec) -> None:
        self.worker = worker
        self.gateway_caller = GatewayCaller(settings)
        self.deadline = threading.local()

    def log(self, level: int, message: str) -> None:
        dotnet.worker_logger.log(level, ".NET worker %s: %s", self.worker.worker_id, message)

    def gateway(self, service: str, method: str, request: bytes) -> tuple[int, bytes]:
        try:
            body = json.loads(request)
            remaining_s = min(
                float(body.get("remaining_ms", float("inf"))) / 1000,
                getattr(self.deadline, "value", float("inf")) - time.monotonic(),
            )
            call = {
                "host": body.get("host"),
                "port": body.get("port"),
                "service": service,
                "method": method,
                "data": json.loads(body.get("data", "null")),
            }
            answer = self.gateway_caller.call(call, remaining_s)
        except (GatewayError, ValueError, TypeError, AttributeError) as exc:
            logger.info(".NET worker %s: gateway call failed: %s", self.worker.worker_id, exc)
            return dotnet.GATEWAY_FAILED, str(exc).encode()
        return dotnet.GATEWAY_OK, json.dumps(answer).encode()


class Runner(Protocol):
    def process(self, header: bytes, data: bytes, timeout_s: float) -> str: ...

    def probe(self, timeout_s: float) -> str: ...

    def close(self) -> None: ...


class Context:
    """A worker loaded into a collectible context of this process's runtime. A call past
    its time limit cannot be stopped (CoreCLR cannot abort a thread): the context is marked
    poisoned, unloaded once that call returns, and a fresh one takes the next message; the
    timeout says the call still runs (``stray``), so the data plane replaces a pool process
    once its delivery is settled. A call that never returns its task (a synchronous loop) is
    taken over by the data plane's watchdog, which ends the process."""

    def __init__(
        self, settings: Settings, worker: WorkerSpec, image: Image, sinks: Callbacks
    ) -> None:
        self.worker, self.image, self.sinks = worker, image, sinks
        self.rt = dotnet.runtime(settings)
        self._lock = threading.Lock()
        self._closed = False
        self.rt.register(worker.worker_id, sinks)
        try:
            self.handle = self._load()
        except BaseException:
            self.rt.unregister(worker.worker_id, sinks)
            raise

    def _load(self) -> int:
        folder = Path(tempfile.mkdtemp(prefix="wm-dotnet-worker-"))
        try:
            main = self.image.materialize(self.rt, folder)
            status, _, rest = str(
                self.rt.host.Load(self.worker.worker_id, str(folder), main)
            ).partition(SEP)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if status != "ok":
            raise InvalidCode(f"the .NET worker cannot be loaded: {rest}")
        handle, _, type_name = rest.partition(SEP)
        logger.info(".NET worker %s: %s loaded", self.worker.worker_id, type_name)
        return int(handle)

    def process(self, header: bytes, data: bytes, timeout_s: float) -> str:
        handle = self.handle
        if handle < 0:
            handle = self._reload()
        started = time.monotonic()
        answer = self.rt.process(handle, header, data, int(timeout_s * 1000))
        return self._settle(answer, handle, started, timeout_s, "ProcessAsync")

    def probe(self, timeout_s: float) -> str:
        handle = self._handle()
        started = time.monotonic()
        answer = str(self.rt.host.Probe(handle, int(timeout_s * 1000)))
        return self._settle(answer, handle, started, timeout_s, "ProbeAsync")

    def _handle(self) -> int:
        handle = self.handle
        return handle if handle >= 0 else self._reload()

    def _settle(
        self, answer: str, handle: int, started: float, timeout_s: float, method: str
    ) -> str:
        """The answer of a call of ``method`` started at ``started``: waited for until the
        limit when it is pending."""
        if answer.startswith(PENDING):
            call = int(answer[len(PENDING) :])
            remaining_ms = max(0, int((started + timeout_s - time.monotonic()) * 1000))
            host = self.rt.host
            answer = str(host.Wait(call, remaining_ms))
            if answer == "timeout":
                host.Abandon(call)
                self._poison(handle)
                raise WorkerTimeout(
                    f"{self._what(method)} did not finish within {timeout_s:g} s; its task "
                    "cannot be stopped, so its context is replaced and the process running it "
                    "too (use isolation 'subprocess' to kill such a call instead)",
                    stray=True,
                )
        elapsed_s = time.monotonic() - started
        if elapsed_s > timeout_s:  # the method blocked before returning its task
            self._poison(handle)
            raise WorkerTimeout(
                f"{self._what(method)} blocked for {elapsed_s:.3g} s in {method}, over its "
                f"{timeout_s:g} s limit; its answer is dropped and its context replaced"
            )
        if answer.startswith(NO_WORKER):
            raise Stale()
        return answer

    def _what(self, method: str) -> str:
        """What a timeout's message calls the call of ``method``."""
        worker = f".NET worker {self.worker.worker_id}"
        return worker if method == "ProcessAsync" else f"the probe of {worker}"

    def _reload(self) -> int:
        """A fresh context after a timeout poisoned the last one; Stale once closed."""
        with self._lock:
            if self._closed:
                raise Stale()
            if self.handle < 0:
                self.handle = self._load()
            return self.handle

    def _poison(self, handle: int) -> None:
        with self._lock:
            if self.handle == handle:
                self.handle = -1
        self.rt.host.Unload(handle)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handle, self.handle = self.handle, -1
        if handle >= 0:
            self.rt.host.Unload(handle)
        self.rt.unregister(self.worker.worker_id, self.sinks)


class Stale(Exception):
    """The runner was replaced (reloaded or closed) between being picked and being called."""


class Isolated:
    """A worker hosted by a helper process with a runtime of its own."""

    def __init__(self, settings: Settings, worker: WorkerSpec, image: Image, sinks: Sinks) -> None:
        header, blob = image.to_blob()
        header = {**header, "worker_id": worker.worker_id}
        self._lock = threading.Lock()  # a closed helper is never started again by a call
        self._closed = False
        self.helper = HelperProcess(
            "engines.dotnet.helper",
            header,
            blob,
            {},
            sinks,
            description=".NET",
            refusals={"InvalidCode": InvalidCode, "WorkerTimeout": WorkerTimeout},
            loads=f"worker {worker.worker_id}",
            limits=Limits.from_settings(settings),
            spin_s=settings.engine_spin_s,
        )

    def process(self, header: bytes, data: bytes, timeout_s: float) -> str:
        return self._ask(Request(EVENT, _helper_ms(timeout_s), header, data), timeout_s)

    def probe(self, timeout_s: float) -> str:
        try:
            return self._ask(Request(PROBE, _helper_ms(timeout_s)), timeout_s)
        except WorkerTimeout as exc:
            raise WorkerTimeout(f"the probe timed out: {exc}") from None

    def _ask(self, request: Request, timeout_s: float) -> str:
        with self._lock:  # the helper answers one call at a time anyway
            if self._closed:
                raise Stale()
            return self.helper.call(request.encode(), timeout_s).decode()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.helper.close()


class DotNetEngine(Engine):
    """Shared by both MIME types: they differ in how code becomes an :class:`Image`."""

    worker_settings = {ISOLATION: SettingRule(text=True, choices=ISOLATION_MODES)}

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._runner: Runner | None = None
        self._worker: WorkerSpec | None = None

    @classmethod
    def check_host(cls, settings: Settings) -> None:
        """Say which runtime this node's processes will start (without starting it: the
        node's main process forks its pool after this)."""
        try:
            root = dotnet.discover()
        except EngineUnavailable as exc:
            logger.warning("%s workers cannot run on this node: %s", cls.mime_type, exc)
            return
        logger.info("%s workers will run on %s", cls.mime_type, root.label)
        if warning := root.support_warning():
            logger.warning("%s workers: %s", cls.mime_type, warning)

    @classmethod
    def host_facts(cls, settings: Settings) -> dict[str, Any]:
        """The runtime this node's processes will start, and whether Microsoft supports it."""
        try:
            root = dotnet.discover()
        except EngineUnavailable as exc:
            return {"runtime": None, "error": str(exc)}
        ends = root.support_ends
        return {
            "runtime": root.label,
            "support_ends": None if ends is None else ends.isoformat(),
            "supported": root.supported(),
        }

    def image(self, code: bytes) -> Image:
        raise NotImplementedError

    def validate(self, code: bytes, worker: WorkerSpec) -> None:
        """Compile or unpack, then load into a throwaway context (in a throwaway helper for
        an isolated worker): a missing or ambiguous IWorker, a constructor that throws or a
        compile error is refused here, before anything is stored."""
        self._runner_for(code, worker).close()

    def _runner_for(self, code: bytes, worker: WorkerSpec) -> Runner:
        mode = _mode(worker)
        image = self.image(code)
        sinks = Sinks(self.settings, worker)
        if mode == "subprocess":
            return Isolated(self.settings, worker, image, sinks)
        return Context(self.settings, worker, image, sinks)

    def load(self, code: bytes, worker: WorkerSpec) -> None:
        runner = self._runner_for(code, worker)
        previous, self._runner, self._worker = self._runner, runner, worker
        if previous is not None:  # calls in flight finish on the old context first
            previous.close()
        logger.info(
            ".NET worker %s v%s loaded (%s)", worker.worker_id, worker.version, _mode(worker)
        )

    def _ask(self, method: str, *args: Any) -> tuple[str, WorkerSpec]:
        """The current runner's answer to ``method`` (``process`` or ``probe``) with
        ``args`` (the next runner's if it was replaced meanwhile), and the worker it runs."""
        while True:
            runner, worker = self._runner, self._worker
            if runner is None or worker is None:
                raise WorkerExecutionError(f"{type(self).__name__}.{method}() called before load()")
            try:
                return getattr(runner, method)(*args), worker
            except Stale:
                if self._runner is runner:  # closed, not replaced
                    raise WorkerExecutionError("the .NET worker was closed") from None

    def process(self, event: CloudEvent, timeout_s: float) -> list[CloudEvent]:
        header, data = encode_event(event)
        answer, worker = self._ask("process", header, data, timeout_s)
        try:
            decoded = decode_answer(answer)
        except WorkerFailed as exc:
            raise WorkerExecutionError(
                f".NET worker {worker.worker_id} threw {exc.error_type}: {exc}",
                error_type=exc.error_type,
            ) from None
        except (ValueError, KeyError) as exc:
            raise WorkerExecutionError(
                f".NET worker {worker.worker_id}: unreadable answer from its host: {exc}"
            ) from exc
        if decoded.event is None:
            return []
        if decoded.answered_error is not None:
            error_type = decoded.answered_error_type or WORKER_ANSWER
            return Outputs([decoded.event], decoded.answered_error, error_type=error_type)
        return [decoded.event]

    def probe(self, timeout_s: float) -> bool | None:
        """The worker's ``ProbeAsync()``, run as a message is (killed with its helper past
        ``timeout_s`` in isolation, its context replaced in-process): True when it answered
        true, None without a probe. Never False: false, like an exception, is raised as a
        :class:`WorkerExecutionError` saying so."""
        answer, worker = self._ask("probe", timeout_s)
        try:
            healthy = decode_probe(answer)
        except WorkerFailed as exc:
            raise WorkerExecutionError(
                f"the probe of .NET worker {worker.worker_id} threw {exc.error_type}: {exc}",
                error_type=exc.error_type,
            ) from None
        except ValueError as exc:
            raise WorkerExecutionError(f".NET worker {worker.worker_id}: {exc}") from exc
        if healthy is False:
            raise WorkerExecutionError(
                f"the probe of .NET worker {worker.worker_id} answered false (ProbeAsync)"
            )
        return healthy

    def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()

    def stops_calls(self) -> bool:
        return isinstance(self._runner, Isolated)

    def processes(self) -> list[int]:
        runner = self._runner
        pid = runner.helper.pid if isinstance(runner, Isolated) else None
        return [pid] if pid is not None else []


class DotNetDllEngine(DotNetEngine):
    """``application/x-dotnet-dll``: a compiled worker (see :mod:`engines.dotnet.package`)."""

    mime_type = "application/x-dotnet-dll"

    def image(self, code: bytes) -> Image:
        return Image(package=read_package(code, dotnet.discover().version[0]))


class CSharpEngine(DotNetEngine):
    """``text/x-csharp``: C# source, UTF-8."""

    mime_type = "text/x-csharp"

    def image(self, code: bytes) -> Image:
        try:
            source = code.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidCode(f"C# source must be UTF-8 text: {exc}") from exc
        if not source.strip():
            raise InvalidCode("the C# source is empty")
        return Image(source=source)


def _helper_ms(timeout_s: float) -> int:
    """An isolated call's limit in its helper: the host kills the helper at ``timeout_s``;
    the helper's own limit comes later, so a loaded machine never lets it answer "timed out"
    first and keep a hung call alive."""
    return int((timeout_s + HELPER_LIMIT_MARGIN_S) * 1000)


def _mode(worker: WorkerSpec) -> str:
    mode: Any = worker.settings.get(ISOLATION) or "in-process"
    if mode not in ISOLATION_MODES:
        raise InvalidCode(
            f"worker setting {ISOLATION!r} is {mode!r}; use one of {', '.join(ISOLATION_MODES)}"
        )
    return str(mode)
