"""Health that acts (issue 27, point 2; seed 004): an unhealthy worker's queue is not consumed
until it is healthy again (its events kept, none run, none dead-lettered); at
``max_probe_failures`` its ``recovery_on_health`` strategy runs; a breaker's trip runs the
strategy of the kind of failure that tripped it; every health change moves ``updated_at``.
Real nodes, Redis, PostgreSQL; the stub's ``sick_while`` file makes its probe and its
deliveries fail while it exists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import STUB, drain, eventually, stub, wm_cli
from wm import Settings, WorkManager
from wm.control.deadletters import DeadLetters
from wm.dataplane.features.breaker import failure_kind
from wm.errors import WorkerCrashed, WorkerExecutionError, WorkerTimeout
from wm.events import LIFECYCLE_TOPIC, make_event
from wm.state.health import DEGRADED, UNHEALTHY, UNKNOWN, judge


def _runs(trace: Path) -> list[str]:
    """The event ids whose run began (the stub's trace)."""
    if not trace.exists():
        return []
    return [json.loads(line)["event_id"] for line in trace.read_text().splitlines()]


def _lifecycle(settings: Settings, queue: str, kind: str, worker_id: Any) -> list[dict[str, Any]]:
    return [
        {**e["data"], "reason": e["data"].get("reason")}
        for e in drain(settings, queue, 100, timeout_s=1)
        if e["type"].endswith(f".{kind}") and e["subject"] == str(worker_id)
    ]


def _sick_worker(manager: WorkManager, tmp_path: Path, topic: str, **settings: Any) -> Any:
    sick = tmp_path / "sick"
    sick.touch()
    code = stub(
        output_type=f"{topic}.done", trace=str(tmp_path / "runs.jsonl"), sick_while=str(sick)
    )
    return manager.create_worker(
        code=code, mime_type=STUB, topic=topic, name=topic, settings=settings or None
    )


def _views(settings: Settings, worker_id: Any) -> tuple[Any, ...]:
    """What ``wm worker show``, ``wm worker list`` and ``wm status`` say of its pause."""
    shown = wm_cli(settings, "worker", "show", str(worker_id))
    listed = {w["id"]: w for w in wm_cli(settings, "worker", "list")}
    status = wm_cli(settings, "status")
    paused = status["by_health"]["paused"]
    return shown["health"], shown["paused"], listed[str(worker_id)]["paused"], paused


def test_with_the_defaults_failing_deliveries_pause_the_worker_until_its_probe_passes(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """Every setting at its default: three failed attempts in a row make it unhealthy; the
    judgement (each WM_RECONCILE_INTERVAL_S, 10 s) pauses it before the breaker's fifth;
    what arrives stays queued, unrun and not dead-lettered; its probe (every 30 s) passing
    after the pause began gives it a trial, and everything runs."""
    manager = WorkManager(pg_settings)
    out = manager.subscribe("hd.done", "out")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "life")
    worker = _sick_worker(manager, tmp_path, "hd")
    created = manager.get_worker(worker.id).updated_at
    node = start_node(pg_settings)
    node.consuming(f"hd::{worker.id}")
    first = make_event("hd", "/t", {"n": 0})
    manager.publish(first)
    # paused as soon as judged (or, on a slow machine, after the breaker's fifth failure and
    # its 2 s pause: whichever comes first, the breaker's half-open try finds it paused)
    eventually(lambda: manager.get_worker(worker.id).paused == UNHEALTHY, timeout_s=45)
    info = manager.get_worker(worker.id)
    assert (info.status, info.health) == ("running", UNHEALTHY)  # health is no status
    # the verdict is kept in Redis first, then the change is recorded in the store
    eventually(lambda: manager.get_worker(worker.id).updated_at > created, timeout_s=15)
    node.wait_for(f"Canceling queue hd::{worker.id}", timeout_s=15)
    later = [make_event("hd", "/t", {"n": n}) for n in (1, 2, 3)]
    for event in later:
        manager.publish(event)
    # An attempt admitted just before the verdict was kept may still fail and be the
    # breaker's fifth: then the worker is pending for the breaker's 2 s back-off, and its
    # half-open try finds it paused. The operator's three views agree once that has passed.
    eventually(lambda: _views(pg_settings, worker.id) == (UNHEALTHY, UNHEALTHY, UNHEALTHY, 1))
    assert drain(pg_settings, out, 1, timeout_s=3) == []
    assert not set(_runs(tmp_path / "runs.jsonl")) & {e.get_id() for e in later}
    assert DeadLetters(pg_settings).list(include_replayed=True) == []
    sick = _lifecycle(pg_settings, lifecycle, "health_changed", worker.id)[-1]
    assert sick["to_health"] == UNHEALTHY and sick["consecutive_failures"] >= 3
    # The event says "paused" when the judgement found it running; when the breaker had
    # moved it to pending first, the pause came with the breaker's half-open try instead.
    moves = manager.get_worker_transitions(worker.id)
    breaker_first = any(t.to_status == "pending" for t in moves)
    assert sick["paused"] or breaker_first, sick

    (tmp_path / "sick").unlink()  # the next probe passes: a trial
    done = drain(pg_settings, out, 4, timeout_s=60)
    assert sorted(e["data"]["input"]["n"] for e in done) == [0, 1, 2, 3]
    info = manager.get_worker(worker.id)
    assert (info.status, info.health, info.paused) == ("running", "healthy", None)
    assert DeadLetters(pg_settings).list(include_replayed=True) == []
    well = _lifecycle(pg_settings, lifecycle, "health_changed", worker.id)
    assert (well[0]["from_health"], well[0]["paused"]) == (UNHEALTHY, False)


def test_failed_probes_pause_the_worker_run_its_strategy_and_a_passing_probe_resumes_it(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(settings)
    out = manager.subscribe("hp.done", "out")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "life")
    worker = _sick_worker(manager, tmp_path, "hp", probe_interval_s=1, recovery_on_health="replace")
    node = start_node(settings)
    node.consuming(f"hp::{worker.id}")
    eventually(lambda: manager.get_worker(worker.id).health == UNHEALTHY, timeout_s=30)
    node.wait_for(f"Canceling queue hp::{worker.id}", timeout_s=15)
    events = [make_event("hp", "/t", {"n": n}) for n in range(3)]
    for event in events:
        manager.publish(event)
    assert drain(settings, out, 1, timeout_s=3) == []
    assert _runs(tmp_path / "runs.jsonl") == []  # not even tried: no attempt used
    node.wait_for(f"unloaded worker {worker.id}")  # replace: a fresh engine everywhere
    recovery = _lifecycle(settings, lifecycle, "recovery", worker.id)
    assert len(recovery) == 1, recovery  # once per run of failures
    assert {k: recovery[0][k] for k in ("strategy", "kind", "failures")} == {
        "strategy": "replace",
        "kind": "health",
        "failures": 3,
    }
    assert "the stub is sick" in recovery[0]["last_error"]
    before = manager.get_worker(worker.id).updated_at

    (tmp_path / "sick").unlink()
    done = drain(settings, out, 3, timeout_s=30)
    assert sorted(e["data"]["input"]["n"] for e in done) == [0, 1, 2]
    info = manager.get_worker(worker.id)
    assert (info.status, info.health, info.paused) == ("running", "healthy", None)
    assert info.updated_at > before
    assert DeadLetters(settings).list(include_replayed=True) == []


def test_at_max_probe_failures_the_default_strategy_takes_the_worker_out_of_service(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """``recovery_on_health`` default ``remove``: ``running → failed``, the queue kept."""
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(settings)
    out = manager.subscribe("hr.done", "out")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "life")
    worker = _sick_worker(manager, tmp_path, "hr", probe_interval_s=1)
    node = start_node(settings)
    node.consuming(f"hr::{worker.id}")
    eventually(lambda: manager.get_worker(worker.id).status == "failed", timeout_s=30)
    last = manager.get_worker_transitions(worker.id)[-1]
    assert (last.from_status, last.to_status, last.actor) == ("running", "failed", "health")
    assert "recovery 'remove' after 3 failed probes in a row" in last.reason
    assert "taken out of service" in last.reason
    recovery = _lifecycle(settings, lifecycle, "recovery", worker.id)
    assert [(r["strategy"], r["kind"], r["failures"]) for r in recovery] == [
        ("remove", "health", 3)
    ]
    manager.publish(make_event("hr", "/t", {"n": 7}))
    assert drain(settings, out, 1, timeout_s=2) == []

    (tmp_path / "sick").unlink()
    manager.start_worker(worker.id)
    assert [e["data"]["input"] for e in drain(settings, out, 1)] == [{"n": 7}]
    assert DeadLetters(settings).list(include_replayed=True) == []


def test_a_breaker_trip_runs_the_strategy_of_the_kind_of_failure(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """An error trips it: ``recovery_on_error`` (not ``recovery``) decides; remove keeps the
    failing event queued for the next start."""
    manager = WorkManager(pg_settings)
    out = manager.subscribe("hk.done", "out")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "life")
    worker = _sick_worker(
        manager,
        tmp_path,
        "hk",
        failure_threshold=2,
        recovery="degrade",
        recovery_on_error="remove",
        pause_when_unhealthy=False,
    )
    node = start_node(pg_settings)
    node.consuming(f"hk::{worker.id}")
    manager.publish(make_event("hk", "/t", {"n": 1}))
    eventually(lambda: manager.get_worker(worker.id).status == "failed", timeout_s=30)
    last = manager.get_worker_transitions(worker.id)[-1]
    assert last.actor == "breaker"
    assert "recovery 'remove' after 2 consecutive failed deliveries" in last.reason
    recovery = _lifecycle(pg_settings, lifecycle, "recovery", worker.id)
    assert [(r["strategy"], r["kind"], r["failures"]) for r in recovery] == [("remove", "error", 2)]
    assert DeadLetters(pg_settings).list(include_replayed=True) == []
    (tmp_path / "sick").unlink()
    manager.start_worker(worker.id)
    assert [e["data"]["input"] for e in drain(pg_settings, out, 1)] == [{"n": 1}]


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ({"recovery_on_health": "retry"}, "must be one of remove, degrade, stop, replace"),
        ({"recovery_on_crash": "reboot"}, "must be one of retry, degrade, stop, replace, remove"),
        ({"pause_when_unhealthy": "yes"}, "'pause_when_unhealthy' must be true or false"),
    ],
)
def test_bad_strategy_settings_are_refused_at_create(
    pg_settings: Settings, given: dict[str, Any], error: str
) -> None:
    manager = WorkManager(pg_settings)
    with pytest.raises(Exception, match=error):
        manager.create_worker(code=stub(), mime_type=STUB, topic="hv", settings=given)
    assert manager.list_workers() == []


