"""The .NET engines in this process, on the real runtime: the DevKit's contract, compile and
load errors, async calls and time limits, unloading, isolation, the gateway; and without a
runtime: discovery, packages and the wire between Python and the host helper."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from datetime import UTC, date, datetime, timedelta, timezone
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest

from engines.dotnet import runtime
from engines.dotnet.engine import CSharpEngine, DotNetDllEngine
from engines.dotnet.package import best_tfm, read_package
from engines.dotnet.wire import WorkerFailed, decode_answer, encode_event
from tests.conftest import ROOT
from tests.dotnet.harness import EXAMPLES, worker
from tests.helpers import http_server
from wm import Settings
from wm.engine import WORKER_ANSWER, Outputs, WorkerSpec
from wm.errors import (
    EngineUnavailable,
    EventDecodeError,
    InvalidCode,
    WorkerExecutionError,
    WorkerTimeout,
)
from wm.events import CloudEvent, make_event

COMMAND_SOURCE = (EXAMPLES / "CommandWorker.cs").read_bytes()


def csharp(body: str) -> bytes:
    """A C# worker source: usings, then ``body``."""
    usings = "using System; using System.Threading.Tasks; using System.Text.Json.Nodes;\n"
    return (usings + "using Virtufin.Worker.DevKit;\n" + textwrap.dedent(body)).encode()


THROWS = csharp("""
    public sealed class Boom : WorkerBase {
        public Boom() : base("boom.done", "/boom") { }
        public override Task<CloudEvent> ProcessAsync(CloudEvent input) {
            throw new InvalidOperationException("boom: " + input.Subject);
        }
    }
""")
SLEEPS = csharp("""
    public sealed class Sleeper : WorkerBase {
        public Sleeper() : base("slept", "/sleeper") { }
        public override async Task<CloudEvent> ProcessAsync(CloudEvent input) {
            await Task.Delay((int)((JsonObject)input.Data)["ms"]);
            return Response(input, input.Data);
        }
    }
""")


def command(name: str | None, correlation: str | None = "corr-1", **fields: Any) -> CloudEvent:
    data = {**({"command": name} if name is not None else {}), **fields}
    extensions = {"correlationid": correlation} if correlation else None
    return make_event("orders", "/tests", data, extensions=extensions)


@pytest.fixture
def settings() -> Settings:
    """Engines need no database or broker: the environment's settings."""
    return Settings.from_env()


def host() -> Any:
    assert runtime.started()
    return runtime.runtime(Settings.from_env()).host


# -- the DevKit's contract -------------------------------------------------------------------


def test_command_worker_dispatches_and_answers_the_seed_messages(engine_for: Any) -> None:
    engine = engine_for(COMMAND_SOURCE)
    [done] = engine.process(command("UPPER", text="book"), 5)
    assert done.get_type() == "orders.done" and done.get_data() == {"text": "BOOK"}
    assert done.get_extension("correlationid") == "corr-1"
    [plain] = engine.process(command("upper", correlation=None, text="x"), 5)
    assert plain.get_extension("correlationid") is None

    expected = {
        "Unknown command: refund": command("refund"),
        "Unknown command: 1": command("1"),  # numbers name no member, though Enum.TryParse agrees
        "Missing 'command' field": command(None, item=1),
        "Failed to parse command JSON": make_event(
            "orders", "/t", "not json", datacontenttype="text/plain"
        ),
        "Internal error: asked to fail": command("fail"),
    }
    for message, event in expected.items():
        answer = engine.process(event, 5)
        assert isinstance(answer, Outputs) and answer.worker_error == message
        [error] = answer
        assert error.get_type() == "orders.done.error"
        assert error.get_data() == {"error": message}
        # a throwing handler is reported as its exception (issue 27), a refusal as an answer
        thrown = "System.InvalidOperationException" if "asked to fail" in message else None
        assert answer.error_type == (thrown or WORKER_ANSWER)


