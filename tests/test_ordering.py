"""Ordered keys (``ordering: key``) with real nodes: events with one ``partitionkey`` run one
at a time in publish order, also when some fail and are retried or dead-lettered; different
keys and events without a key are not held back."""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import STUB, drain, stub
from wm import Settings, WorkManager
from wm.control.deadletters import DeadLetters
from wm.events import CloudEvent, make_event
from wm.state.connection import redis_for, text
from wm.state.ledger import Ledger
from wm.state.ordering import GO, KEY_TTL_S, Ordering, legacy_sequence_key, turn_key

KEYS = ("alpha", "beta", "gamma")


@pytest.mark.parametrize("batch_size", [1, 8], ids=["per-message", "batched"])
def test_ordered_keys_keep_publish_order_under_retries_with_two_nodes(
    pg_settings: Settings, start_node: Any, rng: random.Random, tmp_path: Path, batch_size: int
) -> None:
    """With ``batch_size``, events of one key in one batch run in successive calls."""
    manager = WorkManager(pg_settings)
    out = manager.subscribe("ord.done", "out")
    trace = tmp_path / "runs.jsonl"
    worker = manager.create_worker(  # events marked "flaky" fail their first two runs
        code=stub(
            output_type="ord.done",
            sleep_ms=30,
            trace=str(trace),
            fail="flaky run",
            fail_if_data_has="flaky",
            fail_runs=2,
        ),
        mime_type=STUB,
        topic="ord.in",
        settings={
            "ordering": "key",
            "batch_size": batch_size,
            "max_retries": 3,
            "retry_base_delay_ms": 200,
            "failure_threshold": 0,
        },
    )
    poison = manager.create_worker(  # same topic: a key whose head is parked goes on
        code=stub(output_type="ord.done", fail="bad", fail_if_data_has="poison"),
        mime_type=STUB,
        topic="ord.in",
        settings={
            "ordering": "key",
            "batch_size": batch_size,
            "max_retries": 1,
            "retry_base_delay_ms": 50,
            "failure_threshold": 0,
        },
    )
    queues = [f"ord.in::{worker.id}", f"ord.in::{poison.id}"]
    for name in ("node1", "node2"):
        node = start_node(pg_settings, name=name)
        for queue in queues:
            node.consuming(queue)

    sent: dict[str, list[int]] = {key: [] for key in KEYS}
    poisoned = []
    for n in range(36):
        key = "gamma" if n == 0 else rng.choice(KEYS)
        data: dict[str, Any] = {"key": key, "n": n}
        if rng.random() < 0.25:
            data["flaky"] = True
        if key == "gamma" and n < 6:  # parked by the second worker, which goes on with gamma
            data["poison"] = True
            poisoned.append(n)
        manager.publish(make_event("ord.in", "/t", data, extensions={"partitionkey": key}))
        sent[key].append(n)
    for n in range(36, 40):  # no key: unordered, as before
        manager.publish(make_event("ord.in", "/t", {"key": None, "n": n}))

    outputs = drain(pg_settings, out, 80 - len(poisoned), timeout_s=120)
    by_worker: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for output in outputs:
        data = output["data"]
        runs = by_worker.setdefault(output["source"], {})
        runs.setdefault(str(data["input"]["key"]), []).append(data)
    ours = by_worker[f"/workers/{worker.id}"]
    for key in KEYS:  # in publish order, one at a time: each began after the one before ended
        runs = ours[key]
        assert [r["input"]["n"] for r in runs] == sent[key], f"key {key}"
        for before, after in itertools.pairwise(runs):
            assert after["started_at"] >= before["finished_at"], f"key {key} overlapped"
    assert sorted(r["input"]["n"] for r in ours["None"]) == [36, 37, 38, 39]
    retried = [json.loads(line)["event_id"] for line in trace.read_text().splitlines()]
    assert len(retried) > 40  # flaky events did run again: the order held across retries

    theirs = by_worker[f"/workers/{poison.id}"]
    assert [r["input"]["n"] for r in theirs["gamma"]] == [n for n in sent["gamma"] if n >= 6]
    parked = DeadLetters(pg_settings).list()
    assert sorted(json.loads(p.envelope)["data"]["n"] for p in parked) == poisoned
    assert {p.worker_id for p in parked} == {str(poison.id)}
    state = redis_for(pg_settings)
    ended = {key: state.ttl(key) for key in Ordering(pg_settings).keys_of(str(worker.id))}
    assert len(ended) == len(KEYS) and all(0 < ttl <= KEY_TTL_S for ttl in ended.values())
    manager.delete_worker(worker.id)  # its numbers and turns go with it
    assert Ordering(pg_settings).keys_of(str(worker.id)) == []


def test_a_partition_key_s_state_ends_once_caught_up_and_one_numbered_before_goes_on(
    pg_settings: Settings,
) -> None:
    """A key's number and turn live in one hash, with no end while a number given has not had
    its turn and an end KEY_TTL_S after; a key numbered in the worker's hash of an earlier
    release, or whose hash ended, goes on from its number, through a single publish,
    ``publish_many`` and the ledger's own write alike, at default settings but ``ordering``."""
    manager = WorkManager(pg_settings)
    worker = manager.create_worker(
        code=stub(), mime_type=STUB, topic="ord.ends", settings={"ordering": "key"}
    )
    wid = str(worker.id)
    state, ordering = redis_for(pg_settings), Ordering(pg_settings)
    state.hset(legacy_sequence_key(wid), mapping={"alpha": 41, "beta": 7})  # an earlier release
    state.hset(turn_key(wid, "alpha"), mapping={"next": 42, "seen": time.time()})
    state.hset(turn_key(wid, "delta"), mapping={"next": 100})  # ended, made again by a turn

    def keyed(key: str) -> CloudEvent:
        return make_event("ord.ends", "/t", {}, extensions={"partitionkey": key})

    manager.publish(keyed("alpha"))
    manager.publish_many([keyed("alpha"), keyed("gamma"), keyed("delta")])
    entries = Ledger(pg_settings).add([], "k", "{}", numbered=[wid], partition="gamma")

    assert entries.numbers == {wid: 2}
    last = {k: text(state.hget(turn_key(wid, k), "last")) for k in ("alpha", "gamma", "delta")}
    assert last == {"alpha": "43", "gamma": "2", "delta": "100"}
    assert {text(k) for k in state.hkeys(legacy_sequence_key(wid))} == {"beta"}  # not used yet
    assert ordering.turn(wid, "alpha", 42, 60.0)[0] == GO  # its turn, not a late one
    assert ordering.turn(wid, "delta", 100, 60.0)[0] == GO
    for key in ("gamma", "delta"):
        assert state.ttl(turn_key(wid, key)) == -1  # numbers given wait for their turns
    for number in (1, 2):
        assert ordering.turn(wid, "gamma", number, 60.0)[0] == GO
        ordering.advance(wid, "gamma", number)
    assert 0 < state.ttl(turn_key(wid, "gamma")) <= KEY_TTL_S  # caught up: it ends
    ordering.advance(wid, "alpha", 42)
    assert state.ttl(turn_key(wid, "alpha")) == -1  # 43 has not had its turn
    manager.delete_worker(worker.id)
    assert ordering.keys_of(wid) == []