def test_the_reason_says_when_too_few_attempts_kept_the_rate_from_judging() -> None:
    quiet = judge(0, 1, 1, {})
    assert (quiet.health, quiet.reason) == (
        DEGRADED,
        "100% of 1 attempts failed in the last 5 minutes; 1 failed in a row (under 10 "
        "attempts the rate makes it degraded at most)",
    )
    assert "under" not in judge(0, 3, 3, {}).reason  # unhealthy by its failures in a row
    assert "under" not in judge(5, 5, 1, {}).reason  # enough attempts: the rate judged


def test_failures_in_a_row_count_while_the_window_holds_deliveries() -> None:
    """A paused worker's run of failures ages out with the window: it is tried again."""
    assert judge(0, 3, 3, {}).health == UNHEALTHY
    aged = judge(0, 0, 3, {})
    assert (aged.health, aged.consecutive_failures) == (UNKNOWN, 3)


def test_a_paused_worker_without_a_probe_is_tried_again_after_health_pause_s(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """No probe says when it is well: after ``health_pause_s`` of pause its failures are
    forgotten and it is tried again (not after the 5-minute window)."""
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(settings)
    out = manager.subscribe("hn.done", "out")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "life")
    code = stub(output_type="hn.done", fail="down", fail_runs=3, trace=str(tmp_path / "runs"))
    options = {"health_pause_s": 3, "retry_base_delay_ms": 700}
    worker = manager.create_worker(code=code, mime_type=STUB, topic="hn", settings=options)
    start_node(settings).consuming(f"hn::{worker.id}")
    manager.publish(make_event("hn", "/t", {"n": 0}))
    eventually(lambda: manager.get_worker(worker.id).paused == UNHEALTHY, timeout_s=30)
    [done] = drain(settings, out, 1, timeout_s=30)  # its fourth run, after the trial
    assert done["data"]["input"] == {"n": 0}
    assert manager.get_worker(worker.id).paused is None
    changes = _lifecycle(settings, lifecycle, "health_changed", worker.id)
    assert [(c["from_health"], c["paused"]) for c in changes if c["from_health"] == UNHEALTHY]
    assert DeadLetters(settings).list(include_replayed=True) == []