def test_data_kinds_and_attributes_reach_the_worker_and_come_back(engine_for: Any) -> None:
    engine = engine_for(
        csharp("""
        public sealed class Mirror : WorkerBase {
            public Mirror() : base("mirror", "/mirror") { }
            public override Task<CloudEvent> ProcessAsync(CloudEvent input) {
                var output = new CloudEvent("mirror", "/mirror", input.Data);
                output.Subject = input.Subject;
                output.DataContentType = input.DataContentType;
                output["kind"] = input.Data == null ? "none" : input.Data.GetType().Name;
                output["tenant"] = input["tenant"];
                return Task.FromResult(output);
            }
        }
    """)
    )
    cases = [
        ({"a": [1, 2.5, None, "é"]}, None, "JsonObject"),
        ("plain text\u0000with a NUL", "text/plain", "String"),
        (b"\x00\x01binary", "application/octet-stream", "Byte[]"),
        (None, None, "none"),
    ]
    for data, content_type, kind in cases:
        event = make_event(
            "orders",
            "/t",
            data,
            subject="s-1",
            datacontenttype=content_type,
            extensions={"tenant": "acme"},
        )
        [output] = engine.process(event, 5)
        assert output.get_data() == data
        assert output.get_extension("kind") == kind
        assert output.get_extension("tenant") == "acme"
        assert output.get_attributes()["subject"] == "s-1"


def test_the_worker_reads_the_time_as_python_writes_it_and_may_replace_it(
    engine_for: Any,
) -> None:
    # a UTC time crosses as microseconds and is written in .NET only when read: the text
    # must be isoformat's, whole seconds and other offsets included
    engine = engine_for(
        csharp("""
        public sealed class Clock : WorkerBase {
            public Clock() : base("clock", "/clock") { }
            public override Task<CloudEvent> ProcessAsync(CloudEvent input) {
                var data = new JsonObject();
                data["seen"] = input.Time;
                var output = Response(input, data);
                input.Time = "2001-02-03T04:05:06Z";
                output["after"] = input.Time;
                return Task.FromResult(output);
            }
        }
    """)
    )
    utc, plus_two = UTC, timezone(timedelta(hours=2))
    times = [
        datetime(2026, 12, 4, 18, 46, 45, 940512, tzinfo=utc),
        datetime(2026, 12, 4, 18, 46, 45, tzinfo=utc),
        datetime(1969, 12, 31, 23, 59, 59, 1, tzinfo=utc),
        datetime(1, 1, 1, tzinfo=utc),
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=utc),
        datetime(2026, 12, 4, 18, 46, 45, 5, tzinfo=plus_two),
    ]
    for at in times:
        [output] = engine.process(make_event("orders", "/t", {}, time=at), 5)
        assert output.get_data() == {"seen": at.isoformat()}, at
        assert output.get_extension("after") == "2001-02-03T04:05:06Z"


