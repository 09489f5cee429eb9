"""Infrastructure events (WM_INFRA_EVENTS): node heartbeats and group-lock changes under
``workmanager.infra.*``, from real nodes; nothing on those topics with the default."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from datetime import datetime
from itertools import pairwise
from typing import Any

import pytest

from tests.helpers import STUB, drain, eventually, publish_numbered, stub
from wm import Settings, WorkManager
from wm.dataplane.infra import FOLD_S, Folding
from wm.events import GROUPLOCK_TOPIC, HEARTBEAT_TOPIC, INFRA_TYPE_PREFIX
from wm.state.locks import GroupLocks

#: A quick heartbeat, so that a few arrive within a test's seconds (s).
BEAT_S = 0.5
EVENTS = 40


def test_folding_lets_one_through_per_interval_with_the_count_it_stands_for() -> None:
    now = [0.0]
    folding = Folding(1.0, clock=lambda: now[0])
    assert folding.take("g") == 1
    assert [folding.take("g") for _ in range(5)] == [None] * 5
    assert folding.take("h") == 1  # per key
    now[0] = 0.99
    assert folding.take("g") is None
    now[0] = 1.0
    assert folding.take("g") == 7  # itself and the 6 folded since
    now[0] = 5.0
    assert folding.take("g") == 1


def _fast(settings: Settings, **changes: Any) -> Settings:
    return settings.replace(
        node_heartbeat_s=BEAT_S, node_dead_after_s=4 * BEAT_S, reconcile_interval_s=1.0, **changes
    )


def _grouped(manager: WorkManager, topic: str, **spec: Any) -> Any:
    code = stub(output_type="done", **spec)
    return manager.create_worker(code=code, mime_type=STUB, topic=topic, group="g")


def _at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["time"]).timestamp()


def test_heartbeats_and_folded_lock_events_when_on(pg_settings: Settings, start_node: Any) -> None:
    settings = _fast(pg_settings, infra_events=True)
    manager = WorkManager(settings)
    sink, locks = manager.subscribe("done", "sink"), manager.subscribe(GROUPLOCK_TOPIC, "locks")
    beats = manager.subscribe(HEARTBEAT_TOPIC, "beats")
    worker = _grouped(manager, "t")
    node = start_node(settings, name="n0", concurrency=1)  # one process: exact counts
    node.consuming(f"t::{worker.id}")

    heartbeats = drain(settings, beats, 3, timeout_s=15)
    assert len(heartbeats) == 3
    for beat in heartbeats:
        assert beat["type"] == INFRA_TYPE_PREFIX + "heartbeat"
        assert beat["subject"] == beat["data"]["node"] and beat["subject"].startswith("n0@")
        assert beat["data"]["pid"] == node.proc.pid
        assert beat["data"]["dead_nodes"] == [] and beat["data"]["restored"] == 0
        datetime.fromisoformat(beat["data"]["time"])
    times = [_at(b) for b in heartbeats]
    assert all(b - a >= BEAT_S - 0.05 for a, b in pairwise(times)), times

    publish_numbered(manager, "t", EVENTS)
    assert len(drain(settings, sink, EVENTS, timeout_s=60)) == EVENTS
    time.sleep(FOLD_S)  # the next ones tell what was folded
    publish_numbered(manager, "t", 1)
    assert len(drain(settings, sink, 1, timeout_s=30)) == 1
    changes = drain(settings, locks, 10 * EVENTS, timeout_s=3)
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for change in changes:
        by_kind[change["type"].removeprefix(INFRA_TYPE_PREFIX + "grouplock.")].append(change)
    assert set(by_kind) == {"lock_acquired", "lock_released"}, set(by_kind)
    for kind, told in by_kind.items():
        counts = [c["data"]["count"] for c in told]
        print(f"{kind}: {len(told)} events for {EVENTS} deliveries, counts {counts}")
        assert len(told) < EVENTS and sum(counts) == EVENTS + 1 and min(counts) >= 1
        per_process = defaultdict(list)
        for change in told:
            data = change["data"]
            assert change["subject"] == data["group"] == "g"
            assert data["worker_id"] == str(worker.id) and data["fence"] >= 1
            per_process[data["holder"].split(":")[1]].append(_at(change))
        for at in per_process.values():  # one per FOLD_S per group and process
            assert all(b - a >= FOLD_S - 0.01 for a, b in pairwise(at)), at


def test_nothing_on_the_infra_topics_by_default(pg_settings: Settings, start_node: Any) -> None:
    settings = _fast(pg_settings)
    assert not settings.infra_events
    manager = WorkManager(settings)
    sink, locks = manager.subscribe("done", "sink"), manager.subscribe(GROUPLOCK_TOPIC, "locks")
    beats = manager.subscribe(HEARTBEAT_TOPIC, "beats")
    worker = _grouped(manager, "t")
    start_node(settings, name="n0").consuming(f"t::{worker.id}")
    publish_numbered(manager, "t", 10)
    assert len(drain(settings, sink, 10, timeout_s=60)) == 10
    time.sleep(4 * BEAT_S)
    assert drain(settings, beats, 1, timeout_s=0.5) == []
    assert drain(settings, locks, 1, timeout_s=0.5) == []


@pytest.mark.slow
def test_a_killed_holder_lock_is_told_stolen_by_the_next_holder(
    pg_settings: Settings, start_node: Any
) -> None:
    """kill -9 of the node whose process holds the group lock mid-delivery: the member that
    takes the lock after the lease ran out tells ``lock_stolen``, naming the killed holder,
    and the other node's heartbeat tells it found the killed node dead and put back its
    message."""
    settings = _fast(pg_settings, infra_events=True, group_lock_lease_s=1.0)
    manager = WorkManager(settings)
    sink, locks = manager.subscribe("done", "sink"), manager.subscribe(GROUPLOCK_TOPIC, "locks")
    beats = manager.subscribe(HEARTBEAT_TOPIC, "beats")
    slow, quick = _grouped(manager, "a", sleep_ms=20_000), _grouped(manager, "b")
    nodes = [start_node(settings, name=f"n{i}") for i in range(2)]
    for node in nodes:
        node.consuming(f"a::{slow.id}")
        node.consuming(f"b::{quick.id}")
    publish_numbered(manager, "a", 1)
    holder = eventually(lambda: GroupLocks(settings).holder("g"), timeout_s=30, interval_s=0.01)
    pid = int(holder["owner"].split(":")[1])
    [victim] = [n for n in nodes if n.proc.pid == os.getpgid(pid)]
    victim.kill(signal.SIGKILL)
    publish_numbered(manager, "b", 1)
    assert drain(settings, sink, 1, timeout_s=30)

    def stolen() -> list[dict[str, Any]]:
        told = drain(settings, locks, 100, timeout_s=0.5)
        return [e for e in told if e["type"].endswith(".lock_stolen")]

    [steal] = eventually(stolen, timeout_s=15, interval_s=0)
    data = steal["data"]
    assert data["previous_holder"] == holder["owner"]
    assert data["previous_fence"] == holder["fence"] < data["fence"]
    assert "count" not in data and data["group"] == "g"
    assert data["holder"].split(":")[1] != str(pid)

    def found_dead() -> list[dict[str, Any]]:  # the survivor's heartbeat tells of the victim
        told = drain(settings, beats, 100, timeout_s=0.5)
        return [b for b in told if b["data"]["dead_nodes"]]

    [beat] = eventually(found_dead, timeout_s=15, interval_s=0)
    [dead] = beat["data"]["dead_nodes"]
    assert dead.startswith(f"{victim.name}@") and beat["data"]["restored"] >= 1
    assert not beat["subject"].startswith(f"{victim.name}@")
