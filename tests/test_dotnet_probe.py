"""Health probes of .NET workers (issue 14): a worker's public ``Task<bool> ProbeAsync()``,
run in-process and in an isolated helper, from C# source and from a compiled DLL; a hanging
probe costs its context or its helper, like a hanging message; a real node probing them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from engines.dotnet import runtime
from engines.dotnet.engine import CSharpEngine, DotNetDllEngine
from engines.dotnet.wire import EVENT, PROBE, Request, WorkerFailed, decode_probe
from tests.dotnet.harness import EXAMPLES, worker
from tests.helpers import eventually
from tests.test_dotnet_engine import COMMAND_SOURCE, csharp
from wm import Settings, WorkManager
from wm.errors import InvalidCode, WorkerExecutionError, WorkerTimeout
from wm.events import make_event
from wm.state.health import HEALTHY, UNHEALTHY, UNKNOWN, Probes, no_probe_key

PROBED_SOURCE = (EXAMPLES / "ProbedWorker.cs").read_bytes()
MODES = ("in-process", "subprocess")
#: seconds a killed helper's call may take beyond its limit (the kill, the error's way back).
KILL_SLACK_S = 2.5


@pytest.fixture
def settings() -> Settings:
    return Settings.from_env()


def health(answer: str, **fields: Any) -> Any:
    """The event that sets what ProbedWorker's probe answers."""
    return make_event("probed.in", "/tests", {"command": "health", "answer": answer, **fields})


def set_health(engine: Any, answer: str, **fields: Any) -> None:
    [echoed] = engine.process(health(answer, **fields), 30)
    assert echoed.get_data()["answer"] == answer


# -- the contract ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_worker_without_probe_async_has_no_probe(engine_for: Any, mode: str) -> None:
    engine = engine_for(COMMAND_SOURCE, worker(f"w-noprobe-{mode}", isolation=mode))
    assert engine.probe(5) is None


@pytest.mark.parametrize("mode", MODES)
def test_the_probe_answers_healthy_false_or_the_exception(engine_for: Any, mode: str) -> None:
    engine = engine_for(PROBED_SOURCE, worker(f"w-probed-{mode}", isolation=mode))
    assert engine.probe(10) is True

    set_health(engine, "unhealthy")
    with pytest.raises(WorkerExecutionError, match="answered false"):
        engine.probe(10)

    set_health(engine, "throw")
    with pytest.raises(WorkerExecutionError) as caught:
        engine.probe(10)
    assert "the orders database is unreachable" in str(caught.value)
    assert caught.value.error_type == "System.InvalidOperationException"

    set_health(engine, "healthy")
    assert engine.probe(10) is True


def test_a_plain_iworker_probes_with_a_public_method(engine_for: Any) -> None:
    engine = engine_for(
        csharp("""
        public sealed class Plain : IWorker {
            public Task<CloudEvent> ProcessAsync(CloudEvent input) {
                return Task.FromResult<CloudEvent>(null);
            }
            public Task<bool> ProbeAsync() { return Task.FromResult(true); }
        }
    """)
    )
    assert engine.probe(5) is True


def test_a_probe_that_throws_before_its_task_fails_with_the_reason(engine_for: Any) -> None:
    engine = engine_for(
        csharp("""
        public sealed class Eager : WorkerBase {
            public Eager() : base("eager", "/eager") { }
            public override Task<CloudEvent> ProcessAsync(CloudEvent input) {
                return Task.FromResult<CloudEvent>(null);
            }
            public override Task<bool> ProbeAsync() {
                throw new TimeoutException("cache is cold");
            }
        }
    """)
    )
    with pytest.raises(
        WorkerExecutionError, match=r"threw System\.TimeoutException: cache is cold"
    ):
        engine.probe(5)


@pytest.mark.parametrize(
    "declaration",
    [
        "public bool ProbeAsync() { return true; }",
        "Task<bool> ProbeAsync() { return Task.FromResult(true); }",
        "public Task<bool> ProbeAsync(int retries) { return Task.FromResult(true); }",
    ],
    ids=["not-a-task", "not-public", "parameters"],
)
def test_a_probe_async_of_another_shape_is_refused(
    dotnet: runtime.Root, settings: Settings, declaration: str
) -> None:
    code = csharp(f"""
        public sealed class Odd : IWorker {{
            public Task<CloudEvent> ProcessAsync(CloudEvent input) {{
                return Task.FromResult<CloudEvent>(null);
            }}
            {declaration}
        }}
    """)
    with pytest.raises(InvalidCode, match=r"Odd\.ProbeAsync is no health probe: declare it as"):
        CSharpEngine(settings).validate(code, worker())


