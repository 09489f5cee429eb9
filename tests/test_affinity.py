"""Session affinity across two real prefork nodes (2 pool processes each), every setting at
its default but the worker's ``session_key``: a Python worker keeps a per-session counter in
memory, and each session's events reach the one instance that holds it, its counts
consecutive; a killed node's sessions rebind to the other node with nothing lost; an idle
binding expires; hits and misses are counted on each node's ``/metrics``."""

from __future__ import annotations

import os
import random
import signal
import uuid
from collections import defaultdict
from typing import Any

import pytest

from tests.helpers import STUB, drain, eventually, free_port, scrape, stub, wm_cli
from wm import Settings, WorkManager, make_event
from wm.errors import InvalidArgument
from wm.state.affinity import Affinity
from wm.workersettings import WorkerSettings

#: The worker: a counter per session in the instance's memory, named by a token drawn when
#: the code loads (one per engine instance: its in-memory state).
COUNTER = """
import time
import uuid
from wm.devkit import make_event

INSTANCE = uuid.uuid4().hex
COUNTS = {}


def process(event):
    session = event.get_extension("sessionid")
    time.sleep(0.05)  # the events of a burst spread over the pool processes
    COUNTS[session] = COUNTS.get(session, 0) + 1
    data = {"session": session, "instance": INSTANCE, "count": COUNTS[session]}
    return make_event("OUT", "/workers/counter", data)
"""
SESSIONS, ROUNDS = 6, 4


def _publish(manager: WorkManager, topic: str, sessions: list[str], rounds: int, rng: Any) -> int:
    """Each session's events interleaved with the others', in an order the seed picks."""
    for _ in range(rounds):
        for session in rng.sample(sessions, len(sessions)):
            manager.publish(make_event(topic, "/tests", {}, extensions={"sessionid": session}))
    return rounds * len(sessions)


def _by_session(outputs: list[dict[str, Any]]) -> dict[str, list[tuple[str, int]]]:
    seen: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for output in outputs:
        data = output["data"]
        seen[data["session"]].append((data["instance"], data["count"]))
    return seen


def _counts(samples: dict[Any, float], worker: Any) -> tuple[float, float]:
    labels = (("tenant", "default"), ("worker", worker.name), ("worker_id", str(worker.id)))
    hits = samples.get(("wm_session_affinity_hits_total", labels), 0.0)
    return hits, samples.get(("wm_session_affinity_misses_total", labels), 0.0)


@pytest.mark.slow
def _counter(manager: WorkManager, kind: str, options: dict[str, Any]) -> tuple[str, str, Any]:
    """A worker ``<kind>-<run>`` counting each session's events in memory: its topic, the
    queue its outputs reach, the worker."""
    run = uuid.uuid4().hex[:8]
    topic, out = f"{kind}.{run}", f"{kind}-out.{run}"
    sink = manager.subscribe(out, "sink")
    worker = manager.create_worker(
        code=COUNTER.replace("OUT", out),
        mime_type="text/x-python",
        topic=topic,
        name=f"{kind}-{run}",
        settings=options,
    )
    return topic, sink, worker