def test_a_quiet_worker_s_one_failure_degrades_it_and_its_retry_is_not_held_back(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """Every health setting at its default (``health_min_deliveries`` 10): a worker whose one
    delivery in the window failed is degraded, not paused, and its retry runs after its
    backoff, not after ``health_pause_s`` (30 s). Judged each second, and the retry waits
    2-4 s: the verdict is taken inside the wait (seen to fail with a minimum of 1)."""
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(settings)
    out = manager.subscribe("hq.done", "out")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "life")
    code = stub(output_type="hq.done", fail="flaky", fail_runs=1, trace=str(tmp_path / "runs"))
    options = {"retry_base_delay_ms": 4000}
    worker = manager.create_worker(code=code, mime_type=STUB, topic="hq", settings=options)
    start_node(settings).consuming(f"hq::{worker.id}")
    manager.publish(make_event("hq", "/t", {"n": 0}))
    eventually(lambda: manager.get_worker(worker.id).health == DEGRADED, timeout_s=15)
    [done] = drain(settings, out, 1, timeout_s=15)  # its second run
    assert done["data"]["input"] == {"n": 0}
    info = manager.get_worker(worker.id)
    assert (info.health, info.paused) == (DEGRADED, None)  # one failure in two deliveries
    changes = _lifecycle(settings, lifecycle, "health_changed", worker.id)
    assert [(c["from_health"], c["to_health"], c["paused"]) for c in changes] == [
        (UNKNOWN, DEGRADED, False)
    ]
    assert DeadLetters(settings).list(include_replayed=True) == []


