"""The worker lifecycle through the Python API, on SQLite and on PostgreSQL."""

from __future__ import annotations

import time
import types
import uuid

import pytest

from tests.helpers import STUB, drain, queue_empty, stub
from wm import (
    AmbiguousReference,
    EngineNotFound,
    IllegalTransition,
    InvalidArgument,
    InvalidCode,
    VersionNotFound,
    WorkerNotFound,
    WorkManager,
)
from wm.events import LIFECYCLE_TOPIC, LIFECYCLE_TYPE_PREFIX
from wm.lifecycle import Status
from wm.state import quota
from wm.state.connection import redis_for
from wm.state.directory import GENERATION_TTL_S
from wm.state.health import (
    VERDICT_TTL_S,
    Tally,
    WorkerHealth,
    counts_key,
    since_key,
    state_key,
)
from wm.store import records


def test_full_lifecycle_is_recorded_and_published(manager: WorkManager) -> None:
    queue = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(
        code=stub(output_type="done"),
        mime_type=STUB,
        topic="orders",
        group="g1",
        name="orders-worker",
    )
    assert worker.status == "running" and worker.current_version == 1
    manager.load_code_from_content(worker.id, stub(), note="no output")
    manager.rollback_worker("orders-worker", 1)
    manager.stop_worker(worker.id)
    manager.stop_worker(worker.id)  # idempotent: no transition, no event
    manager.start_worker(worker.id)
    manager.start_worker(worker.id)
    manager.delete_worker(worker.id)

    events = drain(manager.settings, queue, 10, 5)
    # Published synchronously after each commit: anything extra would be queued already.
    assert queue_empty(manager.settings, queue, 0.5)
    kinds = [e["type"].removeprefix(LIFECYCLE_TYPE_PREFIX) for e in events]
    assert kinds == [
        "created",
        "starting",
        "started",
        "code_updated",
        "code_updated",
        "stopping",
        "stopped",
        "starting",
        "started",
        "deleted",
    ]
    # every state entered is told once, in the order of the transitions
    entered = [e["data"]["to_state"] for e in events if not e["type"].endswith("code_updated")]
    rows = manager.get_worker_transitions(worker.id)
    assert entered == [t.to_status for t in rows if t.from_status != t.to_status]
    transitions = [(t.from_status, t.to_status) for t in manager.get_worker_transitions(worker.id)]
    assert transitions == [
        (None, "created"),
        ("created", "starting"),
        ("starting", "running"),
        ("running", "running"),
        ("running", "running"),
        ("running", "stopping"),
        ("stopping", "stopped"),
        ("stopped", "starting"),
        ("starting", "running"),
        ("running", "deleted"),
    ]
    # delete keeps versions and transitions for audit
    assert [v.version for v in manager.get_worker_history(worker.id)] == [1, 2]
    assert manager.get_worker(worker.id).status == "deleted"


def test_lifecycle_event_payload(manager: WorkManager) -> None:
    queue = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t", group="g", start=False)
    [created] = drain(manager.settings, queue, 1, 5)
    assert created["subject"] == str(worker.id)
    assert created["source"] == "/workmanager"
    assert created["data"]["worker_id"] == str(worker.id)
    assert created["data"]["group"] == "g" and created["data"]["topic"] == "t"
    assert created["data"]["to_state"] == "created" and created["data"]["version"] == 1


def test_history_and_rollback(manager: WorkManager) -> None:
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t")
    for n in range(3):
        manager.load_code_from_content(worker.id, stub(outputs=n + 1))
    history = manager.get_worker_history(worker.id)
    assert [v.version for v in history] == [1, 2, 3, 4]
    assert all(v.source_kind == "inline" and len(v.sha256) == 64 for v in history)
    assert history[0].created_at <= history[-1].created_at
    rolled = manager.rollback_worker(worker.id, 2)
    assert rolled.current_version == 2
    assert manager.get_code(worker.id) == stub(outputs=1)
    assert len(manager.get_worker_history(worker.id)) == 4  # rollback adds no version
    with pytest.raises(VersionNotFound):
        manager.rollback_worker(worker.id, 9)