def test_text_crosses_as_utf8_whatever_its_size_and_the_call_lets_python_threads_run(
    engine_for: Any,
) -> None:
    """The event crosses into .NET as UTF-8 bytes through a function pointer with the
    interpreter's lock released; an answer longer than the caller's buffer is taken whole."""
    engine = engine_for(
        csharp("""
        public sealed class Echo : WorkerBase {
            public Echo() : base("echo", "/echo") { }
            public override Task<CloudEvent> ProcessAsync(CloudEvent input) {
                string text = (string)input.Data;
                if (text == "block") System.Threading.Thread.Sleep(400);
                var output = new CloudEvent("echo", "/echo", text);
                output.DataContentType = "text/plain";
                output["chars"] = text.Length.ToString();  // UTF-16 units, as .NET counts
                return Task.FromResult(output);
            }
        }
    """)
    )
    long_text = "é😀" * (runtime.ANSWER_BYTES // 3)  # 6 bytes a pair: over the buffer
    for text in ("plain", "é, 中文, 😀 and \u0000", long_text):
        [output] = engine.process(make_event("t", "/t", text, datacontenttype="text/plain"), 5)
        assert output.get_data() == text
        assert output.get_extension("chars") == str(len(text.encode("utf-16-le")) // 2)

    ticks = 0
    stop = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.05)
        before = ticks
        engine.process(make_event("t", "/t", "block", datacontenttype="text/plain"), 5)
        during = ticks - before
    finally:
        stop.set()
        ticker.join()
    assert during >= 20, f"a Python thread ticked {during} times in a 400 ms .NET call"


def test_a_workers_log_lines_reach_python_logging_from_its_call_and_after_an_await(
    engine_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The log hook takes Python's lock back inside a call that released it, on the calling
    thread and on the thread pool's after an ``await``."""
    engine = engine_for(
        csharp("""
        public sealed class Chatty : WorkerBase {
            public Chatty() : base("chatty", "/chatty") { }
            public override async Task<CloudEvent> ProcessAsync(CloudEvent input) {
                Log("warning", "before " + input.Subject);
                await Task.Delay(20);
                Log("error", "after on thread " + Environment.CurrentManagedThreadId);
                return null;
            }
        }
    """),
        worker("w-chatty"),
    )
    with caplog.at_level(logging.WARNING, logger="engines.dotnet.worker"):
        for n in range(3):
            assert engine.process(make_event("t", "/t", None, subject=f"s-{n}"), 5) == []
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [line for line in lines if "before" in line[1]] == [
        (logging.WARNING, f".NET worker w-chatty: before s-{n}") for n in range(3)
    ]
    after = [line for line in lines if "after on thread" in line[1]]
    assert len(after) == 3 and all(level == logging.ERROR for level, _ in after)


def test_a_null_answer_publishes_nothing(engine_for: Any) -> None:
    engine = engine_for(
        csharp("""
        public sealed class Quiet : IWorker {
            public Task<CloudEvent> ProcessAsync(CloudEvent input) {
                return Task.FromResult<CloudEvent>(null);
            }
        }
    """)
    )
    assert engine.process(command("x"), 5) == []


def test_an_exception_fails_the_delivery_with_the_dotnet_type(engine_for: Any) -> None:
    engine = engine_for(THROWS)
    event = make_event("orders", "/t", {}, subject="s-9")
    with pytest.raises(WorkerExecutionError, match="boom: s-9") as caught:
        engine.process(event, 5)
    assert caught.value.error_type == "System.InvalidOperationException"


def test_gateway_calls_go_through_the_host_allow_list(
    dotnet: runtime.Root, settings: Settings
) -> None:
    allowed = settings.replace(gateway_allowed_hosts=("127.0.0.1",))
    engine = CSharpEngine(allowed)
    engine.load(COMMAND_SOURCE, worker())
    try:
        with http_server() as gateway:
            port = gateway.port
            no_host = engine.process(command("lookup", query={}), 5)
            assert "no API host configured" in str(no_host.worker_error)  # type: ignore[attr-defined]
            lookup = command("lookup", api_host="127.0.0.1", api_port=port, query={"id": 7})
            [found] = engine.process(lookup, 5)
            assert found.get_data() == {"path": "/orders/find", "got": {"id": 7}}
            assert found.get_extension("correlationid") == "corr-1"
            refused = command("lookup", api_host="localhost", api_port=port, query={})
            answer = engine.process(refused, 5)
            assert isinstance(answer, Outputs)
            assert "gateway host 'localhost' is not allowed" in str(answer.worker_error)
    finally:
        engine.close()


# -- refusals at create time -----------------------------------------------------------------


def test_compile_errors_name_line_column_and_code(dotnet: runtime.Root, settings: Settings) -> None:
    broken = csharp("""
        public sealed class Broken : IWorker {
            public Task<CloudEvent> ProcessAsync(CloudEvent input) {
                return Task.FromResult(input)
            }
        }
    """)
    with pytest.raises(InvalidCode) as caught:
        CSharpEngine(settings).validate(broken, worker())
    message = str(caught.value)
    assert "worker.cs(7,4): error CS1525: Unexpected symbol `}', expecting `;'" in message
    assert "Mono mcs, C# 7.2" in message
    modern = csharp("public record Order(string Id);")
    with pytest.raises(InvalidCode, match=r"worker\.cs\(\d+,\d+\): error CS\d+"):
        CSharpEngine(settings).validate(modern, worker())


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "public class Nothing { }",
            "no class in Worker implements Virtufin.Worker.DevKit.IWorker",
        ),
        (
            """
            public class A : IWorker {
                public Task<CloudEvent> ProcessAsync(CloudEvent i) { return null; }
            }
            public class B : IWorker {
                public Task<CloudEvent> ProcessAsync(CloudEvent i) { return null; }
            }
            """,
            r"2 classes implement Virtufin.Worker.DevKit.IWorker \(A, B\)",
        ),
        (
            """
            public class Picky : WorkerBase {
                public Picky() : base("", "/p") { }
                public override Task<CloudEvent> ProcessAsync(CloudEvent i) { return null; }
            }
            """,
            "responseType must be a non-empty string",
        ),
        (
            """
            public class NotEnum : CommandWorker<int> {
                public NotEnum() : base("t", "/s") { }
                protected override Task<CloudEvent> HandleAsync(CloudEvent i, int c, JsonNode n)
                { return null; }
            }
            """,
            "must be a CommandWorker<T> whose T is an enum",
        ),
    ],
)
def test_workers_that_cannot_be_instantiated_are_refused(
    dotnet: runtime.Root, settings: Settings, body: str, message: str
) -> None:
    with pytest.raises(InvalidCode, match=message):
        CSharpEngine(settings).validate(csharp(body), worker())


