"""The Python engine end to end: real sandboxed subprocesses, real pipes, real HTTP."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import wm  # noqa: F401 - import the platform before engines (engines.base needs wm first)
from engines.python import PythonEngine
from engines.python.engine import PythonWorkerError
from tests.helpers import Loopback, eventually, http_server, idle_cpu_s, running
from tests.workers import child_pids, code
from wm.config import Settings
from wm.engine import WorkerSpec
from wm.errors import InvalidCode, WorkerExecutionError, WorkerTimeout
from wm.events import CloudEvent, make_event

SETTINGS = Settings()


def spec(**overrides: Any) -> WorkerSpec:
    values: dict[str, Any] = {"worker_id": "w-test", "topic": "orders", **overrides}
    return WorkerSpec(**values)


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


@pytest.fixture
def engine() -> Iterator[PythonEngine]:
    before = child_pids()
    instance = PythonEngine(SETTINGS)
    yield instance
    instance.close()
    assert child_pids() <= before, "the engine left a child process behind"


def event(data: Any = None, **extensions: Any) -> CloudEvent:
    return make_event("orders.placed", "/tests", data, extensions=extensions or None)


# --- round trips -----------------------------------------------------------------------------


def test_echo_round_trip(engine: PythonEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engines.python")
    engine.load(code("echo"), spec())
    incoming = event({"n": 1, "text": "héllo"})

    [output] = engine.process(incoming, timeout_s=5)

    assert output.get_type() == "echo.out"
    assert output.get_source() == "/workers/echo"
    assert output.get_data() == {"input": {"n": 1, "text": "héllo"}}
    assert f"echo worker saw {incoming.get_id()}" in caplog.text
    assert "w-test" in caplog.text


def test_a_host_without_bubblewrap_runs_workers_under_the_kernel_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without bwrap the child runs under the fixed prefix (unshare, setpriv) once; it once
    got it twice, and the inner unshare failed with 'Operation not permitted'."""
    from engines.python import isolation

    real_which = isolation.shutil.which
    monkeypatch.setattr(
        isolation.shutil, "which", lambda name: None if name == "bwrap" else real_which(name)
    )
    isolation.kernel_isolation.cache_clear()
    try:
        layers = isolation.kernel_isolation()
        assert "mount namespace" not in layers.layers and layers.bwrap is None
        instance = PythonEngine(SETTINGS)
        try:
            instance.load(code("echo"), spec())
            [output] = instance.process(event({"n": 2}), timeout_s=5)
        finally:
            instance.close()
        assert output.get_data() == {"input": {"n": 2}}
    finally:
        isolation.kernel_isolation.cache_clear()


def test_the_sandbox_binds_the_libraries_ldd_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """The libraries the sandbox binds are listed by the interpreter's own loader, file by
    file (ldd, a shell script, took up to 1.6 s of a node's start): the same set ``ldd``
    lists, for the interpreter, the standard library's extensions and a package whose
    extensions load libraries bundled beside them (psycopg's binary build)."""
    import psycopg  # noqa: F401 - psycopg_binary needs it first
    import psycopg_binary

    from engines.python import bwrap, isolation

    interpreter = bwrap.interpreter()
    loader = bwrap._loader(interpreter)
    assert loader is not None and os.path.basename(loader).startswith("ld-")
    roots = (*isolation.sandbox_paths(()).native_roots, os.path.dirname(psycopg_binary.__file__))
    bwrap.libraries.cache_clear()
    try:
        listed = bwrap.libraries(interpreter, roots)
        bwrap.libraries.cache_clear()
        monkeypatch.setattr(bwrap, "_loader", lambda executable: None)  # ldd instead
        assert listed == bwrap.libraries(interpreter, roots)
    finally:
        bwrap.libraries.cache_clear()
    assert loader in listed and any("/libc." in path for path in listed)
    assert any("/libffi." in path for path in listed)  # the standard library's _ctypes
    assert any("psycopg_binary.libs/libpq-" in path for path in listed)


