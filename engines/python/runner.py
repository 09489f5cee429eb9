"""Sandbox side: set the sandbox up, load the worker code, then serve events (and health
probes) until EOF.

Set-up order matters: resource limits, the DevKit runtime and every module the runner needs
later are in place before the audit hook is installed (the seal); worker code — including its
module body — runs only after the seal. Frames (:mod:`engines.childproc.frames`, payloads as
:mod:`engines.python.protocol` says) go over the dedicated protocol pipes; the child's
stdout/stderr are a separate pipe the host forwards to its logger.
"""

from __future__ import annotations

import _thread
import builtins
import json
import logging
import os
import resource
import sys
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

from cloudevents.core.v1.event import CloudEvent

from engines.childproc import frames
from engines.childproc.frames import Channel
from engines.python import sandbox
from engines.python.protocol import GATEWAY_OK, event_from_json, result_body
from wm.devkit import GatewayError, Runtime, WorkerBase, install_runtime
from wm.devkit.runtime import take_done
from wm.events import parse_json

#: Name of the worker's module (``__module__`` of the classes it defines).
WORKER_MODULE = "worker"
#: Key of the ``init`` frame that leaves out the import guard, restricted builtins and audit
#: hook, so tests can attack the kernel layers alone. Only tests set it: the engine never
#: does, and no setting or worker input reaches the init frame's keys.
TEST_ONLY_KERNEL_LAYERS_ALONE = "test_only_kernel_layers_alone"
#: seconds of CPU between the soft limit (SIGXCPU) and the hard limit (SIGKILL).
CPU_GRACE_S = 2

#: The DevKit's log levels as Python logging levels (what LOG frames carry).
_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

_LIMITS = {
    "as_bytes": resource.RLIMIT_AS,
    "cpu_s": resource.RLIMIT_CPU,
    "nofile": resource.RLIMIT_NOFILE,
    "fsize_bytes": resource.RLIMIT_FSIZE,
    "nproc": resource.RLIMIT_NPROC,
    "core_bytes": resource.RLIMIT_CORE,
}


class WorkerRefused(Exception):
    """Raised while loading when the code fails, or does not meet the worker contract."""


@dataclass(frozen=True)
class Entry:
    """How to call the worker: a ``process`` function or a WorkerBase instance's method, and
    its health probe if it has one (a ``probe()`` function or the subclass's method)."""

    name: str
    call: Callable[[CloudEvent], Any]
    probe: Callable[[], Any] | None = None


def apply_limits(limits: dict[str, int]) -> None:
    """Lower the rlimits (never above an existing hard limit)."""
    for key, value in limits.items():
        which = _LIMITS[key]
        _, current_hard = resource.getrlimit(which)
        hard = value + CPU_GRACE_S if key == "cpu_s" else value
        if current_hard != resource.RLIM_INFINITY:
            hard = min(hard, current_hard)
        resource.setrlimit(which, (min(value, hard), hard))


class FrameTransport:
    """Gateway calls as frames to the host, which performs them (the sandbox has no network)."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    def call(self, host: str, port: int, service: str, method: str, data: Any) -> Any:
        header = {"host": host, "port": port, "service": service, "method": method}
        try:
            request = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
            code, answer = self._channel.call_gateway(header, request)
        except TypeError as exc:
            raise GatewayError(f"gateway request data is not JSON-serialisable: {exc}") from exc
        except frames.FrameError as exc:
            raise SystemExit(f"protocol violation during a gateway call: {exc}") from exc
        if code != GATEWAY_OK:
            raise GatewayError(str(json.loads(answer).get("error")))
        return json.loads(answer)


def install_frame_runtime(channel: Channel) -> None:
    def log(level: str, message: str) -> None:
        channel.log(_LOG_LEVELS.get(level, logging.INFO), message)

    install_runtime(Runtime(log=log, transport=FrameTransport(channel)))


def compile_worker(config: dict[str, Any]) -> Any:
    try:
        return compile(config["code"], config["filename"], "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise WorkerRefused(f"SyntaxError: {exc.msg} (line {exc.lineno})") from exc
    except (ValueError, RecursionError, MemoryError) as exc:
        raise WorkerRefused(f"{type(exc).__name__}: {exc}") from exc


def _seal(config: dict[str, Any]) -> None:
    denied = () if config["allow_ctypes"] else ("_ctypes",)
    sandbox.strip_interpreter()
    sandbox.seal(
        read_roots=config["read_roots"],
        list_roots=config["list_roots"],
        native_roots=config["native_roots"],
        write_root=config["write_root"],
        worker_file=config["filename"],
        extra_denied_extensions=denied,
    )


def _worker_line(exc: BaseException, filename: str) -> str:
    """`` (line N)``: the last line of the worker's code in the traceback, if any."""
    try:
        summary = traceback.extract_tb(exc.__traceback__)
    except Exception:
        return ""
    lines = [frame.lineno for frame in summary if frame.filename == filename]
    return f" (line {lines[-1]})" if lines else ""