def test_packages_are_checked_before_anything_loads(tmp_path: Path) -> None:
    with pytest.raises(InvalidCode, match=r"must be a \.NET DLL .* or a nupkg"):
        read_package(b"#!/bin/sh\n", 8)
    with pytest.raises(InvalidCode, match=r"no lib/<tfm>/\*\.dll entries"):
        read_package(_zip({"readme.txt": b"hi"}), 8)
    several = _zip({"lib/net8.0/A.dll": b"MZa", "lib/net8.0/B.dll": b"MZb"})
    with pytest.raises(InvalidCode, match=r"holds 2 DLLs \(A.dll, B.dll\) and none is the worker"):
        read_package(several, 8)
    with pytest.raises(
        InvalidCode, match=r"no lib/ folder .* targets a framework that \.NET 8 runs"
    ):
        read_package(_zip({"lib/net9.0/A.dll": b"MZ", "lib/net472/A.dll": b"MZ"}), 8)
    package = read_package(
        _zip(
            {
                "Shop.Worker.nuspec": b"<package><metadata><id>Shop.Worker</id></metadata>"
                b"</package>",
                "lib/netstandard2.0/Shop.Worker.dll": b"MZold",
                "lib/net8.0/Shop.Worker.dll": b"MZnew",
                "lib/net8.0/Dep.dll": b"MZdep",
                "lib/net8.0/Virtufin.Worker.DevKit.dll": b"MZkit",  # the host's copy is used
            }
        ),
        8,
    )
    assert (package.main, package.tfm, sorted(package.files)) == (
        "Shop.Worker.dll",
        "net8.0",
        ["Dep.dll", "Shop.Worker.dll"],
    )
    assert package.files["Shop.Worker.dll"] == b"MZnew"
    assert read_package(b"MZ\x90\x00", 8).main == "Worker.dll"