def test_a_malformed_or_foreign_interpreter_file_names_no_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader is read off the interpreter's ELF header only where it is well formed: any
    other file gives None (``ldd`` then lists the libraries), never an error, and never a
    relative path (which would be run from the working directory)."""
    from engines.python import bwrap

    real = Path(bwrap.interpreter()).read_bytes()
    header = 64 + 56 * int.from_bytes(real[56:58], "little")
    loader = bwrap._loader(bwrap.interpreter())
    assert loader is not None and os.path.isabs(loader)

    def loader_of(data: bytes) -> str | None:
        path = tmp_path / "python"
        path.write_bytes(data)
        return bwrap._loader(str(path))

    assert loader_of(real) == loader  # the copy reads as the file
    interp = next(  # the PT_INTERP entry: (type, flags, offset, vaddr, paddr, filesz, …)
        at for at in range(64, header, 56) if int.from_bytes(real[at : at + 4], "little") == 3
    )

    def with_field(at: int, value: bytes) -> bytes:
        return real[:at] + value + real[at + len(value) :]

    offset = int.from_bytes(real[interp + 8 : interp + 16], "little")
    assert loader_of(b"") is None and loader_of(b"#!/bin/sh\n" * 20) is None
    assert loader_of(real[:4] + b"\x01" + real[5:]) is None  # a 32-bit ELF
    assert loader_of(real[:5] + b"\x02" + real[6:]) is None  # big-endian
    assert loader_of(real[:40]) is None  # truncated header
    assert loader_of(with_field(54, b"\x00\x00")) is None  # program headers of size 0
    assert loader_of(with_field(interp + 32, (1 << 40).to_bytes(8, "little"))) is None
    assert loader_of(with_field(interp + 8, (1 << 62).to_bytes(8, "little"))) is None
    (tmp_path / "ld-relative").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert loader_of(with_field(offset, b"ld-relative\0")) is None  # no relative path


def test_the_event_reads_its_attributes_by_name_too(engine: PythonEngine) -> None:
    """A newcomer's ``event["type"]`` works, as with the CloudEvents SDK's HTTP events."""
    source = b"""
from wm.devkit import make_event

def process(event):
    try:
        event["colour"]
    except KeyError as exc:
        missing = str(exc)
    seen = {
        "type": event["type"], "id": event["id"], "data": event["data"], "also": event.data,
        "subject": event.get("subject", "none"), "ext": event.get("region"),
        "has_type": "type" in event, "has_nope": "nope" in event, "missing": missing,
    }
    return make_event("seen", "/tests", seen)