def test_a_compiled_worker_probes_too(engine_for: Any, settings: Settings, tmp_path: Path) -> None:
    dll = tmp_path / "ProbedWorker.dll"
    runtime.runtime(settings).compile([EXAMPLES / "ProbedWorker.cs"], dll, [])
    engine = engine_for(dll.read_bytes(), worker("w-probed-dll"), DotNetDllEngine)
    assert engine.probe(5) is True
    set_health(engine, "unhealthy")
    with pytest.raises(WorkerExecutionError, match="answered false"):
        engine.probe(5)


# -- hanging probes --------------------------------------------------------------------------


def test_an_isolated_probe_that_hangs_is_killed_with_its_helper(engine_for: Any) -> None:
    engine = engine_for(PROBED_SOURCE, worker("w-probe-hang", isolation="subprocess"))
    set_health(engine, "hang")
    first = engine._runner.helper.pid
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"probe timed out.*helper process was killed"):
        engine.probe(0.5)
    assert time.monotonic() - started < 0.5 + KILL_SLACK_S
    assert engine.probe(30) is True  # a fresh helper, a fresh worker: healthy again
    assert engine._runner.helper.pid != first


def test_an_in_process_probe_that_hangs_costs_its_context(engine_for: Any) -> None:
    engine = engine_for(PROBED_SOURCE, worker("w-probe-slow"))
    set_health(engine, "hang", ms=1500)
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"probe of \.NET worker w-probe-slow did not finish"):
        engine.probe(0.2)
    assert time.monotonic() - started < 1.0
    assert engine.probe(5) is True  # a fresh context
    host = runtime.runtime(Settings.from_env()).host
    eventually(lambda: list(host.CollectUnloaded(2)) == [])  # once the hung probe returned


# -- a real node ----------------------------------------------------------------------------

SICK = csharp("""
    public sealed class Sick : WorkerBase {
        public Sick() : base("sick.done", "/sick") { }
        public override Task<CloudEvent> ProcessAsync(CloudEvent input) {
            return Task.FromResult<CloudEvent>(null);
        }
        public override Task<bool> ProbeAsync() {
            throw new InvalidOperationException("orders-db refused the connection");
        }
    }
""")


@pytest.mark.slow
def test_a_node_probes_dotnet_workers_and_judges_their_health(
    dotnet: runtime.Root, pg_settings: Settings, start_node: Any
) -> None:
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(settings)
    probing = {"probe_interval_s": 1, "max_probe_failures": 2}
    well = manager.create_worker(
        code=PROBED_SOURCE, mime_type=CSharpEngine.mime_type, topic="dn.well", settings=probing
    )
    sick = manager.create_worker(
        code=SICK,
        mime_type=CSharpEngine.mime_type,
        topic="dn.sick",
        # degrade: it stays running, paused while unhealthy (remove would take it out)
        settings={**probing, "isolation": "subprocess", "recovery_on_health": "degrade"},
    )
    quiet = manager.create_worker(
        code=COMMAND_SOURCE, mime_type=CSharpEngine.mime_type, topic="dn.quiet", settings=probing
    )
    start_node(settings)
    probes = Probes(settings)

    eventually(lambda: manager.get_worker(well.id).health == HEALTHY, timeout_s=90)
    eventually(lambda: manager.get_worker(sick.id).health == UNHEALTHY, timeout_s=90)
    facts = probes.last(str(sick.id))
    assert facts is not None and facts.failures >= 2
    assert "System.InvalidOperationException: orders-db refused the connection" in facts.error
    client = redis.Redis.from_url(settings.redis_url)
    eventually(lambda: client.exists(no_probe_key(str(quiet.id), 1)))
    assert probes.last(str(quiet.id)) is None
    assert manager.get_worker(quiet.id).health == UNKNOWN


# -- the wire --------------------------------------------------------------------------------


def test_requests_and_probe_answers_cross_the_wire() -> None:
    event = Request(EVENT, 7000, "id\0src\0tÿpe".encode(), b"data\0with nul")
    assert Request.decode(event.encode()) == event
    assert Request.decode(Request(PROBE, 500).encode()) == Request(PROBE, 500, b"", b"")
    with pytest.raises(WorkerExecutionError, match="unknown kind"):
        Request.decode(b"X" + Request(PROBE, 1).encode()[1:])
    with pytest.raises(WorkerExecutionError, match="unreadable request"):
        Request.decode(b"E\0")
    assert [decode_probe(a) for a in ("noprobe", "healthy", "unhealthy")] == [None, True, False]
    with pytest.raises(WorkerFailed, match="down") as caught:
        decode_probe("error\0System.Exception\0down")
    assert caught.value.error_type == "System.Exception"
    with pytest.raises(ValueError, match="unexpected answer"):
        decode_probe("ok\0")