def test_best_tfm_is_what_nuget_picks() -> None:
    folders = ["netstandard2.0", "netstandard2.1", "netcoreapp3.1", "net6.0", "net8.0", "net9.0"]
    assert best_tfm(folders, 8) == "net8.0"
    assert best_tfm(folders, 7) == "net6.0"
    assert best_tfm(["netstandard2.0", "netcoreapp3.1"], 8) == "netcoreapp3.1"
    assert best_tfm(["netstandard1.3", "netstandard2.0"], 8) == "netstandard2.0"
    assert best_tfm(["net8.0-windows", "netstandard2.0"], 8) == "netstandard2.0"


def _zip(files: dict[str, bytes]) -> bytes:
    buffer = BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return buffer.getvalue()


# -- compiled workers: nupkg, siblings, identity ---------------------------------------------


def test_a_nupkg_worker_loads_with_its_sibling_dependency(
    engine_for: Any, dotnet_packages: dict[str, Path]
) -> None:
    code = dotnet_packages["greeting"].read_bytes()
    engine = engine_for(code, worker("w-greet"), DotNetDllEngine)
    [output] = engine.process(make_event("greet", "/t", {"name": "Ada"}), 5)
    assert output.get_data() == {"greeting": "Hello, Ada!", "worker": "w-greet"}
    answer = engine.process(make_event("greet", "/t", {"nom": "Ada"}), 5)
    assert answer.worker_error == "data needs a 'name'"


# -- async calls, time limits, unloading -----------------------------------------------------


def test_async_calls_overlap_without_a_thread_each(engine_for: Any) -> None:
    engine = engine_for(SLEEPS)
    results: list[Any] = []

    def call() -> None:
        results.append(engine.process(make_event("t", "/t", {"ms": 300}), 5))

    started = time.monotonic()
    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    assert len(results) == 8 and all(r[0].get_data() == {"ms": 300} for r in results)
    assert elapsed < 8 * 0.3 / 2, f"8 calls of 300 ms took {elapsed:.2f} s: they did not overlap"


def test_a_timed_out_context_is_replaced_and_collected_once_its_call_returns(
    engine_for: Any,
) -> None:
    engine = engine_for(SLEEPS)
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"did not finish within 0\.2 s"):
        engine.process(make_event("t", "/t", {"ms": 1500}), 0.2)
    assert time.monotonic() - started < 1.0
    [output] = engine.process(make_event("t", "/t", {"ms": 1}), 5)  # a fresh context
    assert output.get_data() == {"ms": 1}
    assert host().Loaded() >= 1
    time.sleep(1.6)  # the abandoned call returns: its context unloads
    assert list(host().CollectUnloaded(10)) == []


def test_fifty_reloads_collect_every_context_and_keep_memory_flat(
    engine_for: Any, dotnet_packages: dict[str, Path]
) -> None:
    code = dotnet_packages["greeting"].read_bytes()
    engine = engine_for(code, worker("w-reload"), DotNetDllEngine)
    event = make_event("greet", "/t", {"name": "Ada"})

    def reload(times: int) -> None:
        for version in range(times):
            engine.load(code, WorkerSpec(worker_id="w-reload", topic="t", version=version + 2))
            assert engine.process(event, 5)[0].get_data()["greeting"] == "Hello, Ada!"

    reload(20)  # warm: JIT, first allocations
    assert list(host().CollectUnloaded(10)) == []
    before, loaded, started = _rss_mib(), host().Loaded(), time.monotonic()
    reload(50)
    per_reload_ms = (time.monotonic() - started) * 1000 / 50
    assert host().Loaded() == loaded, "a reload left its old context loaded"
    assert list(host().CollectUnloaded(10)) == [], "an unloaded context is still alive"
    grown = _rss_mib() - before
    print(f"50 reloads, {per_reload_ms:.1f} ms each: RSS {before:.1f} -> {before + grown:.1f} MiB")
    assert grown < 15, f"memory grew {grown:.1f} MiB over 50 reloads"


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


