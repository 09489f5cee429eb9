""".NET workers end to end: C# source and nupkgs created with the CLI, run by real prefork
Celery nodes (each pool process starts a runtime of its own)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engines.dotnet import runtime
from engines.dotnet.__main__ import pack
from tests.conftest import env_of
from tests.dotnet.harness import EXAMPLES, build
from tests.helpers import drain, eventually, queue_empty, wm_cli
from wm import CloudEvent, DeadLetters, Settings, WorkManager, make_event
from wm.events import LIFECYCLE_TOPIC, LIFECYCLE_TYPE_PREFIX, derive_id, key_of

logger = logging.getLogger(__name__)

SOURCE = "text/x-csharp"
DLL = "application/x-dotnet-dll"
#: The target framework folder of the nupkgs packed here (what ``pack`` defaults to).
TFM = "netstandard2.0"
WORKER_ERROR = LIFECYCLE_TYPE_PREFIX + "error"
#: Hot reloads under load: code updates, and the bounds of the events published meanwhile.
RELOADS = 50
MIN_EVENTS, MAX_EVENTS = 300, 500
#: Pause between two published events of the steady stream.
PUBLISH_INTERVAL_S = 0.01


def csharp(body: str) -> str:
    """A C# worker source: the usings every worker here needs, then ``body``."""
    usings = "using System;\nusing System.Threading.Tasks;\nusing Virtufin.Worker.DevKit;\n"
    return usings + textwrap.dedent(body)


THROWS = csharp("""
    public sealed class Boom : WorkerBase
    {
        public Boom() : base("boom.done", "/boom") { }

        public override Task<CloudEvent> ProcessAsync(CloudEvent input)
        {
            throw new InvalidOperationException("boom");
        }
    }
""")
#: Hangs on events whose subject is ``hang``, echoes the others.
HANGS = csharp("""
    public sealed class Sleepy : WorkerBase
    {
        public Sleepy() : base("sleepy.done", "/sleepy") { }

        public override async Task<CloudEvent> ProcessAsync(CloudEvent input)
        {
            if (input.Subject == "hang") await Task.Delay(60000);
            return Response(input, input.Data);
        }
    }
""")
#: The statement before ``return`` lacks its semicolon.
MISSING_SEMICOLON = csharp("""
    public sealed class Broken : WorkerBase
    {
        public Broken() : base("broken.done", "/broken") { }

        public override Task<CloudEvent> ProcessAsync(CloudEvent input)
        {
            CloudEvent output = Response(input, input.Data)
            return Task.FromResult(output);
        }
    }
""")
TWO_WORKERS = csharp("""
    public sealed class First : WorkerBase
    {
        public First() : base("first.done", "/first") { }
        public override Task<CloudEvent> ProcessAsync(CloudEvent input)
        {
            return Task.FromResult(Response(input, null));
        }
    }

    public sealed class Second : WorkerBase
    {
        public Second() : base("second.done", "/second") { }
        public override Task<CloudEvent> ProcessAsync(CloudEvent input)
        {
            return Task.FromResult(Response(input, null));
        }
    }
""")