def load_worker(config: dict[str, Any], channel: Channel) -> Entry:
    """Run the worker module after the seal and find its entry point."""
    apply_limits(config["limits"])
    install_frame_runtime(channel)
    code = compile_worker(config)
    if config.get(TEST_ONLY_KERNEL_LAYERS_ALONE) is True:
        namespace: dict[str, Any] = {"__name__": WORKER_MODULE, "__builtins__": builtins}
    else:
        guard = sandbox.make_import_guard(config["allowed"], builtins.__import__)
        namespace = {"__name__": WORKER_MODULE, "__builtins__": sandbox.restricted_builtins(guard)}
        _seal(config)
    try:
        exec(code, namespace)
    except BaseException as exc:  # SystemExit or tampering in the module body: refuse the code
        line = _worker_line(exc, config["filename"])
        raise WorkerRefused(f"{describe(exc)}{line}") from exc
    return find_entry(namespace)


def find_entry(namespace: dict[str, Any]) -> Entry:
    """``process(event)`` if defined, else the one WorkerBase subclass the module defines."""
    function = namespace.get("process")
    if callable(function):
        probe = namespace.get("probe")
        return Entry("process", function, probe if callable(probe) else None)
    classes = [
        value
        for value in namespace.values()
        if isinstance(value, type)
        and issubclass(value, WorkerBase)
        and value.__module__ == WORKER_MODULE
    ]
    leaves = [c for c in classes if not any(o is not c and issubclass(o, c) for o in classes)]
    if not leaves:
        raise WorkerRefused(
            "the code defines neither a top-level process(event) function "
            "nor a subclass of wm.devkit.WorkerBase"
        )
    if len(leaves) > 1:
        names = ", ".join(sorted(c.__name__ for c in leaves))
        raise WorkerRefused(f"the code defines several WorkerBase subclasses ({names}); keep one")
    try:
        instance = cast(Any, leaves[0])()
    except Exception as exc:
        raise WorkerRefused(
            f"{leaves[0].__name__}() failed: {describe(exc)}; its __init__ must take no "
            "arguments and pass response_type and source to super().__init__"
        ) from exc
    probe = instance.probe if leaves[0].probe is not WorkerBase.probe else None
    return Entry(leaves[0].__name__, instance.process, probe)


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception raised by worker code."""
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ != "builtins":
        name = f"{kind.__module__}.{name}"
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable>"
    return f"{name}: {message}" if message else name


def _drive(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run an ``async def process`` that awaits nothing but other coroutines."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError("awaiting asyncio futures is not supported in a WorkManager Python worker")


def normalize(result: Any) -> list[CloudEvent]:
    """The events of a ``process`` return value: an event, a list/tuple of events, or None."""
    if isinstance(result, Coroutine):
        result = _drive(result)
    if result is None:
        return []
    if isinstance(result, CloudEvent):
        return [result]
    if isinstance(result, list | tuple) and all(isinstance(e, CloudEvent) for e in result):
        return list(result)
    raise TypeError(
        "process() must return a CloudEvent, a list of CloudEvents or None, "
        f"not {type(result).__name__}"
    )


def error_body(exc: BaseException, worker_file: str, *, fatal: bool = False) -> bytes:
    """A FAILED payload for a call or a probe; the traceback starts at the worker's code."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # the runner's own frames
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except Exception:
        text = ""
    message = describe(exc) + _worker_line(exc, worker_file)
    return frames.failure(type(exc).__qualname__, message, traceback=text, fatal=fatal)


#: A reply: its kind (ANSWER or FAILED), its payload, whether the child must exit after it.
Reply = tuple[bytes, bytes, bool]