# -- isolation -------------------------------------------------------------------------------


def test_isolated_workers_are_killed_at_the_limit_and_started_again(engine_for: Any) -> None:
    engine = engine_for(SLEEPS, worker("w-iso", isolation="subprocess"))
    assert engine.process(make_event("t", "/t", {"ms": 1}), 5)[0].get_data() == {"ms": 1}
    first = engine._runner.helper.pid
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match="helper process was killed"):
        engine.process(make_event("t", "/t", {"ms": 60000}), 0.5)
    assert time.monotonic() - started < 3
    [again] = engine.process(make_event("t", "/t", {"ms": 1}), 30)
    assert again.get_data() == {"ms": 1} and engine._runner.helper.pid != first


def test_isolated_workers_relay_exceptions_and_command_answers(engine_for: Any) -> None:
    engine = engine_for(COMMAND_SOURCE, worker("w-iso-cmd", isolation="subprocess"))
    assert engine.process(command("upper", text="a"), 10)[0].get_data() == {"text": "A"}
    assert engine.process(command("nope"), 10).worker_error == "Unknown command: nope"
    failed = engine.process(command("fail"), 10)
    assert isinstance(failed, Outputs) and failed.error_type == "System.InvalidOperationException"
    thrower = engine_for(THROWS, worker("w-iso-boom", isolation="subprocess"))
    with pytest.raises(WorkerExecutionError) as caught:
        thrower.process(make_event("t", "/t", {}, subject="x"), 10)
    assert caught.value.error_type == "System.InvalidOperationException"


def test_an_isolated_worker_that_kills_its_runtime_costs_one_delivery(engine_for: Any) -> None:
    engine = engine_for(
        csharp("""
        public sealed class Doomed : WorkerBase {
            public Doomed() : base("doomed", "/doomed") { }
            public override Task<CloudEvent> ProcessAsync(CloudEvent input) {
                if (input.Subject == "die") Environment.FailFast("asked to die");
                return Task.FromResult(Response(input, input.Data));
            }
        }
    """),
        worker("w-iso-die", isolation="subprocess"),
    )
    with pytest.raises(
        WorkerExecutionError, match=r"died while processing an event: killed by SIGABRT"
    ):
        engine.process(make_event("t", "/t", {}, subject="die"), 10)
    [output] = engine.process(make_event("t", "/t", {"n": 1}), 30)
    assert output.get_data() == {"n": 1}


def test_isolated_code_is_validated_in_a_helper(dotnet: runtime.Root, settings: Settings) -> None:
    with pytest.raises(InvalidCode, match="no class in Worker implements"):
        CSharpEngine(settings).validate(
            csharp("public class Nothing { }"), worker(isolation="subprocess")
        )


def test_an_unknown_isolation_mode_is_refused(dotnet: runtime.Root, settings: Settings) -> None:
    with pytest.raises(InvalidCode, match="'isolation' is 'container'"):
        CSharpEngine(settings).validate(SLEEPS, worker(isolation="container"))


# -- the runtime: discovery, roll-forward, fork ----------------------------------------------


def _fake_root(path: Path, *versions: str) -> Path:
    (path / "host" / "fxr" / "8.0.0").mkdir(parents=True)
    (path / "host" / "fxr" / "8.0.0" / "libhostfxr.so").write_bytes(b"")
    for version in versions:
        (path / "shared" / "Microsoft.NETCore.App" / version).mkdir(parents=True)
    return path


