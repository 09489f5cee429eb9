"""Supervision with real nodes: the circuit breaker (running → pending → starting → running),
and suspend/resume (the queue accumulates while suspended and drains after)."""

from __future__ import annotations

from typing import Any

from tests.helpers import STUB, drain, eventually, stub
from wm import Settings, WorkManager
from wm.dataplane.deadletters import DeadLetters
from wm.events import make_event

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