def refused(settings: Settings, *args: str) -> str:
    """The one error line of a ``wm ARGS`` that must fail with exit code 1."""
    result = subprocess.run(
        [sys.executable, "-m", "wm.cli", *args],
        env=env_of(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, f"exit {result.returncode}:\n{result.stdout}{result.stderr}"
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("wm: error: "), result.stderr
    return line


def worker_errors(settings: Settings, queue: str, count: int) -> list[dict[str, Any]]:
    """The first ``count`` ``worker.error`` events of a lifecycle subscription (others are
    read and dropped)."""
    seen: list[dict[str, Any]] = []

    def enough() -> list[dict[str, Any]] | None:
        seen.extend(
            e for e in drain(settings, queue, 100, timeout_s=0.5) if e["type"] == WORKER_ERROR
        )
        return seen if len(seen) >= count else None

    return list(eventually(enough))


@pytest.mark.slow
def test_the_command_worker_as_source_and_as_nupkg_answers_every_command(
    dotnet: runtime.Root,
    pg_settings: Settings,
    start_node: Any,
    dotnet_packages: dict[str, Path],
    gateway_port: int,
) -> None:
    fast = pg_settings.replace(reconcile_interval_s=1.0, gateway_allowed_hosts=("127.0.0.1",))
    manager = WorkManager(fast)
    done = manager.subscribe("orders.done", "sink")
    errors = manager.subscribe("orders.done.error", "sink")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    create = ("worker", "create", "--topic", "orders", "--mime-type")
    source = wm_cli(fast, *create, SOURCE, "--file", str(EXAMPLES / "CommandWorker.cs"))
    compiled = wm_cli(fast, *create, DLL, "--file", str(dotnet_packages["command"]))
    workers = {source["id"], compiled["id"]}
    node = start_node(fast)
    for worker_id in workers:
        node.consuming(f"orders::{worker_id}")

    def send(data: Any, correlation: str, content_type: str | None = None) -> CloudEvent:
        extensions = {"correlationid": correlation}
        event = make_event(
            "orders", "/tests", data, datacontenttype=content_type, extensions=extensions
        )
        manager.publish(event)
        return event

    upper = send({"command": "upper", "text": "book"}, "corr-upper")
    gateway = {"api_host": "127.0.0.1", "api_port": gateway_port}
    send({"command": "lookup", "query": {"sku": 7}, **gateway}, "corr-lookup")
    send({"command": "refund"}, "corr-unknown")
    send({"text": "no command"}, "corr-missing")
    send("not json {", "corr-text", "text/plain")
    fail = send({"command": "fail"}, "corr-fail")

    answers: dict[str, list[dict[str, Any]]] = {"corr-upper": [], "corr-lookup": []}
    for answer in drain(fast, done, 4):
        answers[answer["correlationid"]].append(answer)
    uppers = answers["corr-upper"]
    assert {a["id"] for a in uppers} == {derive_id(key_of(upper), w, 0) for w in workers}
    assert [a["data"] for a in uppers] == [{"text": "BOOK"}] * 2
    lookups = [a["data"] for a in answers["corr-lookup"]]
    assert lookups == [{"path": "/orders/find", "got": {"sku": 7}}] * 2

    refusals = drain(fast, errors, 8)
    assert {r["type"] for r in refusals} == {"orders.done.error"}
    assert Counter((r["correlationid"], r["data"]["error"]) for r in refusals) == {
        ("corr-unknown", "Unknown command: refund"): 2,
        ("corr-missing", "Missing 'command' field"): 2,
        ("corr-text", "Failed to parse command JSON"): 2,
        ("corr-fail", "Internal error: asked to fail"): 2,
    }
    reported = [e["data"] for e in worker_errors(fast, lifecycle, 8)]
    failed = [e for e in reported if e["event_id"] == fail.get_id()]
    assert {e["worker_id"] for e in failed} == workers and len(failed) == 2
    assert {e["error_message"] for e in failed} == {"Internal error: asked to fail"}
    # the handler's exception by its .NET type (issue 27); the base's refusals as answers
    assert {e["error_type"] for e in failed} == {"System.InvalidOperationException"}
    assert {e["error_type"] for e in reported if e not in failed} == {"WorkerAnswer"}
    assert queue_empty(fast, done) and queue_empty(fast, errors)
    assert DeadLetters(fast).list() == []


@pytest.mark.slow
def test_a_nupkg_worker_runs_with_its_sibling_dependency(
    dotnet: runtime.Root,
    pg_settings: Settings,
    start_node: Any,
    dotnet_packages: dict[str, Path],
) -> None:
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    done = manager.subscribe("greetings.done", "sink")
    package = str(dotnet_packages["greeting"])
    worker = wm_cli(
        fast, "worker", "create", "--topic", "greet", "--mime-type", DLL, "--file", package
    )
    node = start_node(fast)
    node.consuming(f"greet::{worker['id']}")

    manager.publish(make_event("greet", "/tests", {"name": "Ada"}))
    [greeting] = drain(fast, done, 1)
    assert greeting["data"] == {"greeting": "Hello, Ada!", "worker": worker["id"]}
    assert greeting["source"] == "/workers/greeting"


class Stream(threading.Thread):
    """Publishes ``{"name": "n<i>"}`` events at a steady pace until told to stop, once it
    sent at least MIN_EVENTS (and at most MAX_EVENTS)."""

    def __init__(self, settings: Settings, topic: str) -> None:
        super().__init__(daemon=True)
        self.manager, self.topic = WorkManager(settings), topic
        self.stopping = threading.Event()
        self.names: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while len(self.names) < MAX_EVENTS:
                if self.stopping.is_set() and len(self.names) >= MIN_EVENTS:
                    return
                name = f"n{len(self.names)}"
                self.manager.publish(make_event(self.topic, "/tests", {"name": name}))
                self.names.append(name)
                time.sleep(PUBLISH_INTERVAL_S)
        except BaseException as exc:
            self.error = exc

    def finish(self) -> list[str]:
        self.stopping.set()
        self.join(timeout=60)
        assert not self.is_alive() and self.error is None, self.error
        return self.names


@pytest.fixture
def greeting_builds(dotnet_packages: dict[str, Path], tmp_path: Path) -> list[bytes]:
    """Two builds of the greeting nupkg: the example (``Hello, <name>!``), and one whose
    sibling Greeter says ``Hi, <name>!`` (packed as version 2.0.0)."""
    greeter = tmp_path / "Greeter.cs"
    greeter.write_text((EXAMPLES / "nupkg" / "Greeter.cs").read_text().replace("Hello, ", "Hi, "))
    build("compile", greeter, "-o", tmp_path / "Greeter.dll")
    worker = dotnet_packages["greeting"].parent / "GreetingWorker.dll"
    second = tmp_path / "greeting-2.nupkg"
    pack([worker, tmp_path / "Greeter.dll"], second, "GreetingWorker", TFM, "2.0.0")
    return [dotnet_packages["greeting"].read_bytes(), second.read_bytes()]


@pytest.mark.slow
def test_hot_reloads_under_a_steady_stream_lose_and_repeat_no_event(
    dotnet: runtime.Root, pg_settings: Settings, start_node: Any, greeting_builds: list[bytes]
) -> None:
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    done = manager.subscribe("greetings.done", "sink")
    worker = manager.create_worker(code=greeting_builds[0], mime_type=DLL, topic="greet")
    node = start_node(fast)
    node.consuming(f"greet::{worker.id}")
    manager.publish(make_event("greet", "/tests", {"name": "warm-up"}))
    [warm] = drain(fast, done, 1)
    assert warm["data"]["greeting"] == "Hello, warm-up!"

    stream = Stream(fast, "greet")
    stream.start()
    eventually(lambda: len(stream.names) >= 10)  # the stream flows before the first reload
    started = time.monotonic()
    for update in range(RELOADS):  # the last one installs the "Hi" build
        manager.load_code_from_content(worker.id, greeting_builds[update % 2])
    reloads_s = time.monotonic() - started
    names = stream.finish()
    manager.publish(make_event("greet", "/tests", {"name": "final"}))

    outputs = drain(fast, done, len(names) + 1, timeout_s=120)
    by_name = Counter(o["data"]["greeting"].split(", ", 1)[1].rstrip("!") for o in outputs)
    assert by_name == Counter([*names, "final"])  # each event answered exactly once
    assert {o["data"]["worker"] for o in outputs} == {str(worker.id)}
    assert {o["data"]["greeting"] for o in outputs if "final" in o["data"]["greeting"]} == {
        "Hi, final!"
    }
    assert queue_empty(fast, done) and DeadLetters(fast).list() == []
    assert manager.get_worker(worker.id).current_version == RELOADS + 1
    versions = set(re.findall(rf"{worker.id} v(\d+) loaded", node.log.read_text()))
    logger.info(
        "%d events, %d reloads in %.1f s; the node loaded %d versions",
        len(names),
        RELOADS,
        reloads_s,
        len(versions),
    )
    assert len(versions) > RELOADS // 5, versions  # the stream met many of the versions


@pytest.mark.slow
def test_a_throwing_worker_is_retried_then_dead_lettered_with_its_dotnet_exception(
    dotnet: runtime.Root, pg_settings: Settings, start_node: Any
) -> None:
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(
        code=THROWS,
        mime_type=SOURCE,
        topic="boom",
        settings={"max_retries": 2, "retry_base_delay_ms": 20},
    )
    node = start_node(fast)
    node.consuming(f"boom::{worker.id}")

    event = make_event("boom", "/tests", {"n": 1})
    manager.publish(event)
    # the first attempt starts the runtime and compiles: tens of seconds on a loaded machine
    [letter] = eventually(lambda: DeadLetters(fast).list(), timeout_s=120)
    assert letter.attempts == 3 and letter.event_id == event.get_id()
    assert letter.error_type == "WorkerExecutionError"
    assert "threw System.InvalidOperationException: boom" in letter.error_message
    reported = [e["data"] for e in worker_errors(fast, lifecycle, 3)]
    assert [e["attempt"] for e in reported] == [1, 2, 3]
    assert {e["error_type"] for e in reported} == {"System.InvalidOperationException"}
    assert all(e["error_message"].endswith(": boom") for e in reported)


@pytest.mark.slow
def test_a_hanging_isolated_worker_times_out_and_the_node_keeps_serving(
    dotnet: runtime.Root, pg_settings: Settings, start_node: Any
) -> None:
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    done = manager.subscribe("sleepy.done", "sink")
    settings = (
        *("isolation=subprocess", "timeout_s=1", "max_retries=1", "retry_base_delay_ms=20"),
        "pause_when_unhealthy=false",  # its timeouts in a row would pause it while unhealthy
    )
    worker = wm_cli(
        fast,
        *("worker", "create", "--topic", "sleepy", "--mime-type", SOURCE, "--file", "-"),
        *(arg for setting in settings for arg in ("--setting", setting)),
        stdin=HANGS,
    )
    assert worker["settings"]["isolation"] == "subprocess"
    node = start_node(fast)
    node.consuming(f"sleepy::{worker['id']}")

    manager.publish(make_event("sleepy", "/tests", {}, subject="hang"))
    [letter] = eventually(lambda: DeadLetters(fast).list(), timeout_s=60)
    assert letter.error_type == "WorkerTimeout" and letter.attempts == 2
    assert "did not answer within 1 s" in letter.error_message

    manager.publish(make_event("sleepy", "/tests", {"after": "hang"}))
    [after] = drain(fast, done, 1)
    assert after["data"] == {"after": "hang"}
    assert node.proc.poll() is None


@pytest.mark.slow
def test_code_that_does_not_compile_or_load_is_refused_and_nothing_is_stored(
    dotnet: runtime.Root, pg_settings: Settings, dotnet_packages: dict[str, Path], tmp_path: Path
) -> None:
    two = tmp_path / "Two.cs"
    two.write_text(TWO_WORKERS)
    build("compile", two, "-o", tmp_path / "Two.dll")
    pack([tmp_path / "Two.dll"], tmp_path / "two.nupkg", "Two", TFM, "1.0.0")
    greeter = dotnet_packages["greeting"].parent / "Greeter.dll"
    pack([greeter], tmp_path / "none.nupkg", "Greeter", TFM, "1.0.0")
    broken = tmp_path / "Broken.cs"
    broken.write_text(MISSING_SEMICOLON)
    create = ("worker", "create", "--topic", "orders", "--mime-type")

    error = refused(pg_settings, *create, SOURCE, "--file", str(broken))
    assert "the C# worker does not compile" in error
    lines = MISSING_SEMICOLON.splitlines()
    statement = next(n for n, text in enumerate(lines, 1) if text.endswith("input.Data)"))
    where = re.search(r"worker\.cs\((\d+),(\d+)\): error CS\d{4}: ", error)
    assert where, error
    # a .NET SDK's compiler names the statement's end, Mono's the token after it
    assert int(where[1]) in (statement, statement + 1), error
    error = refused(pg_settings, *create, DLL, "--file", str(tmp_path / "two.nupkg"))
    assert "2 classes implement Virtufin.Worker.DevKit.IWorker (First, Second)" in error
    error = refused(pg_settings, *create, DLL, "--file", str(tmp_path / "none.nupkg"))
    assert "no class in Greeter implements Virtufin.Worker.DevKit.IWorker" in error
    assert wm_cli(pg_settings, "worker", "list") == []
    assert WorkManager(pg_settings).list_subscriptions() == []
