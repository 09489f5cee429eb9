"""Supervision with real nodes: the circuit breaker (running → pending → starting → running),
and suspend/resume (the queue accumulates while suspended and drains after)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import STUB, drain, eventually, stub
from wm import Settings, WorkManager
from wm.dataplane.deadletters import DeadLetters
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
