"""Health probes (issue 14, point 2(b)): the judgement with probe failures, the probe state in
Redis, the Python engine's ``probe`` request, and real nodes probing workers one at a time."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import wm  # noqa: F401 - import the platform before engines
from engines.python import PythonEngine
from engines.python.engine import PythonWorkerError
from tests.conftest import REDIS_HOST, STATE_DB
from tests.helpers import drain, eventually, free_port, scrape, wm_cli
from tests.workers import child_pids
from wm import Settings, WorkManager
from wm.engine import WorkerSpec
from wm.errors import WorkerExecutionError, WorkerTimeout
from wm.events import LIFECYCLE_TOPIC, make_event
from wm.state.health import (
    DEGRADED,
    HEALTHY,
    UNHEALTHY,
    UNKNOWN,
    ProbeFacts,
    Probes,
    WorkerHealth,
    judge,
    no_probe_key,
    probe_due_key,
)

PYTHON = "text/x-python"


def failed(n: int, error: str = "db down") -> ProbeFacts:
    return ProbeFacts(ok=False, failures=n, at=time.time(), error=error, version=1)


PASSED = ProbeFacts(ok=True, failures=0, at=0.0, version=1)


# --- the judgement ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ok", "fails", "probe", "settings", "health"),
    [
        (0, 0, None, {}, UNKNOWN),
        (0, 0, PASSED, {}, HEALTHY),  # a passing probe speaks for a worker without traffic
        (0, 0, failed(1), {}, DEGRADED),
        (0, 0, failed(2), {}, DEGRADED),
        (0, 0, failed(3), {}, UNHEALTHY),  # max_probe_failures, default 3
        (0, 0, failed(2), {"max_probe_failures": 2}, UNHEALTHY),
        (0, 0, failed(9), {"max_probe_failures": 0}, DEGRADED),  # 0: never unhealthy alone
        (100, 0, failed(1), {}, DEGRADED),  # good deliveries do not hide a failed probe
        (50, 50, PASSED, {}, UNHEALTHY),  # nor does a passing probe hide failed deliveries
        (90, 10, PASSED, {}, DEGRADED),
        (90, 10, failed(3), {}, UNHEALTHY),
    ],
)
def test_health_is_the_worse_of_the_deliveries_and_the_probe(
    ok: int, fails: int, probe: ProbeFacts | None, settings: dict[str, Any], health: str
) -> None:
    assert judge(ok, fails, 0, settings, probe).health == health


def test_the_reason_names_the_probe_failure() -> None:
    verdict = judge(0, 0, 0, {}, failed(3, "ConnectionError: orders-db refused"))
    assert verdict.health == UNHEALTHY
    assert verdict.reason == (
        "no delivery in the last 5 minutes; "
        "its probe failed 3 times in a row: ConnectionError: orders-db refused"
    )
    assert judge(0, 0, 0, {}, failed(1)).reason.endswith("its probe failed once in a row: db down")
    assert judge(0, 0, 0, {}, PASSED).reason.endswith("its last probe passed")


# --- probe state in Redis --------------------------------------------------------------------


@pytest.fixture
def state(pg_settings: Settings) -> Iterator[Settings]:
    yield pg_settings
    redis.Redis.from_url(f"{REDIS_HOST}/{STATE_DB}").flushdb()


def test_one_probe_per_worker_is_outstanding_and_the_next_is_due_after_the_interval(
    state: Settings,
) -> None:
    probes = Probes(state)
    workers = {"w1": (1, 30.0), "w2": (4, 30.0)}
    assert sorted(probes.claim_due(workers)) == ["w1", "w2"]
    assert probes.claim_due(workers) == []  # outstanding: nobody else sends another

    first = probes.record("w1", 1, "db down", interval_s=0.2)
    second = probes.record("w1", 1, "db still down", interval_s=0.2)
    assert (first.ok, first.failures, second.failures) == (False, 1, 2)
    assert probes.last("w1") == ProbeFacts(False, 2, second.at, "db still down", 1)
    assert probes.claim_due(workers) == []  # the interval runs from the last probe's end
    eventually(lambda: probes.claim_due(workers) == ["w1"], timeout_s=5, interval_s=0.05)

    passed = probes.record("w1", 1, None, interval_s=30)
    assert (passed.ok, passed.failures) == (True, 0)  # a pass ends the run of failures
    assert probes.last("w1") == ProbeFacts(True, 0, passed.at, "", 1)


def test_a_version_without_a_probe_is_not_asked_again_but_the_next_version_is(
    state: Settings,
) -> None:
    probes = Probes(state)
    probes.record("w1", 1, "db down", interval_s=30)  # an earlier version had a probe
    probes.no_probe("w1", 2)
    assert probes.last("w1") is None  # its facts no longer judge the code that runs
    client = redis.Redis.from_url(state.redis_url)
    assert client.exists(no_probe_key("w1", 2)) and not client.exists(probe_due_key("w1"))
    assert probes.claim_due({"w1": (2, 30.0)}) == []
    assert probes.claim_due({"w1": (2, 30.0)}) == []
    assert probes.claim_due({"w1": (3, 30.0)}) == ["w1"]


def test_a_worker_not_probed_for_a_run_is_released_at_once(state: Settings) -> None:
    probes = Probes(state)
    assert probes.claim_due({"w1": (1, 60.0)}) == ["w1"]
    probes.release("w1")
    assert probes.claim_due({"w1": (1, 60.0)}) == ["w1"]


def test_the_judgement_reads_the_recorded_probes(state: Settings) -> None:
    probes = Probes(state)
    for _ in range(2):
        probes.record("w1", 1, "db down", interval_s=30)
    probes.record("w2", 1, None, interval_s=30)
    health = WorkerHealth(state)
    verdicts = health.judge_all({"w1": {"max_probe_failures": 2}, "w2": {}, "w3": {}})
    assert {w: (v.health, old) for w, (v, old) in verdicts.items()} == {
        "w1": (UNHEALTHY, UNKNOWN),
        "w2": (HEALTHY, UNKNOWN),
        "w3": (UNKNOWN, UNKNOWN),
    }
    assert verdicts["w1"][0].probe == probes.last("w1")
    assert health.known(["w1", "w2"]) == {"w1": UNHEALTHY, "w2": HEALTHY}


# --- the Python engine -----------------------------------------------------------------------


@pytest.fixture
def engine() -> Iterator[PythonEngine]:
    before = child_pids()
    instance = PythonEngine(Settings())
    yield instance
    instance.close()
    assert child_pids() <= before, "the engine left a child process behind"


def spec() -> WorkerSpec:
    return WorkerSpec(worker_id="w-probe", topic="orders")


def load(engine: PythonEngine, source: str) -> None:
    engine.load(source.encode(), spec())


def test_a_function_worker_s_probe_runs_in_its_sandbox(engine: PythonEngine) -> None:
    load(engine, "def process(event):\n    return None\n\ndef probe():\n    return 1\n")
    pid = engine.pid
    assert engine.probe(timeout_s=5) is True
    assert engine.pid == pid  # the child that serves the messages answers it
    assert engine.process(make_event("orders", "/t"), timeout_s=5) == []


def test_code_without_a_probe_answers_none(engine: PythonEngine) -> None:
    load(engine, "def process(event):\n    return None\n")
    assert engine.probe(timeout_s=5) is None
    load(engine, "probe = 'not callable'\n\ndef process(event):\n    return None\n")
    assert engine.probe(timeout_s=5) is None


def test_a_class_worker_has_a_probe_only_when_it_overrides_the_method(
    engine: PythonEngine,
) -> None:
    base = (
        "from wm.devkit import WorkerBase\n\n"
        "class Checker(WorkerBase):\n"
        "    def __init__(self):\n"
        "        super().__init__('checked', '/w')\n\n"
        "    def process(self, event):\n"
        "        return None\n"
    )
    load(engine, base)
    assert engine.probe(timeout_s=5) is None
    load(engine, base + "\n    def probe(self):\n        return self.source == '/w'\n")
    assert engine.probe(timeout_s=5) is True


@pytest.mark.parametrize(
    ("body", "error", "message"),
    [
        ("raise ConnectionError('orders-db refused')", PythonWorkerError, "orders-db refused"),
        ("return False", WorkerExecutionError, r"probe\(\) returned False"),
        ("pass", WorkerExecutionError, r"probe\(\) returned None, not a true value"),
    ],
)
def test_a_probe_that_raises_or_answers_false_fails_and_says_why(
    engine: PythonEngine, body: str, error: type[Exception], message: str
) -> None:
    load(engine, f"def process(event):\n    return None\n\ndef probe():\n    {body}\n")
    pid = engine.pid
    with pytest.raises(error, match=message):
        engine.probe(timeout_s=5)
    assert engine.pid == pid  # a failed probe is no broken sandbox
    assert engine.process(make_event("orders", "/t"), timeout_s=5) == []


def test_a_probe_past_its_time_limit_is_killed_like_a_message(engine: PythonEngine) -> None:
    load(
        engine,
        "import time\n\ndef process(event):\n    return None\n\ndef probe():\n    time.sleep(60)\n",
    )
    pid = engine.pid
    assert pid is not None
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"probe .* did not finish within 0\.5 s"):
        engine.probe(timeout_s=0.5)
    assert time.monotonic() - started < 3
    assert not os.path.exists(f"/proc/{pid}")
    assert engine.process(make_event("orders", "/t"), timeout_s=5) == []  # a fresh sandbox
    assert engine.pid not in (None, pid)


def test_a_probe_that_exits_ends_its_sandbox_and_the_next_call_starts_another(
    engine: PythonEngine,
) -> None:
    load(engine, "def process(event):\n    return None\n\ndef probe():\n    raise SystemExit(3)\n")
    pid = engine.pid
    with pytest.raises(PythonWorkerError, match="SystemExit"):
        engine.probe(timeout_s=5)
    assert engine.pid is None
    assert pid is not None and not os.path.exists(f"/proc/{pid}")
    assert engine.process(make_event("orders", "/t"), timeout_s=5) == []


# --- real nodes ------------------------------------------------------------------------------

FAILING = (
    "def process(event):\n    return None\n\n"
    "def probe():\n    raise ConnectionError('orders-db refused the connection')\n"
)
PASSING = "def process(event):\n    return None\n\ndef probe():\n    return True\n"
NO_PROBE = "def process(event):\n    return None\n"


def test_a_failing_probe_makes_a_worker_unhealthy_until_its_code_passes_it(
    pg_settings: Settings, start_node: Any
) -> None:
    settings = pg_settings.replace(reconcile_interval_s=1.0, health_port=free_port())
    manager = WorkManager(settings)
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "health")
    probed = manager.create_worker(
        code=FAILING,
        mime_type=PYTHON,
        topic="pr.in",
        name="probed",
        # degrade: it stays running, paused while unhealthy (remove would take it out)
        settings={"probe_interval_s": 1, "max_probe_failures": 3, "recovery_on_health": "degrade"},
    )
    quiet = manager.create_worker(
        code=NO_PROBE, mime_type=PYTHON, topic="pr.quiet", settings={"probe_interval_s": 1}
    )
    node = start_node(settings)
    node.consuming(f"pr.in::{probed.id}")
    probes = Probes(settings)

    eventually(lambda: manager.get_worker("probed").health == UNHEALTHY, timeout_s=60)
    assert manager.get_worker("probed").status == "running"  # health is no status
    facts = probes.last(str(probed.id))
    assert facts is not None and facts.failures >= 3
    assert "orders-db refused the connection" in facts.error
    shown = wm_cli(settings, "worker", "show", str(probed.id))
    assert shown["health"] == UNHEALTHY
    samples = scrape(f"http://127.0.0.1:{settings.health_port}/metrics")
    labels = (("tenant", "default"), ("worker", "probed"), ("worker_id", str(probed.id)))
    assert samples[("wm_probe_failed_total", labels)] >= 3
    assert samples.get(("wm_probe_passed_total", labels), 0) == 0
    # each probe's run is timed (the time observed before the result is counted)
    probed_n = samples[("wm_probe_failed_total", labels)]
    assert probed_n <= samples[("wm_probe_seconds_count", labels)] <= probed_n + 1
    assert samples[("wm_probe_seconds_sum", labels)] > 0
    assert samples[("wm_workers_health", (("health", UNHEALTHY),))] >= 1

    # the worker without a probe was asked once, three periods ago or more, never again
    client = redis.Redis.from_url(settings.redis_url)
    assert client.exists(no_probe_key(str(quiet.id), 1))
    assert node.log.read_text().count(f"worker {quiet.id} v1 has no probe") == 1
    assert probes.last(str(quiet.id)) is None
    assert manager.get_worker(quiet.id).health == UNKNOWN

    manager.load_code_from_content(probed.id, PASSING)
    eventually(lambda: manager.get_worker("probed").health == HEALTHY, timeout_s=60)
    facts = probes.last(str(probed.id))
    assert facts is not None and (facts.ok, facts.failures, facts.version) == (True, 0, 2)

    changes = [
        e["data"]
        for e in drain(settings, lifecycle, 50, timeout_s=2)
        if e["type"].endswith(".health_changed") and e["subject"] == str(probed.id)
    ]
    moves = [(c["from_health"], c["to_health"]) for c in changes]
    assert moves[0][0] == UNKNOWN and moves[-1] == (UNHEALTHY, HEALTHY), moves
    assert {to for _, to in moves[:-1]} <= {DEGRADED, UNHEALTHY}, moves
    sick = next(c for c in changes if c["to_health"] == UNHEALTHY)
    assert sick["probe_ok"] is False and sick["probe_failures"] >= 3
    assert "orders-db refused the connection" in sick["probe_error"]
    assert f"its probe failed {sick['probe_failures']} times in a row" in sick["reason"]
    assert changes[-1]["probe_ok"] is True and changes[-1]["probe_version"] == 2
    assert node.log.read_text().count(f"worker {quiet.id} v1 has no probe") == 1


def test_a_worker_that_does_not_run_is_not_probed(pg_settings: Settings, start_node: Any) -> None:
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(settings)
    worker = manager.create_worker(
        code=FAILING, mime_type=PYTHON, topic="pr.off", settings={"probe_interval_s": 1}
    )
    manager.stop_worker(worker.id)
    witness = manager.create_worker(
        code=FAILING,
        mime_type=PYTHON,
        topic="pr.on",
        settings={"probe_interval_s": 1, "recovery_on_health": "degrade"},
    )
    start_node(settings)
    probes = Probes(settings)
    eventually(lambda: (probes.last(str(witness.id)) or failed(0)).failures >= 3, timeout_s=60)
    assert probes.last(str(worker.id)) is None
    assert manager.get_worker(worker.id).health == UNKNOWN