def test_suspend_and_resume_are_transitions_with_who_and_how_long(manager: WorkManager) -> None:
    queue = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t", name="s")
    started = manager.get_worker(worker.id).started_at
    assert started is not None
    time.sleep(0.05)
    assert manager.suspend_worker("s").status == "suspended"
    assert manager.suspend_worker("s").status == "suspended"  # idempotent
    resumed = manager.resume_worker("s")
    assert resumed.status == "running" and resumed.started_at > started
    manager.suspend_worker("s")
    assert manager.stop_worker("s").status == "stopped"  # suspended → stopping → stopped
    with pytest.raises(
        IllegalTransition, match="from stopped it may go to deleted, pending, starting"
    ):
        manager.suspend_worker("s")
    cli = WorkManager(manager.settings, actor="cli")
    cli.start_worker("s")
    with pytest.raises(InvalidArgument, match="actor 'robot' is unknown"):
        WorkManager(manager.settings, actor="robot")

    rows = manager.get_worker_transitions(worker.id)
    assert [(t.from_status, t.to_status, t.actor) for t in rows] == [
        (None, "created", "api"),
        ("created", "starting", "api"),
        ("starting", "running", "api"),
        ("running", "suspended", "api"),
        ("suspended", "running", "api"),
        ("running", "suspended", "api"),
        ("suspended", "stopping", "api"),
        ("stopping", "stopped", "api"),
        ("stopped", "starting", "cli"),
        ("starting", "running", "cli"),
    ]
    assert rows[0].duration_ms is None  # created from nothing
    assert rows[3].duration_ms is not None and rows[3].duration_ms >= 50  # running ≥ 50 ms
    kinds = [
        e["type"].removeprefix(LIFECYCLE_TYPE_PREFIX) for e in drain(manager.settings, queue, 11, 5)
    ]
    assert kinds == [
        "created",
        "starting",
        "started",
        "suspended",
        "started",
        "suspended",
        "stopping",
        "stopped",
        "starting",
        "started",
    ]


def test_a_start_finishes_a_stop_in_progress_then_starts(manager: WorkManager) -> None:
    """A start racing a stop (or after a stopper that died) finishes the stop, then starts."""
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t")
    records.transaction(  # a stopper that died after moving the worker to ``stopping``
        manager.settings,
        lambda s: records.move(
            s, records.lock_worker(s, worker.id), Status.STOPPING, "stop requested"
        ),
    )
    assert manager.start_worker(worker.id).status == "running"
    moves = [(t.from_status, t.to_status) for t in manager.get_worker_transitions(worker.id)]
    assert moves[-4:] == [
        ("running", "stopping"),
        ("stopping", "stopped"),
        ("stopped", "starting"),
        ("starting", "running"),
    ]


def test_a_deleted_worker_leaves_no_state_without_an_end(manager: WorkManager) -> None:
    """What the maintaining node keeps of a worker's health, its deliveries' counts and its
    count of ``max_events`` go with the delete; its cache generation ends a day after its
    last change, as every worker's does."""
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t")
    manager.start_worker(worker.id)
    wid, redis = str(worker.id), redis_for(manager.settings)
    tally = Tally()
    tally.add(wid, ok=True)
    tally.flush_if_due(manager.settings)  # as a pool process adds its deliveries
    assert 0 < redis.ttl(counts_key(wid)) <= 360  # an end, whoever judges the worker
    WorkerHealth(manager.settings).judge_all({wid: {}})  # as the maintaining node does
    redis.set(since_key(wid), repr(time.time()))  # as a change of verdict writes it
    quota.take(manager.settings, wid, 5)  # as a delivery of a worker with max_events does
    generation = f"wm:worker-generation:{{{wid}}}"
    kept = [state_key(wid), since_key(wid), counts_key(wid), quota.done_key(wid)]
    assert redis.exists(*kept, generation) == 5
    assert 0 < redis.ttl(generation) <= GENERATION_TTL_S
    manager.delete_worker(worker.id)
    assert redis.exists(*kept) == 0
    assert 0 < redis.ttl(generation) <= GENERATION_TTL_S


