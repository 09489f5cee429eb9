"""Worker placement on Redis (``wm.dataplane.placement``, off by default): real nodes with
WM_PLACEMENT_SPILL set and every other setting at its default serve each worker from one
node, spread the workers over the live nodes, and give a node's share to the others when it
is killed, losing nothing."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.helpers import STUB, eventually, stub
from wm import DeadLetters, Settings, WorkManager
from wm.dataplane.placement import PLACE, owner
from wm.events import make_event
from wm.state.ledger import Ledger

#: Most seconds from a kill -9 to every event published after it being served (the
#: liveness bound is about 12 s with the defaults; the machine running the tests is shared).
SERVED_AFTER_KILL_S = 60
#: WM_PLACEMENT_SPILL of these tests (0, the default, turns placement off).
SPILL = 20


def test_python_and_the_take_scripts_place_alike_and_a_leaving_node_moves_only_its_share(
    pg_settings: Settings, rng: random.Random
) -> None:
    client = redis.Redis.from_url(pg_settings.broker_url)
    script = client.register_script(PLACE + "return owner(ARGV[1], {unpack(ARGV, 2)})")
    nodes = [f"host{n}.{rng.getrandbits(48):012x}" for n in range(4)]
    queues = [f"t{n % 7}::{uuid.UUID(int=rng.getrandbits(128))}" for n in range(300)]
    placed = {}
    for queue in queues:
        placed[queue] = owner(queue, nodes)
        lua = script(args=[queue, "", nodes[0], 20, *nodes]).decode()
        assert lua == placed[queue], queue
    shares = {node: sum(o == node for o in placed.values()) for node in nodes}
    assert all(40 < share < 110 for share in shares.values()), shares
    left = nodes[1:]
    for queue in queues:
        if placed[queue] != nodes[0]:
            assert owner(queue, left) == placed[queue], queue


def _node_of(nodes: list[Any]) -> dict[int, str]:
    """Pid of each pool process of ``nodes`` (their process groups) → the node's name."""
    pids: dict[int, str] = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            continue
        for node in nodes:
            if group == node.proc.pid:
                pids[pid] = node.name
    return pids


class _Round:
    """Workers of their own topics, each given ``per_worker`` events; who ran what, from the
    stub's trace."""

    def __init__(self, settings: Settings, tmp_path: Path, workers: int) -> None:
        self.settings, self.manager = settings, WorkManager(settings)
        self.trace = tmp_path / "runs.jsonl"
        run = uuid.uuid4().hex[:8]
        self.topics = [f"place.{run}.{n}" for n in range(workers)]
        self.ids = [
            str(
                self.manager.create_worker(
                    code=stub(trace=str(self.trace)), mime_type=STUB, topic=topic
                ).id
            )
            for topic in self.topics
        ]
        self.worker_of_event: dict[str, str] = {}

    def publish(self, per_worker: int) -> None:
        for n in range(per_worker):
            for topic, worker_id in zip(self.topics, self.ids, strict=True):
                event = make_event(topic, "/tests", {"n": n})
                self.manager.publish(event)
                self.worker_of_event[event.get_id()] = worker_id

    def served(self, timeout_s: float) -> float:
        """Seconds until no delivery of the workers is pending."""
        ledger, started = Ledger(self.settings), time.monotonic()
        eventually(
            lambda: not any(ledger.pending_of(self.ids).values()),
            timeout_s=timeout_s,
            interval_s=0.1,
        )
        return time.monotonic() - started

    def runs(self, nodes: list[Any]) -> dict[str, set[str]]:
        """Worker id → the nodes that ran its deliveries so far (traced pids of pool
        processes no longer alive count as ``gone``)."""
        node_of = _node_of(nodes)
        ran: dict[str, set[str]] = defaultdict(set)
        for line in self.trace.read_text().splitlines():
            entry = json.loads(line)
            worker_id = self.worker_of_event[entry["event_id"]]
            ran[worker_id].add(node_of.get(entry["pid"], "gone"))
        return ran


def _views(nodes: list[Any], count: int) -> None:
    """Until every node's placement spans ``count`` live nodes (its log says so)."""
    pattern = re.compile(rf"placement over {count} live node")
    for node in nodes:
        eventually(lambda node=node: pattern.search(node.log.read_text()), timeout_s=60)


@pytest.mark.slow
def test_nodes_share_the_workers_and_a_killed_nodes_share_moves_with_nothing_lost(
    pg_settings: Settings, start_node: Any, tmp_path: Path, rng: random.Random
) -> None:
    settings = pg_settings.replace(placement_spill=SPILL)
    work = _Round(settings, tmp_path, workers=24)
    nodes = [start_node(settings, name=f"p{n}") for n in range(2)]
    _views(nodes, 2)
    work.publish(3)
    work.served(timeout_s=120)
    ran = work.runs(nodes)
    assert all(len(names) == 1 for names in ran.values()), ran
    assert {name for names in ran.values() for name in names} == {"p0", "p1"}, ran

    nodes.append(start_node(settings, name="p2"))
    _views(nodes, 3)
    work.trace.write_text("")
    work.publish(3)
    work.served(timeout_s=120)
    ran = work.runs(nodes)
    assert all(len(names) == 1 for names in ran.values()), ran
    assert {name for names in ran.values() for name in names} == {"p0", "p1", "p2"}, ran

    victim = nodes.pop(rng.randrange(3))
    share = [w for w, names in ran.items() if names == {victim.name}]
    victim.kill(signal.SIGKILL)
    work.trace.write_text("")
    work.publish(3)
    took_s = work.served(timeout_s=SERVED_AFTER_KILL_S)
    print(f"{len(share)} worker(s) of {victim.name} served {took_s:.1f} s after the kill")
    ran = work.runs(nodes)
    assert set(ran) == set(work.ids), "every worker ran"
    assert all(names <= {n.name for n in nodes} for names in ran.values()), ran
    assert DeadLetters(settings).list() == []
    broker = redis.Redis.from_url(settings.broker_url)
    eventually(lambda: broker.hlen("unacked") == 0, timeout_s=60)


@pytest.mark.slow
def test_a_worker_whose_queue_outgrows_the_spill_is_served_by_every_node(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    settings = pg_settings.replace(placement_spill=SPILL)
    work = _Round(settings, tmp_path, workers=1)
    nodes = [start_node(settings, name=f"s{n}") for n in range(2)]
    _views(nodes, 2)
    work.publish(400)  # far past SPILL
    work.served(timeout_s=180)
    assert work.runs(nodes)[work.ids[0]] == {"s0", "s1"}