"""
    engine.load(source, spec())
    incoming = event({"n": 1}, region="eu")
    [output] = engine.process(incoming, timeout_s=5)
    seen = output.get_data()
    assert seen.pop("missing").startswith("\"the event has no attribute 'colour'; it has ")
    assert seen == {
        "type": "orders.placed",
        "id": incoming.get_id(),
        "data": {"n": 1},
        "also": {"n": 1},
        "subject": "none",
        "ext": "eu",
        "has_type": True,
        "has_nope": False,
    }


def test_child_is_reused_across_messages(engine: PythonEngine) -> None:
    engine.load(code("echo"), spec())
    pid = engine.pid
    for n in range(20):
        [output] = engine.process(event({"n": n}), timeout_s=5)
        assert output.get_data() == {"input": {"n": n}}
    assert engine.pid == pid


def test_a_sandbox_polls_for_its_next_call_briefly_then_sleeps(engine: PythonEngine) -> None:
    """By default the host and the sandbox poll for each other's frames before they sleep
    (WM_ENGINE_SPIN_US): for at most that long, so an idle sandbox uses no CPU."""
    assert SETTINGS.engine_spin_us > 0
    engine.load(code("echo"), spec())
    for n in range(50):
        engine.process(event({"n": n}), timeout_s=5)
    [pid] = engine.processes()
    assert idle_cpu_s(pid) < 0.05


def test_binary_and_large_payloads_round_trip(engine: PythonEngine) -> None:
    engine.load(
        b"from wm.devkit import make_event\n"
        b"def process(event):\n    return make_event('copy', '/w', event.get_data())\n",
        spec(),
    )
    blob = bytes(range(256)) * 4
    big = {"items": ["x" * 1000] * 5000}  # ~5 MB: larger than a pipe buffer both ways

    [binary] = engine.process(make_event("raw", "/tests", blob), timeout_s=5)
    [large] = engine.process(event(big), timeout_s=10)

    assert binary.get_data() == blob
    assert large.get_data() == big


def test_worker_base_worker(engine: PythonEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engines.python")
    engine.load(code("greeter"), spec())

    [output] = engine.process(event({"name": "Ada"}), timeout_s=5)
    [error] = engine.process(event({}), timeout_s=5)

    assert (output.get_type(), output.get_source()) == ("greetings.sent", "/workers/greeter")
    assert output.get_data() == {"greeting": "Hello, Ada!"}
    assert error.get_type() == "greetings.sent.error"
    assert error.get_data() == {"error": "name is required"}
    assert "greeting Ada" in caplog.text


def test_correlation_id_is_propagated(engine: PythonEngine) -> None:
    engine.load(code("greeter"), spec())

    [output] = engine.process(event({"name": "Ada"}, correlationid="corr-42"), timeout_s=5)
    [error] = engine.process(event({}, correlationid="corr-43"), timeout_s=5)

    assert output.get_extension("correlationid") == "corr-42"
    assert error.get_extension("correlationid") == "corr-43"


def test_absent_correlation_id_stays_absent(engine: PythonEngine) -> None:
    engine.load(code("greeter"), spec())

    [output] = engine.process(event({"name": "Ada"}), timeout_s=5)

    assert output.get_extension("correlationid") is None
    assert "correlationid" not in output.get_attributes()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"command": "create", "item": "book"}, {"created": "book"}),
        ({"command": "CREATE", "item": "pen"}, {"created": "pen"}),
        ('{"command": "cancel", "id": 7}', {"cancelled": 7}),
        ({"command": "refund"}, {"error": "Unknown command: refund"}),
        ({"item": "book"}, {"error": "Missing 'command' field"}),
        ("{not json", {"error": "Failed to parse command JSON"}),
        ("null", {"error": "Failed to parse command JSON"}),
        ({"command": "explode"}, {"error": "Internal error: the order exploded"}),
    ],
)
def test_command_worker(engine: PythonEngine, data: Any, expected: dict[str, Any]) -> None:
    engine.load(code("orders"), spec())

    [output] = engine.process(event(data, correlationid="c-1"), timeout_s=5)

    assert output.get_data() == expected
    is_error = "error" in expected
    assert output.get_type() == ("orders.result.error" if is_error else "orders.result")
    assert output.get_extension("correlationid") == "c-1"


@pytest.mark.parametrize(
    ("shape", "count"), [("single", 1), ("list", 3), ("tuple", 2), ("none", 0)]
)
def test_return_shapes(engine: PythonEngine, shape: str, count: int) -> None:
    engine.load(code("shapes"), spec())

    outputs = engine.process(event({"shape": shape}), timeout_s=5)

    assert [o.get_data() for o in outputs] == [{"index": i} for i in range(count)]


def test_invalid_return_value_is_an_error(engine: PythonEngine) -> None:
    engine.load(code("shapes"), spec())

    with pytest.raises(WorkerExecutionError, match=r"must return a CloudEvent.*not int"):
        engine.process(event({"shape": "bogus"}), timeout_s=5)


def test_async_process_is_awaited(engine: PythonEngine) -> None:
    source = (
        b"from wm.devkit import make_event\n"
        b"async def double(x):\n    return 2 * x\n"
        b"async def process(event):\n"
        b"    return make_event('async.out', '/w', {'n': await double(21)})\n"
    )
    engine.load(source, spec())

    [output] = engine.process(event(), timeout_s=5)

    assert output.get_data() == {"n": 42}


# --- errors, refusals, validation -------------------------------------------------------------


def test_worker_exception_carries_type_line_and_traceback(engine: PythonEngine) -> None:
    source = (
        b"def check(data):\n    raise KeyError(data)\n\ndef process(event):\n    check('sku')\n"
    )
    engine.load(source, spec())

    with pytest.raises(PythonWorkerError) as caught:
        engine.process(event(), timeout_s=5)

    assert "KeyError: 'sku' (line 2)" in str(caught.value)
    assert caught.value.error_type == "KeyError"
    assert "line 5, in process" in caught.value.traceback
    assert "runner.py" not in caught.value.traceback


def test_child_survives_a_worker_exception(engine: PythonEngine) -> None:
    engine.load(
        b"def process(event):\n    if event.get_data():\n        raise ValueError()\n", spec()
    )
    pid = engine.pid

    with pytest.raises(PythonWorkerError, match="ValueError"):
        engine.process(event(True), timeout_s=5)

    assert engine.process(event(False), timeout_s=5) == []
    assert engine.pid == pid


def test_syntax_error_is_refused_with_its_line(engine: PythonEngine) -> None:
    with pytest.raises(InvalidCode, match=r"does not compile: .*\(line 3, column"):
        engine.load(b"def process(event):\n    return 1\nif True\n", spec())
    assert engine.pid is None


def test_module_body_error_is_refused_with_its_line(engine: PythonEngine) -> None:
    with pytest.raises(InvalidCode, match=r"ZeroDivisionError: division by zero \(line 2\)"):
        engine.load(b"x = 1\ny = x / 0\ndef process(event):\n    pass\n", spec())


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (b"def handle(event):\n    pass\n", "neither a top-level process"),
        (b"process = 42\n", "neither a top-level process"),
        (
            b"from wm.devkit import WorkerBase\nclass A(WorkerBase):\n    pass\n"
            b"class B(WorkerBase):\n    pass\n",
            "several WorkerBase subclasses",
        ),
        (
            b"from wm.devkit import WorkerBase\nclass A(WorkerBase):\n    pass\n",
            "A\\(\\) failed: TypeError",
        ),
    ],
)
def test_contract_violation_is_refused(engine: PythonEngine, source: bytes, message: str) -> None:
    with pytest.raises(InvalidCode, match=message):
        engine.load(source, spec())


def test_validate_refuses_without_side_effects(engine: PythonEngine) -> None:
    engine.load(code("echo"), spec())
    pid = engine.pid
    children = child_pids()

    with pytest.raises(InvalidCode, match="import of 'subprocess' is not allowed"):
        engine.validate(b"import subprocess\ndef process(event):\n    pass\n", spec())
    engine.validate(code("greeter"), spec())

    assert child_pids() == children
    assert engine.pid == pid
    assert engine.process(event({"a": 1}), timeout_s=5)[0].get_type() == "echo.out"


def test_failed_load_keeps_the_previous_code(engine: PythonEngine) -> None:
    engine.load(code("echo"), spec())

    with pytest.raises(InvalidCode):
        engine.load(b"import os\ndef process(event):\n    pass\n", spec(version=2))

    assert engine.process(event({"a": 1}), timeout_s=5)[0].get_type() == "echo.out"


def test_bad_worker_setting_is_refused(engine: PythonEngine) -> None:
    with pytest.raises(InvalidCode, match="memory_mb"):
        engine.load(code("echo"), spec(settings={"memory_mb": "lots"}))


def test_process_before_load_is_an_error(engine: PythonEngine) -> None:
    with pytest.raises(WorkerExecutionError, match="before load"):
        engine.process(event(), timeout_s=1)


# --- lifecycle: hot reload, timeout, crash ---------------------------------------------------

V1 = b"from wm.devkit import make_event\ndef process(event):\n    return make_event('v1', '/w')\n"
V2 = b"from wm.devkit import make_event\ndef process(event):\n    return make_event('v2', '/w')\n"
SLOW_V1 = (
    b"import time\nfrom wm.devkit import make_event\n"
    b"def process(event):\n    time.sleep(0.5)\n    return make_event('v1', '/w')\n"
)


def test_hot_reload_picks_new_code_on_next_message(engine: PythonEngine) -> None:
    engine.load(V1, spec())
    assert engine.process(event(), timeout_s=5)[0].get_type() == "v1"
    old_pid = engine.pid
    assert old_pid is not None

    engine.load(V2, spec(version=2))

    assert engine.process(event(), timeout_s=5)[0].get_type() == "v2"
    assert engine.pid != old_pid
    assert not alive(old_pid)


def test_hot_reload_lets_the_message_in_flight_finish_on_old_code(engine: PythonEngine) -> None:
    engine.load(SLOW_V1, spec())
    results: list[str] = []
    in_flight = threading.Thread(
        target=lambda: results.append(engine.process(event(), timeout_s=5)[0].get_type())
    )
    in_flight.start()
    time.sleep(0.1)

    engine.load(V2, spec(version=2))
    in_flight.join()

    assert results == ["v1"]
    assert engine.process(event(), timeout_s=5)[0].get_type() == "v2"


def test_timeout_kills_the_child_and_the_next_message_gets_a_fresh_one(
    engine: PythonEngine,
) -> None:
    source = (
        b"from wm.devkit import make_event\n"
        b"def process(event):\n"
        b"    if event.get_data() == 'spin':\n"
        b"        while True:\n            pass\n"
        b"    return make_event('ok', '/w')\n"
    )
    engine.load(source, spec())
    first_pid = engine.pid
    assert first_pid is not None
    started = time.monotonic()

    with pytest.raises(WorkerTimeout, match=r"within 0\.5 s"):
        engine.process(event("spin"), timeout_s=0.5)

    assert time.monotonic() - started < 2
    assert not alive(first_pid)
    assert engine.pid is None
    assert engine.process(event("fine"), timeout_s=5)[0].get_type() == "ok"
    assert engine.pid not in (None, first_pid)


def test_crash_is_an_error_and_the_child_respawns(engine: PythonEngine) -> None:
    source = (
        b"from wm.devkit import make_event\n"
        b"def process(event):\n"
        b"    if event.get_data() == 'exit':\n        raise SystemExit(3)\n"
        b"    return make_event('ok', '/w')\n"
    )
    engine.load(source, spec())
    first_pid = engine.pid
    assert first_pid is not None

    with pytest.raises(WorkerExecutionError, match="SystemExit: 3"):
        engine.process(event("exit"), timeout_s=5)

    assert not alive(first_pid)
    assert engine.process(event("fine"), timeout_s=5)[0].get_type() == "ok"
    assert engine.pid != first_pid


def test_cpu_limit_kill_is_reported_and_the_child_respawns(engine: PythonEngine) -> None:
    source = (
        b"from wm.devkit import make_event\n"
        b"def process(event):\n"
        b"    while event.get_data() == 'burn':\n        pass\n"
        b"    return make_event('ok', '/w')\n"
    )
    engine.load(source, spec(settings={"cpu_limit_s": 1}))

    with pytest.raises(WorkerExecutionError, match="SIGXCPU"):
        engine.process(event("burn"), timeout_s=10)

    assert engine.process(event("fine"), timeout_s=5)[0].get_type() == "ok"


def test_memory_limit_comes_from_worker_settings(engine: PythonEngine) -> None:
    source = (
        b"from wm.devkit import make_event\n"
        b"def process(event):\n"
        b"    block = bytearray(event.get_data() * 1024 * 1024)\n"
        b"    return make_event('ok', '/w', {'mb': len(block) // 1024 // 1024})\n"
    )
    engine.load(source, spec(settings={"memory_mb": 128}))
    with pytest.raises(WorkerExecutionError, match="MemoryError"):
        engine.process(event(200), timeout_s=5)

    engine.load(source, spec(version=2))  # default 512 MiB
    assert engine.process(event(200), timeout_s=5)[0].get_data() == {"mb": 200}


def test_leftover_thread_ends_the_child(engine: PythonEngine) -> None:
    source = (
        b"import time\n"
        b"def find(name):\n"
        b"    return [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == name][0]\n"
        b"def process(event):\n"
        b"    thread = find('_wrap_close').__init__.__globals__['sys'].modules['_thread']\n"
        b"    thread.start_new_thread(time.sleep, (30,))\n"
        b"    time.sleep(0.2)\n"
    )
    engine.load(source, spec())
    pid = engine.pid
    assert pid is not None

    with pytest.raises(WorkerExecutionError, match="left 1 thread"):
        engine.process(event(), timeout_s=5)

    assert not alive(pid)


def test_concurrent_callers_are_serialized(engine: PythonEngine) -> None:
    engine.load(code("echo"), spec())
    results: dict[int, Any] = {}

    def call(n: int) -> None:
        results[n] = engine.process(event({"n": n}), timeout_s=10)[0].get_data()

    threads = [threading.Thread(target=call, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert results == {n: {"input": {"n": n}} for n in range(8)}


def test_close_removes_child_and_directory(engine: PythonEngine) -> None:
    engine.load(code("echo"), spec())
    pid = engine.pid
    assert pid is not None
    directory = os.readlink(f"/proc/{pid}/cwd")
    assert os.path.isfile(os.path.join(directory, "worker.py"))

    engine.close()
    engine.close()

    assert not alive(pid)
    assert not os.path.exists(directory)


# --- gateway -------------------------------------------------------------------------------------


@pytest.fixture
def api_server() -> Iterator[Loopback]:
    with http_server() as server:
        yield server


def paths_and_bodies(server: Loopback) -> list[tuple[str, Any]]:
    return [(request.path, request.json()) for request in server.requests]


def gateway_engine(*hosts: str) -> PythonEngine:
    return PythonEngine(SETTINGS.replace(gateway_allowed_hosts=hosts, gateway_timeout_s=5.0))


def test_api_worker_calls_the_gateway_through_the_host(
    api_server: Loopback,
) -> None:
    port = api_server.port
    engine = gateway_engine("127.0.0.1")
    try:
        engine.load(code("gateway_client", API_PORT=port), spec())
        [output] = engine.process(event({"sku": "A-1"}, correlationid="c-9"), timeout_s=10)
    finally:
        engine.close()

    assert paths_and_bodies(api_server) == [("/orders/create", {"sku": "A-1"})]
    assert output.get_data() == {"answer": {"path": "/orders/create", "got": {"sku": "A-1"}}}
    assert output.get_extension("correlationid") == "c-9"


def test_api_command_worker_takes_host_and_port_from_the_command(
    api_server: Loopback,
) -> None:
    port = api_server.port
    engine = gateway_engine("127.0.0.1")
    try:
        engine.load(code("gateway_commands"), spec())
        command = {"command": "price", "sku": "B-2", "api_host": "127.0.0.1", "api_port": port}
        [output] = engine.process(event(command), timeout_s=10)
    finally:
        engine.close()

    assert paths_and_bodies(api_server) == [("/catalog/price", {"sku": "B-2"})]
    assert output.get_data()["via"] == f"127.0.0.1:{port}"


def test_gateway_refuses_hosts_not_allowed(
    api_server: Loopback,
) -> None:
    port = api_server.port
    engine = gateway_engine("api.internal")
    try:
        engine.load(code("gateway_client", API_PORT=port), spec())
        with pytest.raises(WorkerExecutionError, match="WM_GATEWAY_ALLOWED_HOSTS"):
            engine.process(event({"sku": "A-1"}), timeout_s=10)
    finally:
        engine.close()

    assert paths_and_bodies(api_server) == []


def test_engine_class_is_exported_lazily() -> None:
    import engines.python

    assert engines.python.PythonEngine is PythonEngine
    assert PythonEngine.mime_type == "text/x-python"


def test_validate_makes_no_gateway_calls(api_server: Loopback) -> None:
    port = api_server.port
    engine = gateway_engine("127.0.0.1")
    source = (
        b"from wm.devkit import ApiClient\n"
        b"ApiClient('127.0.0.1', " + str(port).encode() + b").gateway.audit.record({})\n"
        b"def process(event):\n    pass\n"
    )
    try:
        with pytest.raises(InvalidCode, match="not made while code is being validated"):
            engine.validate(source, spec())
        engine.load(source, spec())
    finally:
        engine.close()

    assert paths_and_bodies(api_server) == [("/audit/record", {})]


def test_child_that_died_while_idle_is_replaced_before_the_next_message(
    engine: PythonEngine,
) -> None:
    import signal

    engine.load(code("echo"), spec())
    pid = engine.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)

    assert engine.process(event({"a": 1}), timeout_s=5)[0].get_type() == "echo.out"
    assert engine.pid != pid


#: A host process: loads a worker whose call sleeps for ten minutes, prints its
#: child's pid and its sandbox's layers, and calls it. ``fallback``: as on a host without bwrap.
_HUNG_HOST = """
import sys
import wm
from engines.python import isolation
if sys.argv[1] == "fallback":
    found = isolation.shutil.which
    isolation.shutil.which = lambda name: None if name == "bwrap" else found(name)