def test_a_judgement_across_a_delete_leaves_its_verdict_an_end(manager: WorkManager) -> None:
    """Each judgement renews a worker's kept verdict and since when; the maintaining node's
    judgement that read a worker before its delete keeps the verdict again after the
    delete's forget, and that one ends (within a day) instead of staying for ever."""
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t")
    manager.start_worker(worker.id)
    wid, redis = str(worker.id), redis_for(manager.settings)
    health = WorkerHealth(manager.settings)
    tally = Tally()
    tally.add(wid, ok=True)
    tally.flush_if_due(manager.settings)
    assert health.judge_all({wid: {}})[wid][0].health == "healthy"  # a change: since written
    kept = [state_key(wid), since_key(wid)]
    for key in kept:
        assert 0 < redis.ttl(key) <= VERDICT_TTL_S
        redis.expire(key, 60)
    health.judge_all({wid: {}})  # the same verdict: both renewed
    assert all(redis.ttl(key) > 60 for key in kept)
    manager.delete_worker(worker.id)
    assert redis.exists(*kept) == 0
    health.judge_all({wid: {}})  # read the worker before the delete, keeps after it
    assert 0 < redis.ttl(state_key(wid)) <= VERDICT_TTL_S


def test_illegal_transitions_are_refused(manager: WorkManager) -> None:
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t")
    manager.delete_worker(worker.id)
    manager.delete_worker(worker.id)  # deleting twice is harmless
    with pytest.raises(IllegalTransition, match="cannot go from deleted to starting"):
        manager.start_worker(worker.id)
    with pytest.raises(IllegalTransition):
        manager.stop_worker(worker.id)
    with pytest.raises(IllegalTransition, match="deleted"):
        manager.load_code_from_content(worker.id, stub())


def test_creation_validates_before_persisting(manager: WorkManager) -> None:
    with pytest.raises(EngineNotFound, match="application/x-wm-stub"):
        manager.create_worker(code=b"x", mime_type="text/x-cobol", topic="t")
    with pytest.raises(InvalidCode, match="JSON"):
        manager.create_worker(code=b"not json", mime_type=STUB, topic="t")
    with pytest.raises(InvalidArgument, match="unknown worker setting"):
        manager.create_worker(code=stub(), mime_type=STUB, topic="t", settings={"bogus": 1})
    known = (
        "known: batch_size, breaker_base_delay_s, breaker_max_delay_s, failure_threshold, "
        "group_mode, health_degraded_rate, health_max_consecutive_failures, "
        "health_min_deliveries, health_pause_s, health_unhealthy_rate, "
        "idempotency_key, max_concurrency, max_events, max_memory_mb, max_probe_failures, "
        "max_retries, ordering, "
        "ordering_gap_s, output_topics, pause_when_unhealthy, probe_interval_s, recovery, "
        "recovery_on_crash, recovery_on_error, recovery_on_health, recovery_on_timeout, "
        "retry_base_delay_ms, session_idle_s, session_key, stop_grace_s, timeout_s$"
    )
    with pytest.raises(InvalidArgument, match=known):  # the stub engine reads none of its own
        manager.create_worker(code=stub(), mime_type=STUB, topic="t", settings={"memory_mb": 1})
    with pytest.raises(InvalidArgument, match="topic"):
        manager.create_worker(code=stub(), mime_type=STUB, topic=" ")
    assert manager.list_workers() == []
    assert manager.list_workers(status="deleted") == []


def test_bad_code_update_keeps_the_current_version(manager: WorkManager) -> None:
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t")
    with pytest.raises(InvalidCode):
        manager.load_code_from_content(worker.id, b"{not json")
    assert manager.get_worker(worker.id).current_version == 1
    assert len(manager.get_worker_history(worker.id)) == 1


def test_list_filters_and_names(manager: WorkManager) -> None:
    a = manager.create_worker(code=stub(), mime_type=STUB, topic="a", group="g", name="wa")
    b = manager.create_worker(code=stub(), mime_type=STUB, topic="b", start=False)
    assert [w.id for w in manager.list_workers()] == [a.id, b.id]
    assert [w.id for w in manager.list_workers(topic="b")] == [b.id]
    assert [w.id for w in manager.list_workers(group="g")] == [a.id]
    assert [w.id for w in manager.list_workers(status="created")] == [b.id]
    with pytest.raises(InvalidArgument, match="already named"):
        manager.create_worker(code=stub(), mime_type=STUB, topic="a", name="wa")
    manager.delete_worker("wa")
    again = manager.create_worker(code=stub(), mime_type=STUB, topic="a", name="wa")
    assert manager.get_worker("wa").id == again.id
    with pytest.raises(WorkerNotFound):
        manager.get_worker("nobody")