def test_the_kind_of_a_failed_delivery_is_seed_004_s() -> None:
    assert failure_kind(WorkerCrashed("its process died")) == "crash"
    assert failure_kind(WorkerExecutionError("sandbox died", process_exited=True)) == "crash"
    assert failure_kind(WorkerTimeout("past 30 s")) == "timeout"
    assert failure_kind(WorkerExecutionError("boom")) == "error"
    assert failure_kind(ValueError("bad input")) == "error"


def test_a_sandbox_that_dies_trips_the_breaker_into_the_crash_kind_s_default_replace(
    pg_settings: Settings, start_node: Any
) -> None:
    """``recovery_on_crash`` unset, ``recovery`` unset: seed 004's process exit → replace."""
    manager = WorkManager(pg_settings)
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "life")
    worker = manager.create_worker(
        code="def process(event):\n    while True:\n        pass\n",  # killed at its CPU limit
        mime_type="text/x-python",
        topic="hc",
        settings={
            "failure_threshold": 2,
            "max_retries": 0,
            "pause_when_unhealthy": False,
            "cpu_limit_s": 1,
        },
    )
    node = start_node(pg_settings)
    node.consuming(f"hc::{worker.id}")
    for n in range(2):
        manager.publish(make_event("hc", "/t", {"n": n}))
    node.wait_for(f"unloaded worker {worker.id}", timeout_s=30)
    recovery = _lifecycle(pg_settings, lifecycle, "recovery", worker.id)
    assert [(r["strategy"], r["kind"], r["failures"]) for r in recovery] == [
        ("replace", "crash", 2)
    ]
    assert "sandbox process" in recovery[0]["last_error"]
    assert manager.get_worker(worker.id).status == "running"  # replace goes on consuming
    eventually(lambda: len(DeadLetters(pg_settings).list()) == 2)  # no retries: parked
