"""A dead node's messages come back in seconds on Redis, with every setting at its default
(``wm.dataplane.liveness``): no test here changes a timeout. The nodes run with
``pg_settings`` as it is, which sets only the URLs of the database, the broker and Redis."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection

from tests.conftest import ROOT, env_of
from tests.helpers import STUB, drain, drain_each, eventually, publish_numbered, stub
from wm import DeadLetters, Settings, WorkManager
from wm.dataplane import liveness
from wm.dataplane.delivery import FENCE_EXTENSION
from wm.dataplane.queues import EXCHANGE, subscription_queue
from wm.dataplane.transport import Transport
from wm.errors import ConfigurationError
from wm.events import derive_id, event_key
from wm.state.ledger import Ledger
from wm.state.locks import GroupLocks

#: Most seconds from the last kill to the last output (the issue's bound).
RECOVERED_WITHIN_S = 60


def _unacked(settings: Settings) -> int:
    return int(redis.Redis.from_url(settings.broker_url).hlen("unacked"))


def _victim(settings: Settings, nodes: list[Any], rng: random.Random) -> Any:
    """The node whose process holds the group lock now, else one the seed picks."""
    holder = GroupLocks(settings).holder("g")
    if holder is not None:
        with contextlib.suppress(ProcessLookupError, ValueError):
            group = os.getpgid(int(holder["owner"].split(":")[1]))
            for node in nodes:
                if node.proc.pid == group:
                    return node
    return rng.choice(nodes)


def _kill_and_replace(
    settings: Settings, nodes: list[Any], rng: random.Random, start_node: Any, name: str
) -> float:
    """kill -9 a node (the group lock's holder when there is one), start another; returns
    when the kill happened (monotonic)."""
    victim = _victim(settings, nodes, rng)
    victim.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    nodes.remove(victim)
    nodes.append(start_node(settings, name=name))
    return killed_at


def _chaos(
    settings: Settings,
    start_node: Any,
    rng: random.Random,
    worker_ids: list[str],
    events: int,
    kills: int,
) -> float:
    """Two nodes; ``kills`` times, after a share of the stream the seed picks, kill -9 one
    and start another. Returns when the last kill happened (monotonic)."""
    ledger = Ledger(settings)

    def pending() -> int:
        return sum(ledger.pending_of(worker_ids).values())

    nodes = [start_node(settings, name=f"n{i}") for i in range(2)]
    killed_at = 0.0
    for round_ in range(kills):
        share = (round_ + 1 + rng.uniform(-0.3, 0.3)) / (kills + 1)
        target = round(events * (1 - share))
        eventually(lambda target=target: pending() <= target, timeout_s=120, interval_s=0.02)
        killed_at = _kill_and_replace(settings, nodes, rng, start_node, f"r{round_}")
    return killed_at


def _outputs(settings: Settings, sink: str, expected: set[str]) -> tuple[list[Any], float]:
    """Every expected output (and any repeat arriving soon after), and when the last of the
    expected ones came (monotonic)."""
    outputs = drain_each(settings, sink, expected)
    complete_at = time.monotonic()
    outputs += drain(settings, sink, 1, timeout_s=3)  # a duplicate would arrive too
    return outputs, complete_at


def _executions(trace: Path) -> Counter[str]:
    return Counter(json.loads(line)["id"] for line in trace.read_text().splitlines())


@pytest.mark.slow
def test_kill_9_of_group_nodes_with_the_defaults_recovers_in_seconds(
    pg_settings: Settings, start_node: Any, rng: random.Random, tmp_path: Path
) -> None:
    """Finding 1 of issue 25: 2 nodes, a group of 2 workers × 400 events, 3 kill -9 (each
    node replaced), every timeout at its default. Before, the killed nodes' reserved messages
    sat in kombu's unacked hash for WM_VISIBILITY_TIMEOUT_S (an hour)."""
    settings = pg_settings
    run = uuid.uuid4().hex[:8]
    done = f"done.{run}"
    manager = WorkManager(settings)
    sink = manager.subscribe(done, "sink")
    trace = tmp_path / "runs.jsonl"
    workers = [
        manager.create_worker(
            code=stub(output_type=done, sleep_ms=5, trace=str(trace)),
            mime_type=STUB,
            topic=f"in-{side}.{run}",
            group="g",
        )
        for side in "ab"
    ]
    ids = {w.id: publish_numbered(manager, w.topic, 400) for w in workers}
    killed_at = _chaos(settings, start_node, rng, [str(w.id) for w in workers], 800, kills=3)
    expected = {derive_id(event_key("/tests", i), str(w), 0) for w, e in ids.items() for i in e}
    outputs, complete_at = _outputs(settings, sink, expected)
    counts = Counter(e["id"] for e in outputs)
    runs = sorted(
        ({**e["data"], "fence": int(e[FENCE_EXTENSION])} for e in outputs),
        key=lambda r: r["started_at"],
    )
    overlaps = [(a, b) for a, b in itertools.pairwise(runs) if b["started_at"] < a["finished_at"]]
    took_s = complete_at - killed_at
    print(f"group: {len(counts)}/800 outputs, the last {took_s:.1f} s after the last kill")
    assert sorted(expected - set(counts)) == []
    assert [i for i, n in counts.items() if n > 1 or i not in expected] == []
    assert overlaps == []
    assert took_s <= RECOVERED_WITHIN_S, took_s
    assert DeadLetters(settings).list() == []
    eventually(lambda: _unacked(settings) == 0, timeout_s=30)


@pytest.mark.slow
def test_kill_9_without_a_group_with_the_defaults_recovers_in_seconds(
    pg_settings: Settings, start_node: Any, rng: random.Random
) -> None:
    """The same without a group: 2,000 events, 5 kill -9, every timeout at its default."""
    settings = pg_settings
    run = uuid.uuid4().hex[:8]
    topic, done = f"in.{run}", f"done.{run}"
    manager = WorkManager(settings)
    sink = manager.subscribe(done, "sink")
    worker = manager.create_worker(
        code=stub(output_type=done, sleep_ms=20), mime_type=STUB, topic=topic
    )
    ids = publish_numbered(manager, topic, 2000)
    killed_at = _chaos(settings, start_node, rng, [str(worker.id)], 2000, kills=5)
    expected = {derive_id(event_key("/tests", i), str(worker.id), 0) for i in ids}
    outputs, complete_at = _outputs(settings, sink, expected)
    counts = Counter(e["id"] for e in outputs)
    took_s = complete_at - killed_at
    print(f"no group: {len(counts)}/2000 outputs, the last {took_s:.1f} s after the last kill")
    assert sorted(expected - set(counts)) == []
    assert [i for i, n in counts.items() if n > 1 or i not in expected] == []
    assert took_s <= RECOVERED_WITHIN_S, took_s
    assert DeadLetters(settings).list() == []
    eventually(lambda: _unacked(settings) == 0, timeout_s=30)


@pytest.mark.slow
@pytest.mark.parametrize("visibility_timeout_s", [None, 5], ids=["defaults", "visibility-5s"])
def test_a_delivery_running_three_heartbeats_runs_once(
    pg_settings: Settings, start_node: Any, tmp_path: Path, visibility_timeout_s: int | None
) -> None:
    """A live node keeps its deliveries visible: one running 3 heartbeats (6 s), while
    another node watches, runs once, with the defaults; and with a visibility timeout of
    5 s, shorter than the delivery (before, kombu's own restore handed it out again after
    5 s)."""
    settings = pg_settings
    if visibility_timeout_s is not None:
        settings = settings.replace(visibility_timeout_s=visibility_timeout_s)
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    trace = tmp_path / "runs.jsonl"
    sleep_ms = round(3 * settings.node_heartbeat_s * 1000)
    worker = manager.create_worker(
        code=stub(output_type="done", sleep_ms=sleep_ms, trace=str(trace)),
        mime_type=STUB,
        topic="slow",
    )
    for name in ("n0", "n1"):
        start_node(settings, name=name).consuming(f"slow::{worker.id}")
    publish_numbered(manager, "slow", 1)
    outputs = drain(settings, sink, 1, timeout_s=60)
    outputs += drain(settings, sink, 1, timeout_s=2 * settings.node_heartbeat_s)
    assert len(outputs) == 1
    assert outputs[0]["data"]["finished_at"] - outputs[0]["data"]["started_at"] >= sleep_ms / 1000
    assert len(trace.read_text().splitlines()) == 1  # executed once
    assert DeadLetters(settings).list() == []


# The scripts against Redis, without nodes: claims that race, and a node that comes back.


@pytest.fixture
def broker_url(pg_settings: Settings) -> Iterator[str]:
    yield pg_settings.broker_url
    liveness.hold_as("")


def _take(url: str, queue: str, count: int, node: str) -> list[Any]:
    """Take ``count`` messages of ``queue`` as ``node`` (unacknowledged)."""
    liveness.hold_as(node)
    conn = Connection(url, transport=Transport)
    channel = conn.default_channel
    return [channel.basic_get(queue, no_ack=False) for _ in range(count)]


def _fill(url: str, queue: str, count: int) -> None:
    with Connection(url, transport=Transport) as conn:
        producer = conn.Producer()
        for n in range(count):
            producer.publish(
                {"n": n}, exchange=EXCHANGE, routing_key=queue, declare=[subscription_queue(queue)]
            )


def _dead(url: str, node: str) -> None:
    """``node`` beat once, with a record that expired at once."""
    with Connection(url, transport=Transport) as conn:
        liveness.beat(conn.default_channel, node, 0.001)
    time.sleep(0.01)


def test_racing_nodes_put_a_dead_nodes_messages_back_once(broker_url: str) -> None:
    queue = f"in::{uuid.uuid4()}"
    _fill(broker_url, queue, 50)
    assert all(_take(broker_url, queue, 50, "dead"))
    _dead(broker_url, "dead")
    restored: list[int] = []

    def claim(node: str) -> None:
        with Connection(broker_url, transport=Transport) as conn:
            restored.append(liveness.restore_dead(conn.default_channel, node, ["dead"]))

    threads = [threading.Thread(target=claim, args=(f"live{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    broker = redis.Redis.from_url(broker_url)
    assert sum(restored) == 50 and broker.llen(queue) == 50
    assert broker.hlen("unacked") == broker.zcard("unacked_index") == broker.hlen("wm.held") == 0
    assert not broker.sismember(liveness.NODES_KEY, "dead")


def test_a_node_that_comes_back_leaves_the_new_holders_message_alone(broker_url: str) -> None:
    """A node stalled past its expiry: its messages went back and another node took them.
    Its late acknowledgement, or its restore at shutdown, must not take them from the new
    holder (a delivery tag comes back with its message)."""
    queue = f"in::{uuid.uuid4()}"
    _fill(broker_url, queue, 2)
    late = _take(broker_url, queue, 2, "stalled")
    _dead(broker_url, "stalled")
    liveness.hold_as("live")
    with Connection(broker_url, transport=Transport) as conn:
        liveness.beat(conn.default_channel, "live", 60)
        assert liveness.restore_dead(conn.default_channel, "live", ["stalled"]) == 2
    again = _take(broker_url, queue, 2, "live")
    assert {m.delivery_tag for m in again} == {m.delivery_tag for m in late}
    liveness.hold_as("stalled")
    late[0].ack()
    late[1].channel.qos.restore_by_tag(late[1].delivery_tag)
    broker = redis.Redis.from_url(broker_url)
    assert broker.hlen("unacked") == 2 and broker.llen(queue) == 0
    liveness.hold_as("live")
    for message in again:
        message.ack()
    assert broker.hlen("unacked") == 0


def test_a_heartbeat_a_node_could_miss_is_refused(pg_settings: Settings) -> None:
    with pytest.raises(ConfigurationError, match="WM_NODE_DEAD_AFTER_S=3 must be at least 2"):
        liveness.check_settings(pg_settings.replace(node_heartbeat_s=2.0, node_dead_after_s=3.0))


# A node whose event loop is wedged while its heartbeat thread beats on.


class _UnreadNode:
    """A node whose output goes to a pipe read until it consumes ``queue``, then never
    again and full (a log collector that stopped reading): the next line its main process
    logs, a message received, blocks its event loop, holding that message, before a pool
    process gets it. Its heartbeat thread writes nothing while Redis answers, so it beats
    on. (SIGSTOP would stop that thread too: the node would look dead without this change.)"""

    def __init__(self, settings: Settings, name: str, queue: str) -> None:
        cmd = [sys.executable, "-m", "celery", "-A", "wm.celeryapp", "worker", "-n"]
        cmd += [f"{name}@%h", "-c", "2", "--loglevel=INFO", "--without-gossip"]
        self.proc = subprocess.Popen(
            [*cmd, "--without-mingle"],
            env=env_of(settings),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.out = self.proc.stdout.fileno()
        self.seen = b""
        try:
            self.read_until(f"Started consuming from {queue}".encode())
            self.read_until(b"reconciled consumers")  # the line after
        except BaseException:
            self.kill()
            raise

    def stop_reading(self) -> None:
        """Fill the pipe, through a description of its own (the node's blocks)."""
        pipe = os.open(f"/proc/{self.proc.pid}/fd/1", os.O_WRONLY | os.O_NONBLOCK)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(pipe, b"\n" * 4096)
        os.close(pipe)

    def read_until(self, text: bytes, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.seen:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.seen[-2000:]
            if select.select([self.out], [], [], 0.5)[0]:
                self.seen += os.read(self.out, 1 << 16)

    def wedged(self) -> bool:
        """Its main thread waits to write to the pipe."""
        return Path(f"/proc/{self.proc.pid}/wchan").read_text().endswith("pipe_write")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _held_by(broker: redis.Redis, name: str) -> int:
    """How many messages the node called ``name`` holds (0 once claimed)."""
    return sum(
        broker.scard(key) for key in broker.scan_iter(f"{liveness.NODE_PREFIX}{name}@*.held")
    )


@pytest.mark.slow
def test_a_node_whose_event_loop_is_wedged_loses_what_it_holds_to_a_live_node(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """A node whose event loop stands still while its heartbeat thread beats on holds
    prefetched messages it will not run. They come back within WM_NODE_DEAD_AFTER_S and a
    heartbeat of the wedge, with the defaults, and each event has one output. Before, the
    heartbeat renewed its record and their visibility for as long as the node lived."""
    settings = pg_settings
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    trace = tmp_path / "runs.jsonl"
    worker = manager.create_worker(
        code=stub(output_type="done", sleep_ms=50, trace=str(trace)), mime_type=STUB, topic="in"
    )
    queue = f"in::{worker.id}"
    start_node(settings, name="live").consuming(queue)
    wedged = _UnreadNode(settings, "wedged", queue)
    broker = redis.Redis.from_url(settings.broker_url)
    try:
        wedged.stop_reading()
        ids = publish_numbered(manager, "in", 60)
        wedged_at = eventually(lambda: wedged.wedged() and time.monotonic(), interval_s=0.05)
        held = _held_by(broker, "wedged")
        assert held > 0, "the node wedged holding nothing: no case"
        restored_at = eventually(lambda: _held_by(broker, "wedged") == 0 and time.monotonic())
        expected = {derive_id(event_key("/tests", i), str(worker.id), 0) for i in ids}
        outputs = drain(settings, sink, len(expected), timeout_s=60)
        outputs += drain(settings, sink, 1, timeout_s=2 * settings.node_heartbeat_s)
    finally:
        wedged.kill()
    took_s = restored_at - wedged_at
    runs = len(trace.read_text().splitlines())
    print(f"wedged node: {held} held messages back {took_s:.1f} s after the wedge; {runs} runs")
    counts = Counter(e["id"] for e in outputs)
    assert sorted(expected - set(counts)) == []
    assert [i for i, n in counts.items() if n > 1 or i not in expected] == []
    # A beat of the live node; another for the loop's last turn and a loaded machine.
    assert took_s <= settings.node_dead_after_s + 2 * settings.node_heartbeat_s, took_s
    assert DeadLetters(settings).list() == []


@pytest.mark.slow
def test_a_node_that_lost_its_broker_gives_back_what_it_had_reserved(
    pg_settings: Settings, own_redis: Any, start_node: Any
) -> None:
    """Redis restarts with its data (append-only file) while a node holds messages: Celery
    forgets those it had reserved and not started, and could not put them back while Redis
    was away; the node's beat would keep them held, and visible, for as long as it lives.
    It takes a new life when it reconnects, so they go back when the old one lapses. Every
    setting at its default but the URLs of this test's own Redis."""
    port, restart = own_redis
    settings = pg_settings.replace(
        broker_url=f"redis://127.0.0.1:{port}/0", redis_url=f"redis://127.0.0.1:{port}/1"
    )
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="done", sleep_ms=400), mime_type=STUB, topic="in"
    )
    node = start_node(settings, name="n0")
    node.consuming(f"in::{worker.id}")
    publish_numbered(manager, "in", 30)
    outputs = drain(settings, sink, 4, timeout_s=60)
    assert redis.Redis(port=port).hlen(liveness.HOLDERS_KEY) > 2  # it holds what it reserved
    restart()
    budget_s = settings.node_dead_after_s + 4 * settings.node_heartbeat_s + 45
    outputs += drain(settings, sink, 30 - len(outputs), timeout_s=budget_s)
    assert sorted({o["data"]["input"]["n"] for o in outputs}) == list(range(30)), node.tail()
    assert node.proc.poll() is None