def test_failure_publishes_error_and_fails_worker(manager: WorkManager) -> None:
    queue = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t")
    manager.record_failure(worker.id, "RuntimeError", "boom", fail=True)
    events = drain(manager.settings, queue, 5, 5)
    error = events[3]
    assert error["type"] == LIFECYCLE_TYPE_PREFIX + "error"
    assert error["data"]["error_type"] == "RuntimeError"
    assert error["data"]["error_message"] == "boom"
    assert events[4]["type"] == LIFECYCLE_TYPE_PREFIX + "failed"
    assert manager.get_worker(worker.id).status == "failed"
    assert manager.start_worker(worker.id).status == "running"


def test_engines_declare_their_own_worker_settings(manager: WorkManager) -> None:
    python = "text/x-python"
    code = "def process(event):\n    return None\n"
    with pytest.raises(InvalidArgument, match=r"unknown worker setting 'isolation'.*memory_mb"):
        manager.create_worker(code=code, mime_type=python, topic="t", settings={"isolation": "x"})
    native = "application/x-native-dll"
    with pytest.raises(InvalidArgument, match="'isolation' must be one of in-process, subprocess"):
        manager.create_worker(
            code=b"zip", mime_type=native, topic="t", settings={"isolation": "vm"}
        )
    with pytest.raises(InvalidArgument, match="'api_port' must be a non-negative number"):
        manager.create_worker(code=b"zip", mime_type=native, topic="t", settings={"api_port": "x"})
    worker = manager.create_worker(
        code=code, mime_type=python, topic="t", settings={"memory_mb": 256, "timeout_s": 2.5}
    )
    assert worker.settings == {"memory_mb": 256, "timeout_s": 2.5}
    assert len(manager.list_workers()) == 1


def test_short_ids_name_one_worker_or_list_the_candidates(
    manager: WorkManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = iter(
        [
            uuid.UUID("65d00fc2-0000-4000-8000-000000000001"),
            uuid.UUID("65d00fc2-0000-4000-8000-000000000002"),
            uuid.UUID("7a1d93e4-0000-4000-8000-000000000003"),
        ]
    )
    shim = types.SimpleNamespace(UUID=uuid.UUID, uuid4=lambda: next(ids, None) or uuid.uuid4())
    monkeypatch.setattr("wm.control.lifecycle.uuid", shim)  # the ids of the workers created here
    first = manager.create_worker(code=stub(), mime_type=STUB, topic="t", start=False)
    manager.create_worker(code=stub(), mime_type=STUB, topic="t", start=False)
    third = manager.create_worker(code=stub(), mime_type=STUB, topic="t", start=False)

    assert manager.get_worker("7a1d93").id == third.id  # six characters are enough
    assert manager.get_worker("7A1D93E40000").id == third.id  # any case, hyphens optional
    assert manager.get_worker("7a1d93e4-0000-4").id == third.id
    with pytest.raises(AmbiguousReference, match="worker id '65d00fc2' is ambiguous") as caught:
        manager.get_worker("65d00fc2")
    assert "65d00fc2-0000-4000-8000-000000000001" in str(caught.value)
    assert "65d00fc2-0000-4000-8000-000000000002" in str(caught.value)
    with pytest.raises(WorkerNotFound, match="no worker with id, short id or name '7a1d9'"):
        manager.get_worker("7a1d9")  # five are too few
    manager.delete_worker("7a1d93")
    with pytest.raises(WorkerNotFound):
        manager.get_worker("7a1d93")  # a deleted worker is no live worker
    assert manager.worker_id_of("7a1d93") == str(third.id)  # its dead letters stay reachable

    schedule = manager.add_schedule(first.id, event_type="x", every_s=5)
    manager.remove_schedule(schedule.id[:8])
    assert manager.list_schedules() == []