from engines.python import PythonEngine
from wm.config import Settings
from wm.engine import WorkerSpec
from wm.events import make_event
engine = PythonEngine(Settings.from_env())
code = b"import time\\ndef process(event):\\n    time.sleep(600)\\n"
engine.load(code, WorkerSpec(worker_id="w-hung", topic="orders"))
print(engine.pid, ",".join(engine.isolation_layers), flush=True)
engine.process(make_event("orders.placed", "/tests", {}), timeout_s=600)
"""


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (under bwrap: the outer bwrap, the inner one, python)."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(FileNotFoundError):
            for child in (task / "children").read_text().split():
                found += _tree(int(child))
    return found


def _asleep_in_the_call(pid: int) -> list[int]:
    """:func:`_tree` of ``pid`` once one of it sleeps in the kernel's nanosleep (the
    worker's ``time.sleep``), else nothing."""
    tree = _tree(pid)
    for member in tree:
        with contextlib.suppress(FileNotFoundError):
            if "nanosleep" in Path(f"/proc/{member}/wchan").read_text():
                return tree
    return []


@pytest.mark.parametrize("kind", ["bwrap", "fallback"])
def test_a_child_in_a_hung_call_dies_with_its_host(kind: str, tmp_path: Path) -> None:
    """A pool process killed by SIGKILL (or the OOM killer) closes nothing: its sandbox
    child, asleep in a call, is killed with it (the layer ``dies with its host``), under
    bubblewrap and under the fallback without it, at default settings. Without the layer
    the fallback's child lived on as an orphan for the whole sleep."""
    env = {k: v for k, v in os.environ.items() if k != "WM_SANDBOX_REQUIRE"}
    env["TMPDIR"] = str(tmp_path)  # what the killed host cannot clean up stays in tmp_path
    host = subprocess.Popen(
        [sys.executable, "-c", _HUNG_HOST, kind], stdout=subprocess.PIPE, text=True, env=env
    )
    tree: list[int] = []
    try:
        assert host.stdout is not None
        assert select.select([host.stdout], [], [], 60)[0], "the host did not start its child"
        pid, layers = host.stdout.readline().rstrip().split(" ", 1)
        assert "dies with its host" in layers.split(","), layers
        assert ("mount namespace" in layers) is (kind == "bwrap"), layers
        tree = eventually(lambda: _asleep_in_the_call(int(pid)), timeout_s=30, interval_s=0.05)
        host.kill()
        host.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(running(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in tree if running(p)]
        assert not left, f"the sandbox's processes {left} outlived their killed host"
    finally:
        host.kill()
        host.wait(timeout=10)
        for p in tree:
            if running(p):
                os.kill(p, signal.SIGKILL)