def test_discovery_names_every_place_it_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _fake_root(tmp_path / "old", "6.0.25")
    places = [("DOTNET_ROOT", old), ("system install", tmp_path / "none"), ("extra", None)]
    monkeypatch.setattr(runtime, "candidates", lambda: places)
    with pytest.raises(EngineUnavailable) as caught:
        runtime.discover()
    message = str(caught.value)
    assert "no .NET runtime was found" in message and "host/fxr/<version>/" in message
    assert f"DOTNET_ROOT: {old} has no Microsoft.NETCore.App 8.0 or newer (has: 6.0.25)" in message
    assert f"system install: {tmp_path / 'none'} does not exist" in message
    assert "extra: not set" in message and "[dotnet-runtime] extra" in message
    assert "install a supported Microsoft runtime (.NET 10 LTS" in message
    assert "is for tests only" in message


#: Support windows for the tests, whatever today's date: 8 and 9 ended, 10 goes on.
ENDED, GOES_ON = date(2000, 1, 1), date(9999, 1, 1)
WINDOWS = {8: ENDED, 9: ENDED, 10: GOES_ON}


def test_a_root_runs_its_newest_supported_major_else_its_lowest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "SUPPORT_ENDS", WINDOWS)
    both = _fake_root(tmp_path / "both", "8.0.4", "8.0.11", "9.0.1", "10.0.0", "10.0.2")
    assert runtime.qualify(both)[0] == runtime.Root(both, (10, 0, 2))
    old = _fake_root(tmp_path / "old", "9.0.1", "9.0.7", "8.0.4")
    assert runtime.qualify(old)[0] == runtime.Root(old, (8, 0, 4))
    # a major newer than the table counts as supported
    assert runtime.Root(both, (11, 0, 0)).supported()
    no_host = tmp_path / "nohost"
    (no_host / "shared" / "Microsoft.NETCore.App" / "8.0.0").mkdir(parents=True)
    assert runtime.qualify(no_host) == (None, "no host/fxr/<version>/libhostfxr.so")


def test_the_runtime_config_starts_the_chosen_major(tmp_path: Path) -> None:
    options = runtime.Root(tmp_path, (10, 0, 2)).runtime_config()["runtimeOptions"]
    assert options["rollForward"] == "Major" and options["tfm"] == "net10.0"
    assert options["framework"] == {"name": "Microsoft.NETCore.App", "version": "10.0.0"}


def test_discovery_prefers_a_supported_runtime_and_warns_of_one_out_of_support(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "SUPPORT_ENDS", WINDOWS)
    stale = _fake_root(tmp_path / "stale", "8.0.4")
    current = _fake_root(tmp_path / "current", "10.0.1")
    places: list[tuple[str, Path | None]] = [("DOTNET_ROOT", stale), ("system install", current)]
    monkeypatch.setattr(runtime, "candidates", lambda: places)
    chosen = runtime.discover()
    assert chosen == runtime.Root(current, (10, 0, 1)) and chosen.support_warning() is None
    places.pop()  # only the stale one left: used, with the warning
    chosen = runtime.discover()
    assert chosen == runtime.Root(stale, (8, 0, 4))
    warning = chosen.support_warning()
    assert warning is not None and "out of support since 2000-01-01" in warning
    assert ".NET 10 LTS" in warning and "DOTNET_ROOT" in warning


def test_discovery_prefers_dotnet_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_root(tmp_path / "custom", "8.0.1")
    monkeypatch.setenv("DOTNET_ROOT", str(root))
    assert runtime.candidates()[0] == ("DOTNET_ROOT", root)
    assert runtime.discover() == runtime.Root(root, (8, 0, 1))


def test_a_dotnet_sdk_compiles_when_present(tmp_path: Path) -> None:
    root = runtime.Root(_fake_root(tmp_path / "sdk", "8.0.4"), (8, 0, 4))
    (root.path / "dotnet").write_bytes(b"")
    csc = root.path / "sdk" / "8.0.404" / "Roslyn" / "bincore" / "csc.dll"
    csc.parent.mkdir(parents=True)
    csc.write_bytes(b"")
    assert isinstance(runtime.find_compiler(root), runtime.MonoCompiler)  # no reference pack
    pack = root.path / "packs" / "Microsoft.NETCore.App.Ref" / "8.0.4" / "ref" / "net8.0"
    pack.mkdir(parents=True)
    compiler = runtime.find_compiler(root)
    assert isinstance(compiler, runtime.RoslynCompiler)
    assert (compiler.csc, compiler.references) == (csc, pack)
    assert compiler.name == "Roslyn from the .NET SDK 8.0.404"