def test_sessions_stay_on_one_instance_and_rebind_when_its_node_dies(
    pg_settings: Settings, start_node: Any, rng: random.Random
) -> None:
    manager = WorkManager(pg_settings)
    topic, sink, worker = _counter(manager, "sessions", {"session_key": "sessionid"})
    ports = [free_port(), free_port()]
    nodes = [
        start_node(pg_settings.replace(health_port=port), name=f"aff{i}")
        for i, port in enumerate(ports)
    ]
    for node in nodes:
        node.consuming(f"{topic}::{worker.id}")
    sessions = [f"s{i}-{str(worker.id)[:8]}" for i in range(SESSIONS)]

    sent = _publish(manager, topic, sessions, ROUNDS, rng)
    first = _by_session(drain(pg_settings, sink, sent, timeout_s=40))
    assert sorted(first) == sorted(sessions)
    for session, runs in first.items():  # one instance each, its counts consecutive
        assert len({instance for instance, _ in runs}) == 1, (session, runs)
        assert sorted(count for _, count in runs) == list(range(1, ROUNDS + 1)), (session, runs)

    def counted() -> tuple[float, float] | None:
        both = [_counts(scrape(f"http://127.0.0.1:{port}/metrics"), worker) for port in ports]
        hits, misses = sum(h for h, _ in both), sum(m for _, m in both)
        return (hits, misses) if hits + misses >= sent else None

    assert eventually(counted, timeout_s=10) == (sent - SESSIONS, SESSIONS)
    # without affinity the sessions' events would have spread over these instances too
    assert len({runs[0][0] for runs in first.values()}) >= 2, first

    # kill -9 the node holding the most sessions; the next events rebind them to the other
    affinity = Affinity(pg_settings)
    bound = {s: affinity.bound(str(worker.id), s) for s in sessions}
    node_of = {s: os.getpgid(int(str(b).rsplit(":", 1)[1])) for s, b in bound.items()}
    victim = max(nodes, key=lambda n: sum(g == n.proc.pid for g in node_of.values()))
    moved = {s for s, group in node_of.items() if group == victim.proc.pid}
    victim.kill(signal.SIGKILL)
    survivor = ports[1 - nodes.index(victim)]
    misses_before = _counts(scrape(f"http://127.0.0.1:{survivor}/metrics"), worker)[1]

    sent = _publish(manager, topic, sessions, 2, rng)
    second = _by_session(drain(pg_settings, sink, sent, timeout_s=40))
    assert sum(map(len, second.values())) == sent  # nothing lost
    for session, runs in second.items():
        assert len({instance for instance, _ in runs}) == 1, (session, runs)
        counts = sorted(count for _, count in runs)
        if session in moved:  # a fresh instance: its memory starts afresh
            assert counts == [1, 2] and runs[0][0] != first[session][0][0], (session, runs)
        else:
            assert counts == [ROUNDS + 1, ROUNDS + 2] and runs[0][0] == first[session][0][0]
    misses = _counts(scrape(f"http://127.0.0.1:{survivor}/metrics"), worker)[1]
    assert misses - misses_before == len(moved)

    # an operator looks at a binding (by name, by short id) and ends it
    kept = next(s for s in sessions if s not in moved)
    shown = manager.session(worker.name or "", kept)
    assert shown.instance == affinity.bound(str(worker.id), kept) == bound[kept]  # not moved
    assert shown.expires_in_s is not None and 0 < shown.expires_in_s <= 300 + 60
    cli = wm_cli(pg_settings, "session", "show", str(worker.id)[:8], kept)
    assert (cli["instance"], cli["session"]) == (shown.instance, kept)
    assert wm_cli(pg_settings, "session", "unbind", str(worker.id), kept)["unbound"] is True
    assert manager.session(worker.id, kept).instance is None
    assert manager.unbind_session(worker.id, kept) is False
    with pytest.raises(InvalidArgument, match="non-empty string"):
        manager.session(worker.id, "")


@pytest.mark.slow
def test_an_idle_session_may_rebind_and_bad_settings_are_refused(
    pg_settings: Settings, start_node: Any
) -> None:
    for bad, why in [
        ({"session_key": "Session-Id"}, "not an attribute name"),
        ({"session_key": ""}, "non-empty string"),
        ({"session_idle_s": -1}, "non-negative number"),
        ({"session_key": "sessionid", "batch_size": 4}, "do not go together"),
    ]:
        with pytest.raises(InvalidArgument, match=why):
            WorkerSettings.parse(bad)
    manager = WorkManager(pg_settings)
    options = {"session_key": "sessionid", "session_idle_s": 3}
    topic, sink, worker = _counter(manager, "idle", options)
    port = free_port()
    start_node(pg_settings.replace(health_port=port)).consuming(f"{topic}::{worker.id}")
    affinity = Affinity(pg_settings)
    for _ in range(2):  # a miss binds it, the next one (well within 3 s of its end) is a hit
        manager.publish(make_event(topic, "/tests", {}, extensions={"sessionid": "idle"}))
        assert len(drain(pg_settings, sink, 1)) == 1
    eventually(lambda: affinity.bound(str(worker.id), "idle") is None, timeout_s=8)
    manager.publish(make_event(topic, "/tests", {}, extensions={"sessionid": "idle"}))
    assert len(drain(pg_settings, sink, 1)) == 1  # bound afresh (a miss), wherever
    assert affinity.bound(str(worker.id), "idle") is not None
    manager.publish(make_event(topic, "/tests", {"no": "session"}))  # runs as any other
    assert len(drain(pg_settings, sink, 1)) == 1

    def counted() -> tuple[float, float] | None:
        hits, misses = _counts(scrape(f"http://127.0.0.1:{port}/metrics"), worker)
        return (hits, misses) if hits + misses >= 3 else None

    assert eventually(counted, timeout_s=5) == (1.0, 2.0)
    manager.delete_worker(worker.id)
    assert affinity.bound(str(worker.id), "idle") is None  # a deleted worker's bindings go


def test_deleting_a_worker_forgets_its_bindings_among_many_keys(pg_settings: Settings) -> None:
    """The delete scans the state store for the worker's bindings (in slices of 500 keys:
    one round trip per key scanned would make a delete slow in a large store)."""
    manager = WorkManager(pg_settings)
    kept = manager.create_worker(code=stub(), mime_type=STUB, topic="a", name="k")
    gone = manager.create_worker(code=stub(), mime_type=STUB, topic="a", name="g")
    affinity = Affinity(pg_settings)
    for n in range(1200):
        affinity.claim(gone.id if n % 2 else kept.id, f"s{n}", "node/1", 60)
    manager.delete_worker(gone.id)
    assert [affinity.bound(gone.id, f"s{n}") for n in range(1, 1200, 2)] == [None] * 600
    assert {affinity.bound(kept.id, f"s{n}") for n in range(0, 1200, 2)} == {"node/1"}
