"""Supervision with real nodes: the circuit breaker (running → pending → starting → running),
suspend/resume (the queue accumulates while suspended and drains after), stop with a grace
period (stopping → stopped, or killed and delivered again)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import STUB, drain, eventually, stub
from wm import Settings, WorkManager
from wm.control.deadletters import DeadLetters
from wm.errors import InvalidArgument
from wm.events import LIFECYCLE_TOPIC, make_event
from wm.state.health import judge

#: Trips after 3 failed attempts in a row; retries never run out during the test.
BREAKER = {
    "failure_threshold": 3,
    "max_retries": 50,
    "retry_base_delay_ms": 50,
    "breaker_base_delay_s": 1,
    "breaker_max_delay_s": 2,
}


def _pending_reasons(manager: WorkManager, worker_id: Any) -> list[str]:
    return [
        t.reason
        for t in manager.get_worker_transitions(worker_id)
        if t.to_status == "pending" and t.actor == "breaker"
    ]


def test_a_failing_worker_pauses_itself_parks_nothing_and_recovers_once_fixed(
    pg_settings: Settings, start_node: Any
) -> None:
    manager = WorkManager(pg_settings)
    out = manager.subscribe("sup.done", "out")
    worker = manager.create_worker(
        code=stub(fail="boom"), mime_type=STUB, topic="sup.in", settings=BREAKER
    )
    node = start_node(pg_settings)
    node.consuming(f"sup.in::{worker.id}")
    for n in range(5):
        manager.publish(make_event("sup.in", "/t", {"n": n}))

    # opened within the threshold, then half-open after 1 s and open again for 2 s (doubled)
    eventually(lambda: len(_pending_reasons(manager, worker.id)) >= 2, timeout_s=30)
    first, second = _pending_reasons(manager, worker.id)[:2]
    assert "after 3 consecutive failed deliveries" in first and "boom" in first
    assert first.endswith("trying again in 1 s") and second.endswith("trying again in 2 s")
    moves = [
        (t.from_status, t.to_status, t.actor) for t in manager.get_worker_transitions(worker.id)
    ]
    assert moves[3:7] == [
        ("running", "pending", "breaker"),
        ("pending", "starting", "breaker"),
        ("starting", "running", "breaker"),
        ("running", "pending", "breaker"),
    ]
    pending = [t for t in manager.get_worker_transitions(worker.id) if t.from_status == "pending"]
    assert pending[0].duration_ms is not None and pending[0].duration_ms >= 900
    assert DeadLetters(pg_settings).list(include_replayed=True) == []

    # fixed: the next half-open delivery succeeds, the breaker closes, every event arrives
    manager.load_code_from_content(worker.id, stub(output_type="sup.done"))
    outputs = drain(pg_settings, out, 5, timeout_s=30)
    assert sorted(e["data"]["input"]["n"] for e in outputs) == [0, 1, 2, 3, 4]
    assert manager.get_worker(worker.id).status == "running"
    assert DeadLetters(pg_settings).list(include_replayed=True) == []


def test_a_suspended_worker_keeps_its_queue_and_drains_it_after_resume(
    pg_settings: Settings, start_node: Any
) -> None:
    manager = WorkManager(pg_settings)
    out = manager.subscribe("sus.done", "out")
    worker = manager.create_worker(
        code=stub(output_type="sus.done"), mime_type=STUB, topic="sus.in", name="sus"
    )
    queue = f"sus.in::{worker.id}"
    node = start_node(pg_settings)
    node.consuming(queue)
    manager.publish(make_event("sus.in", "/t", {"n": 0}))
    assert len(drain(pg_settings, out, 1)) == 1

    manager.suspend_worker("sus")
    node.wait_for(f"Canceling queue {queue}")  # consumers cancelled on every node
    for n in range(1, 21):
        manager.publish(make_event("sus.in", "/t", {"n": n}))
    depth = {s["queue"]: s["depth"] for s in manager.list_subscriptions("sus.in")}
    assert depth[queue] == 20
    assert drain(pg_settings, out, 1, timeout_s=2) == []  # nothing consumed while suspended

    manager.resume_worker("sus")
    outputs = drain(pg_settings, out, 20, timeout_s=30)
    assert sorted(e["data"]["input"]["n"] for e in outputs) == list(range(1, 21))
    eventually(lambda: manager.list_subscriptions("sus.in")[0]["depth"] == 0)


def test_a_worker_with_max_events_finishes_after_exactly_that_many(
    pg_settings: Settings, start_node: Any
) -> None:
    manager = WorkManager(pg_settings)
    out = manager.subscribe("quota.done", "out")
    worker = manager.create_worker(
        code=stub(output_type="quota.done", sleep_ms=50),
        mime_type=STUB,
        topic="quota.in",
        settings={"max_events": 3},
    )
    queue = f"quota.in::{worker.id}"
    node = start_node(pg_settings, concurrency=4)  # deliveries race for the last slots
    node.consuming(queue)
    for n in range(8):
        manager.publish(make_event("quota.in", "/t", {"n": n}))
    eventually(lambda: manager.get_worker(worker.id).status == "finished", timeout_s=30)
    assert len(drain(pg_settings, out, 8, timeout_s=3)) == 3
    last = manager.get_worker_transitions(worker.id)[-1]
    assert (last.from_status, last.to_status, last.actor) == ("running", "finished", "node")
    assert last.reason == "finished: processed its max_events (3)"
    eventually(lambda: manager.list_subscriptions("quota.in")[0]["depth"] == 5)

    manager.start_worker(worker.id)  # a fresh quota: three more, then finished again
    assert len(drain(pg_settings, out, 3, timeout_s=30)) == 3
    eventually(lambda: manager.get_worker(worker.id).status == "finished", timeout_s=30)
    assert drain(pg_settings, out, 1, timeout_s=2) == []
    assert manager.list_subscriptions("quota.in")[0]["depth"] == 2


def test_max_concurrency_caps_a_workers_runs_across_nodes(
    pg_settings: Settings, start_node: Any
) -> None:
    """Two nodes of two processes each could run four at once; the worker allows two."""
    manager = WorkManager(pg_settings)
    out = manager.subscribe("cap.done", "out")
    worker = manager.create_worker(
        code=stub(output_type="cap.done", sleep_ms=300),
        mime_type=STUB,
        topic="cap.in",
        settings={"max_concurrency": 2},
    )
    nodes = [start_node(pg_settings, name=f"n{i}") for i in range(2)]
    for node in nodes:
        node.consuming(f"cap.in::{worker.id}")
    for n in range(8):
        manager.publish(make_event("cap.in", "/t", {"n": n}))
    runs = [(e["data"]["started_at"], e["data"]["finished_at"]) for e in drain(pg_settings, out, 8)]
    assert len(runs) == 8
    edges = sorted([(start, 1) for start, _ in runs] + [(end, -1) for _, end in runs])
    running, most = 0, 0
    for _, step in edges:  # an end sorts before a start at the same instant
        running += step
        most = max(most, running)
    assert most == 2, runs
    assert DeadLetters(pg_settings).list() == []  # waiting for a slot is no failure


@pytest.mark.parametrize(
    ("ok", "failed", "in_a_row", "settings", "health"),
    [
        (0, 0, 0, {}, "unknown"),
        (100, 0, 0, {}, "healthy"),
        (96, 4, 0, {}, "healthy"),
        (90, 10, 1, {}, "degraded"),
        (50, 50, 0, {}, "unhealthy"),
        (97, 3, 3, {}, "unhealthy"),  # three in a row, whatever the rate
        (90, 10, 1, {"health_degraded_rate": 0.2}, "healthy"),
        (97, 3, 3, {"health_max_consecutive_failures": 0}, "healthy"),
        # fewer than health_min_deliveries (10): the rate makes it degraded at most
        (0, 1, 1, {}, "degraded"),
        (4, 5, 1, {}, "degraded"),
        (5, 5, 1, {}, "unhealthy"),
        (0, 3, 3, {}, "unhealthy"),  # failures in a row count however few
        (0, 1, 1, {"health_min_deliveries": 0}, "unhealthy"),
        (1, 1, 1, {"health_min_deliveries": 2}, "unhealthy"),
    ],
)
def test_health_is_judged_from_the_error_rate_and_failures_in_a_row(
    ok: int, failed: int, in_a_row: int, settings: dict[str, Any], health: str
) -> None:
    assert judge(ok, failed, in_a_row, settings).health == health


def test_health_follows_real_deliveries_and_its_changes_are_lifecycle_events(
    pg_settings: Settings, start_node: Any
) -> None:
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(settings)
    events = manager.subscribe(LIFECYCLE_TOPIC, "health")
    worker = manager.create_worker(
        code=stub(),
        mime_type=STUB,
        topic="hl.in",
        name="hl",
        settings={"max_retries": 0, "failure_threshold": 0},  # the breaker stays out of it
    )
    node = start_node(settings)
    node.consuming(f"hl.in::{worker.id}")
    for n in range(5):
        manager.publish(make_event("hl.in", "/t", {"n": n}))
    eventually(lambda: manager.get_worker("hl").health == "healthy", timeout_s=30)
    manager.load_code_from_content(worker.id, stub(fail="broken"))
    for n in range(3):
        manager.publish(make_event("hl.in", "/t", {"n": n}))
    eventually(lambda: manager.get_worker("hl").health == "unhealthy", timeout_s=30)
    assert manager.get_worker("hl").status == "running"  # health is no status

    def changes() -> list[tuple[str, str]]:
        found = drain(settings, events, 20, timeout_s=2)
        return [
            (e["data"]["from_health"], e["data"]["to_health"])
            for e in found
            if e["type"].endswith(".health_changed")
        ]

    assert changes() == [("unknown", "healthy"), ("healthy", "unhealthy")]


def _runs(trace: Path) -> list[str]:
    """Event ids whose execution began, in order (the stub's trace file)."""
    if not trace.exists():
        return []
    return [json.loads(line)["event_id"] for line in trace.read_text().splitlines()]


@pytest.mark.parametrize("engine", ["python", "in-process"])
def test_a_worker_ignoring_stop_is_killed_after_the_grace_period_and_runs_its_event_again(
    pg_settings: Settings, start_node: Any, tmp_path: Path, engine: str
) -> None:
    """A sandboxed worker's child is killed; in-process code (the stub) takes its pool
    process with it, which the node replaces. Either way the event runs again on start."""
    manager = WorkManager(pg_settings)
    out = manager.subscribe("kill.done", "out")
    trace = tmp_path / "runs.jsonl"
    if engine == "python":
        mime, hang = (
            "text/x-python",
            "import time\nfrom wm.devkit import current_runtime\n\n"
            "def process(event):\n"
            "    current_runtime().log('warning', 'began ' + event.get_id())\n"
            "    time.sleep(60)\n",
        )
        fixed = (
            "from wm.devkit import make_event\n\n"
            "def process(event):\n    return make_event('kill.done', '/t', event.get_data())\n"
        )
    else:
        mime, hang = STUB, stub(output_type="kill.done", sleep_ms=60_000, trace=str(trace))
        fixed = stub(output_type="kill.done", trace=str(trace))
    worker = manager.create_worker(
        code=hang, mime_type=mime, topic="kill.in", settings={"timeout_s": 120, "stop_grace_s": 1}
    )
    node = start_node(pg_settings)
    node.consuming(f"kill.in::{worker.id}")
    event = make_event("kill.in", "/t", {"n": 7})
    manager.publish(event)
    # running (not only received): the sandbox loaded, or the stub's trace begun
    if engine == "python":
        node.wait_for(f"began {event.get_id()}")
    else:
        eventually(lambda: _runs(trace) == [event.get_id()])

    began = time.monotonic()
    stopped = manager.stop_worker(worker.id)
    assert stopped.status == "killed"
    assert time.monotonic() - began < 15  # 1 s of grace, not the 60 s the code sleeps
    last = manager.get_worker_transitions(worker.id)[-1]
    assert (last.from_status, last.to_status, last.actor) == ("stopping", "killed", "api")
    assert "1 deliveries still ran after the grace period of 1 s" in last.reason
    assert DeadLetters(pg_settings).list(include_replayed=True) == []

    manager.load_code_from_content(worker.id, fixed)
    manager.start_worker(worker.id)
    [output] = drain(pg_settings, out, 1)
    data = output["data"]
    assert (data if engine == "python" else data["input"]) == {"n": 7}
    if engine != "python":
        assert _runs(trace) == [event.get_id(), event.get_id()]  # begun, killed, run again
    assert DeadLetters(pg_settings).list(include_replayed=True) == []


def test_stop_waits_for_deliveries_in_flight_then_stops_and_unloads(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    manager = WorkManager(pg_settings)
    out = manager.subscribe("grace.done", "out")
    trace = tmp_path / "runs.jsonl"
    worker = manager.create_worker(
        code=stub(output_type="grace.done", sleep_ms=2000, trace=str(trace)),
        mime_type=STUB,
        topic="grace.in",
        settings={"stop_grace_s": 30},
    )
    node = start_node(pg_settings)
    node.consuming(f"grace.in::{worker.id}")
    manager.publish(make_event("grace.in", "/t", {"n": 1}))
    eventually(lambda: len(_runs(trace)) == 1)  # running, not only received
    assert manager.stop_worker(worker.id).status == "stopped"  # after the delivery finished
    assert len(drain(pg_settings, out, 1, timeout_s=1)) == 1
    node.wait_for(f"unloaded worker {worker.id}")
    assert manager.stop_worker(worker.id).status == "stopped"  # idempotent
    with pytest.raises(InvalidArgument, match="grace period must be"):
        manager.stop_worker(worker.id, grace_s=-1)


def test_recovery_stop_stops_a_failing_worker_and_keeps_its_event(
    pg_settings: Settings, start_node: Any
) -> None:
    manager = WorkManager(pg_settings)
    out = manager.subscribe("rs.done", "out")
    worker = manager.create_worker(
        code=stub(fail="boom"),
        mime_type=STUB,
        topic="rs.in",
        settings={**BREAKER, "failure_threshold": 2, "recovery": "stop"},
    )
    node = start_node(pg_settings)
    node.consuming(f"rs.in::{worker.id}")
    manager.publish(make_event("rs.in", "/t", {"n": 1}))
    eventually(lambda: manager.get_worker(worker.id).status == "stopped", timeout_s=30)
    last = manager.get_worker_transitions(worker.id)[-1]
    assert (last.from_status, last.to_status, last.actor) == ("running", "stopped", "breaker")
    assert "recovery 'stop' after 2 consecutive failed deliveries" in last.reason
    assert "boom" in last.reason
    assert DeadLetters(pg_settings).list(include_replayed=True) == []

    manager.load_code_from_content(worker.id, stub(output_type="rs.done"))
    manager.start_worker(worker.id)
    assert [e["data"]["input"] for e in drain(pg_settings, out, 1)] == [{"n": 1}]


@pytest.mark.parametrize("how", ["degrade", "replace"])
def test_recovery_degrade_and_replace_go_on_consuming(
    pg_settings: Settings, start_node: Any, how: str
) -> None:
    """No pause: the failing events are dead-lettered as usual, the rest delivered; the
    strategy is announced once per run of failures (replace also reloads the engine)."""
    manager = WorkManager(pg_settings)
    out = manager.subscribe("rd.done", "out")
    events = manager.subscribe(LIFECYCLE_TOPIC, "life")
    worker = manager.create_worker(
        code=stub(output_type="rd.done", fail="bad input", fail_if_data_has="bad"),
        mime_type=STUB,
        topic="rd.in",
        settings={"failure_threshold": 2, "max_retries": 0, "recovery": how},
    )
    node = start_node(pg_settings)
    node.consuming(f"rd.in::{worker.id}")
    for n in range(4):
        manager.publish(make_event("rd.in", "/t", {"n": n, "bad": True}))
    eventually(lambda: len(DeadLetters(pg_settings).list()) == 4, timeout_s=30)
    manager.publish(make_event("rd.in", "/t", {"n": 9}))
    assert [e["data"]["input"] for e in drain(pg_settings, out, 1)] == [{"n": 9}]
    assert manager.get_worker(worker.id).status == "running"
    recovery = [
        e["data"]
        for e in drain(pg_settings, events, 30, timeout_s=2)
        if e["type"].endswith(".recovery")
    ]
    assert len(recovery) == 1  # once per run of failures: 4 failures, threshold 2
    assert recovery[0]["strategy"] == how and "bad input" in recovery[0]["last_error"]
    if how == "replace":
        node.wait_for(f"unloaded worker {worker.id}")


#: The delayed starts' delay, in seconds.
DELAY_S = 4


def test_a_delayed_start_waits_pending_then_runs_and_a_stop_cancels_it(
    pg_settings: Settings, start_node: Any
) -> None:
    manager = WorkManager(pg_settings)
    out = manager.subscribe("ds.done", "out")
    worker = manager.create_worker(
        code=stub(output_type="ds.done"), mime_type=STUB, topic="ds.in", start=False
    )
    other = manager.create_worker(code=stub(), mime_type=STUB, topic="ds.other", start=False)
    node = start_node(pg_settings)
    with pytest.raises(InvalidArgument, match="start delay must be a positive number"):
        manager.start_worker(worker.id, delay_s=0)

    # the stop right after the start, and a delay a loaded machine cannot use up before
    # the check that nothing ran early: neither check depends on how fast the machine is
    asked = time.monotonic()
    assert manager.start_worker(worker.id, delay_s=DELAY_S).status == "pending"
    assert manager.start_worker(other.id, delay_s=DELAY_S).status == "pending"
    assert manager.stop_worker(other.id).status == "stopped"  # cancels that one's wait
    manager.publish(make_event("ds.in", "/t", {"n": 1}))
    assert drain(pg_settings, out, 1, timeout_s=1) == []  # not before its time
    assert time.monotonic() - asked < DELAY_S, "the machine was too slow to tell"

    node.consuming(f"ds.in::{worker.id}")
    assert [e["data"]["input"] for e in drain(pg_settings, out, 1)] == [{"n": 1}]
    moves = [
        (t.from_status, t.to_status, t.actor, t.reason)
        for t in manager.get_worker_transitions(worker.id)
    ]
    assert moves[1:] == [
        ("created", "pending", "api", f"start requested in {DELAY_S} s"),
        ("pending", "starting", "api", "its delayed start came"),
        ("starting", "running", "api", "started"),
    ]
    time.sleep(max(0.0, asked + DELAY_S + 1 - time.monotonic()))
    assert manager.get_worker(other.id).status == "stopped"  # its start came and did nothing


def test_a_worker_whose_code_says_it_is_done_finishes(
    pg_settings: Settings, start_node: Any
) -> None:
    manager = WorkManager(pg_settings)
    out = manager.subscribe("dn.done", "out")
    code = (
        "from wm.devkit import done, make_event\n\n"
        "def process(event):\n"
        "    if event.get_data().get('last'):\n"
        "        done('saw the last one')\n"
        "    return make_event('dn.done', '/t', event.get_data())\n"
    )
    worker = manager.create_worker(code=code, mime_type="text/x-python", topic="dn.in")
    node = start_node(pg_settings)
    node.consuming(f"dn.in::{worker.id}")
    manager.publish(make_event("dn.in", "/t", {"n": 1}))
    manager.publish(make_event("dn.in", "/t", {"n": 2, "last": True}))
    assert sorted(e["data"]["n"] for e in drain(pg_settings, out, 2)) == [1, 2]
    eventually(lambda: manager.get_worker(worker.id).status == "finished")
    last = manager.get_worker_transitions(worker.id)[-1]
    assert (last.from_status, last.to_status, last.actor) == ("running", "finished", "node")
    assert last.reason == "finished: its code said it is done (saw the last one)"

    manager.publish(make_event("dn.in", "/t", {"n": 3}))
    assert drain(pg_settings, out, 1, timeout_s=2) == []  # finished: it waits in the queue
    manager.start_worker(worker.id)
    assert [e["data"]["n"] for e in drain(pg_settings, out, 1)] == [3]