FORK_PROBE = """
import os, sys
from wm.config import Settings
from engines.dotnet import runtime
runtime.runtime(Settings.from_env())
pid = os.fork()
if pid == 0:
    try:
        runtime.runtime(Settings.from_env())
    except Exception as exc:
        print(type(exc).__name__, exc, flush=True)
        os._exit(0)
    print("started in the child", flush=True)
    os._exit(1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_runtime_inherited_through_fork_is_refused(dotnet: runtime.Root) -> None:
    result = subprocess.run(
        [sys.executable, "-c", FORK_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "EngineUnavailable" in result.stdout and "does not survive fork" in result.stdout


SIGTERM_PROBE = """
import os, signal, time
from wm.config import Settings
from engines.dotnet import runtime
received = []
signal.signal(signal.SIGTERM, lambda number, frame: received.append(number))
runtime.runtime(Settings.from_env())
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("handled" if received else "not handled", flush=True)
"""


def test_starting_the_runtime_keeps_the_processs_sigterm_handler(dotnet: runtime.Root) -> None:
    """CoreCLR would take SIGTERM over (and exit with 143); Celery's handler must stay."""
    result = subprocess.run(
        [sys.executable, "-c", SIGTERM_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert (result.returncode, result.stdout.strip()) == (0, "handled"), result.stderr


def test_without_the_extra_the_engines_name_it() -> None:
    probe = (
        "import sys; sys.modules['defusedxml'] = None\n"
        "from wm.engine import engine_class\n"
        "try:\n    engine_class('text/x-csharp')\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.stdout.startswith("EngineUnavailable"), result.stdout + result.stderr
    assert "pip install -e '.[dotnet]'" in result.stdout  # run from this checkout


# -- the wire (no runtime) -------------------------------------------------------------------


def test_the_wire_refuses_what_it_cannot_carry() -> None:
    event = make_event("t", "/t", {"a": 1}, extensions={"tenant": "a\x00b"})
    with pytest.raises(EventDecodeError, match="holding a NUL character"):
        encode_event(event)
    with pytest.raises(EventDecodeError, match=r"e-2 holds a lone surrogate \('\\udc80'\)"):
        encode_event(make_event("t", "/t", "a\udc80", id="e-2", datacontenttype="text/plain"))
    header, data = encode_event(make_event("t", "/t", {"a": 1}, id="e-1"))
    assert header.split(b"\0")[:3] == [b"e-1", b"/t", b"t"] and json.loads(data) == {"a": 1}
    with pytest.raises(WorkerFailed, match="nope") as caught:
        decode_answer("error\0System.ArgumentException\0nope")
    assert caught.value.error_type == "System.ArgumentException"
    ok = "ok\0{id}\0/s\0{type}\0\0\0{time}\0j\0\0\0{count}{ext}\0{{}}"
    with pytest.raises(EventDecodeError, match="has no Type"):
        decode_answer(ok.format(id="1", type="", time="", count=0, ext=""))
    with pytest.raises(EventDecodeError, match="invalid Time"):
        decode_answer(ok.format(id="1", type="t", time="yesterday", count=0, ext=""))
    with pytest.raises(EventDecodeError, match="not a valid CloudEvent"):
        decode_answer(ok.format(id="1", type="t", time="", count=1, ext="\0Bad-Name\0v"))
    answer = decode_answer(
        ok.format(id="1", type="t", time="2026-01-02T03:04:05Z", count=0, ext="")
    )
    assert answer.event is not None and answer.event.get_attributes()["time"].year == 2026