def handle(entry: Entry, event: bytes | Any, worker_file: str) -> Reply:
    """Run the worker on one event: a CALL's payload, or one JSON object of a BATCH's."""

    def call() -> bytes:
        request = parse_json(event) if isinstance(event, bytes) else event
        events = normalize(entry.call(event_from_json(request)))
        times = os.times()
        return result_body(events, times.user + times.system, take_done())

    return _guarded(call, worker_file)


def handle_probe(entry: Entry, worker_file: str) -> Reply:
    """Run the worker's health probe. The reply is an ANSWER (``ok`` null when the code has
    no probe, false for a falsy answer) or, when the probe raised, FAILED: a failed probe
    either way."""
    probe = entry.probe
    if probe is None:
        return frames.ANSWER, b'{"ok":null}', False

    def call() -> bytes:
        answer = probe()
        if isinstance(answer, Coroutine):
            answer = _drive(answer)
        times = os.times()
        reply: dict[str, Any] = {
            "ok": bool(answer),
            "cpu_s": times.user + times.system,
        }
        if not answer:
            reply["message"] = f"probe() returned {_falsy(answer)}, not a true value"
        return json.dumps(reply).encode("utf-8")

    return _guarded(call, worker_file)


def _guarded(call: Callable[[], bytes], worker_file: str) -> Reply:
    """Run worker code through ``call``, which builds the ANSWER's payload. An exception is
    a FAILED reply; SystemExit, tampering or threads left running end the child."""
    try:
        body = call()
    except Exception as exc:
        return frames.FAILED, error_body(exc, worker_file), False
    except BaseException as exc:  # SystemExit, tampering: the worker ends the child
        return frames.FAILED, error_body(exc, worker_file, fatal=True), True
    finally:
        take_done()  # a call that failed after done() did not finish the worker
        _flush_stdio()
    threads = _thread._count()
    if threads:
        leftover = RuntimeError(
            f"worker code left {threads} thread(s) running; threads are not supported"
        )
        return frames.FAILED, error_body(leftover, worker_file, fatal=True), True
    return frames.ANSWER, body, False


def _falsy(answer: Any) -> str:
    """A falsy probe answer as the reason shows it (no worker-defined ``__repr__`` runs)."""
    if type(answer) in (type(None), bool, int, float, str, bytes):
        return repr(answer)
    return f"a falsy {type(answer).__name__}"


def _flush_stdio() -> None:
    """Flush the worker's prints (a plain ``try``, not ``contextlib.suppress``: this runs
    after every call)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            continue


def serve(channel: Channel, entry: Entry, worker_file: str) -> None:
    """Answer CALL, BATCH and PROBE frames until the host closes the pipe (or a fatal error)."""
    while True:
        frame = channel.receive()
        if frame is None:
            return
        kind, payload = frame
        if kind == frames.CALL:
            reply, body, fatal = handle(entry, payload, worker_file)
        elif kind == frames.PROBE:
            reply, body, fatal = handle_probe(entry, worker_file)
        elif kind == frames.BATCH:
            if serve_batch(channel, entry, payload, worker_file):
                continue
            return
        else:
            return
        channel.send(reply, body)
        if fatal:
            return


def serve_batch(channel: Channel, entry: Entry, payload: bytes, worker_file: str) -> bool:
    """Answer each event of a BATCH as it is done (the host times each); False when the
    child must end (a fatal reply, or a payload that is not a JSON array)."""
    try:
        requests = json.loads(payload)
    except ValueError:
        return False
    if not isinstance(requests, list):
        return False
    for request in requests:
        reply, body, fatal = handle(entry, request, worker_file)
        channel.send(reply, body)
        if fatal:
            return False
    return True


def run(config: dict[str, Any], read_fd: int, write_fd: int) -> None:
    """The child's main: load, report ready (or why not), serve."""
    channel = Channel(read_fd, write_fd)
    channel.spin(config.get("spin_s", 0.0))
    try:
        entry = load_worker(config, channel)
    except WorkerRefused as exc:
        _flush_stdio()
        channel.failed(type(exc).__name__, str(exc))
        return
    _flush_stdio()
    ready = {"pid": os.getpid(), "entry": entry.name, "probe": entry.probe is not None}
    channel.send(frames.READY, json.dumps(ready).encode("utf-8"))
    serve(channel, entry, config["filename"])
