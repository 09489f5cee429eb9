"""Batched deliveries (``batch_size``) with real nodes: each event keeps its own guarantees
— outputs exactly once, retries and dead letters of the failing event alone, fencing of a
group, order per key, nothing lost when the node is killed mid-batch."""

from __future__ import annotations

import itertools
import json
import random
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import STUB, drain, eventually, publish_numbered, queue_empty, stub
from tests.test_guarantees import kill_9_mid_stream
from wm import Settings, WorkManager
from wm.control.deadletters import DeadLetters
from wm.dataplane.delivery import FENCE_EXTENSION
from wm.events import derive_id, event_key, make_event
from wm.state.ledger import Ledger

BATCH = 50


def _topics() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"bin.{tag}", f"bout.{tag}"


def _runs(trace: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]


def test_one_failing_event_of_a_batch_retries_and_dead_letters_alone(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """Events marked "poison" fail every run: each is retried up to max_retries and
    dead-lettered alone; every other event of the batches gives its output exactly once."""
    topic, done = _topics()
    manager = WorkManager(pg_settings)
    sink = manager.subscribe(done, "sink")
    trace = tmp_path / "runs.jsonl"
    worker = manager.create_worker(
        code=stub(output_type=done, fail="bad", fail_if_data_has="poison", trace=str(trace)),
        mime_type=STUB,
        topic=topic,
        settings={
            "batch_size": BATCH,
            "max_retries": 2,
            "retry_base_delay_ms": 50,
            "failure_threshold": 0,
        },
    )
    queue = f"{topic}::{worker.id}"
    count, poison = 200, {7, 120}
    ids = []
    for n in range(count):  # published before the node starts: full batches
        data: dict[str, Any] = {"n": n, **({"poison": True} if n in poison else {})}
        event = make_event(topic, "/tests", data)
        manager.publish(event)
        ids.append(event.get_id())
    start_node(pg_settings).consuming(queue)
    try:
        outputs = drain(pg_settings, sink, count - len(poison), timeout_s=60)
        assert queue_empty(pg_settings, sink)
        counts = Counter(e["id"] for e in outputs)
        expected = {
            derive_id(event_key("/tests", ids[n]), str(worker.id), 0)
            for n in range(count)
            if n not in poison
        }
        assert set(counts) == expected and max(counts.values()) == 1
        letters = eventually(
            lambda: len(DeadLetters(pg_settings).list()) == 2 and DeadLetters(pg_settings).list()
        )
        assert {letter.event_id for letter in letters} == {ids[n] for n in poison}
        assert all(letter.attempts == 3 for letter in letters)
        runs = Counter(run["event_id"] for run in _runs(trace))
        assert {ids[n]: runs[ids[n]] for n in poison} == {ids[n]: 3 for n in poison}
        assert all(runs[ids[n]] == 1 for n in range(count) if n not in poison)
        assert manager.bus.queue_depth(queue) == 0
        eventually(lambda: Ledger(pg_settings).pending(str(worker.id)) == 0)
    finally:
        manager.delete_worker(worker.id)
        manager.unsubscribe(done, "sink")


def test_a_batch_s_outputs_go_out_in_the_order_each_worker_run_returned_them(
    pg_settings: Settings, start_node: Any
) -> None:
    """Three outputs per event, in batches, to a plain subscription: each output once,
    with its own id and body, an event's in the order the worker returned them (each
    output's JSON is written once, for its record and its publish: a mix-up of the two
    would show here)."""
    topic, done = _topics()
    manager = WorkManager(pg_settings)
    sink = manager.subscribe(done, "sink")
    worker = manager.create_worker(
        code=stub(output_type=done, outputs=3),
        mime_type=STUB,
        topic=topic,
        settings={"batch_size": BATCH},
    )
    try:
        ids = publish_numbered(manager, topic, 40)  # before the node starts: full batches
        start_node(pg_settings).consuming(f"{topic}::{worker.id}")
        outputs = drain(pg_settings, sink, 40 * 3, timeout_s=60)
        by_input: dict[int, list[dict[str, Any]]] = {}
        for output in outputs:
            by_input.setdefault(output["data"]["input"]["n"], []).append(output)
        assert sorted(by_input) == list(range(40))
        for n, found in by_input.items():
            assert [output["data"]["index"] for output in found] == [0, 1, 2]
            key = event_key("/tests", ids[n])
            assert [o["id"] for o in found] == [derive_id(key, str(worker.id), i) for i in range(3)]
        assert queue_empty(pg_settings, sink)
    finally:
        manager.delete_worker(worker.id)
        manager.unsubscribe(done, "sink")


@pytest.mark.slow
def test_kill_9_mid_batch_loses_and_duplicates_nothing(
    pg_settings: Settings, start_node: Any, rng: random.Random
) -> None:
    """Nodes killed with kill -9 while batches run (seeded points): the messages a pool
    process took for its batch come back when its holder record lapses; every event's
    output once, nothing left queued or held."""
    kill_9_mid_stream(pg_settings, start_node, rng, {"batch_size": 20})


@pytest.mark.slow
def test_a_group_in_batch_mode_never_overlaps_and_its_fences_never_go_back(
    pg_settings: Settings, start_node: Any
) -> None:
    """Two workers of one group, batched, on two nodes: a batch runs under one lease (one
    fence for its events); no run overlaps another, fences never decrease."""
    settings = pg_settings.replace(
        group_lock_retry_base_delay_ms=2, retry_base_delay_ms=10, reconcile_interval_s=1.0
    )
    topic, done = _topics()
    manager = WorkManager(settings)
    sink = manager.subscribe(done, "sink")
    workers = [
        manager.create_worker(
            code=stub(output_type=done, sleep_ms=1),
            mime_type=STUB,
            topic=topic,
            group="g",
            settings={"batch_size": 25, "max_retries": 50},
        )
        for _ in range(2)
    ]
    publish_numbered(manager, topic, 250)  # queued before the nodes start: full batches
    nodes = [start_node(settings, name=f"n{i}") for i in range(2)]
    try:
        for node in nodes:
            for worker in workers:
                node.consuming(f"{topic}::{worker.id}")
        outputs = drain(settings, sink, 500, timeout_s=240)
        assert len(outputs) == 500 and len({e["id"] for e in outputs}) == 500
        runs = sorted(outputs, key=lambda e: e["data"]["started_at"])
        for before, after in itertools.pairwise(runs):
            assert after["data"]["started_at"] >= before["data"]["finished_at"], (before, after)
            assert int(after[FENCE_EXTENSION]) >= int(before[FENCE_EXTENSION])
        fences = Counter(int(e[FENCE_EXTENSION]) for e in outputs)
        assert max(fences.values()) > 1  # batches ran: several events under one lease
        assert DeadLetters(settings).list() == []
    finally:
        for worker in workers:
            manager.delete_worker(worker.id)
        manager.unsubscribe(done, "sink")
