"""Delivery guarantees under concurrency and failure: group exclusion with fences, broker
restarts, RabbitMQ, and kill -9 of nodes in the middle of a stream."""

from __future__ import annotations

import itertools
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import AMQP_URL, need
from tests.helpers import STUB, drain, eventually, stub
from wm import DeadLetters, Settings, WorkManager, make_event
from wm.dataplane.delivery import FENCE_EXTENSION
from wm.errors import EmbeddedRedisError
from wm.events import derive_id, event_key
from wm.local.embedded import find_redis_server, start_redis, stop_redis
from wm.state.ledger import Ledger
from wm.state.locks import GroupLocks
from wm.state.outcomes import Outcomes


def _publish(manager: WorkManager, topic: str, count: int) -> list[str]:
    ids = []
    for n in range(count):
        event = make_event(topic, "/tests", {"n": n})
        manager.publish(event)
        ids.append(event.get_id())
    return ids


@pytest.mark.slow
def test_group_members_never_overlap_and_fences_increase(
    pg_settings: Settings, start_node: Any
) -> None:
    settings = pg_settings.replace(
        group_lock_retry_base_delay_ms=2,
        group_lock_max_retries=12,
        max_retries=50,
        retry_base_delay_ms=10,
        reconcile_interval_s=1.0,
    )
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    workers = [
        manager.create_worker(
            code=stub(output_type="done", sleep_ms=1), mime_type=STUB, topic="in", group="g"
        )
        for _ in range(2)
    ]
    nodes = [start_node(settings, name=f"n{i}") for i in range(2)]
    for node in nodes:
        for worker in workers:
            node.consuming(f"in::{worker.id}")
    _publish(manager, "in", 250)
    outputs = drain(settings, sink, 500, timeout_s=240)
    assert len(outputs) == 500
    runs = sorted(outputs, key=lambda e: e["data"]["started_at"])
    for before, after in itertools.pairwise(runs):
        assert after["data"]["started_at"] >= before["data"]["finished_at"], (before, after)
        assert int(after[FENCE_EXTENSION]) > int(before[FENCE_EXTENSION])
    assert len({e["data"]["pid"] for e in outputs}) > 1  # several processes took part
    assert DeadLetters(settings).list() == []


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[int, Callable[[], None]]]:
    """A Redis server of this test's own, which the test may restart on the same port.

    ``start_redis`` (the embedded Redis of ``wm up``) picks a free port at run time and picks
    again if another program takes it before the server binds it; the append-only file in
    its data directory keeps the queued messages across the restart.
    """
    try:
        binary = find_redis_server()
    except EmbeddedRedisError as exc:
        need("redis-server", exc)
    data_dir = tmp_path / "redis"
    servers = [start_redis(data_dir, executable=binary)]
    port = servers[0].port

    def restart() -> None:
        stop_redis(servers[-1])
        time.sleep(2.0)  # an outage the node must ride out, not a wait for a condition
        servers.append(start_redis(data_dir, port=port, executable=binary))

    yield port, restart
    stop_redis(servers[-1])


@pytest.mark.slow
def test_delivery_resumes_after_a_redis_restart(
    pg_settings: Settings, own_redis: Any, start_node: Any
) -> None:
    port, restart = own_redis
    settings = pg_settings.replace(
        broker_url=f"redis://127.0.0.1:{port}/0",
        redis_url=f"redis://127.0.0.1:{port}/1",
        reconcile_interval_s=1.0,
    )
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    node = start_node(settings)
    node.consuming(f"in::{worker.id}")
    _publish(manager, "in", 5)
    assert len(drain(settings, sink, 5)) == 5
    restart()
    _publish(manager, "in", 5)
    assert len(drain(settings, sink, 5, timeout_s=60)) == 5
    assert node.proc.poll() is None


@pytest.fixture
def amqp_settings(pg_settings: Settings) -> Settings:
    from kombu import Connection

    try:
        with Connection(AMQP_URL, connect_timeout=3) as conn:
            conn.connect()
    except OSError as exc:
        need("RabbitMQ", exc)
    return pg_settings.replace(broker_url=AMQP_URL, reconcile_interval_s=1.0)


@pytest.mark.slow
def test_same_code_path_on_rabbitmq(amqp_settings: Settings, start_node: Any) -> None:
    settings = amqp_settings
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="done"),
        mime_type=STUB,
        topic="in",
        settings={"retry_base_delay_ms": 20, "max_retries": 1},
    )
    failing = manager.create_worker(
        code=stub(fail="nope"),
        mime_type=STUB,
        topic="in",
        settings={"retry_base_delay_ms": 20, "max_retries": 1},
    )
    node = start_node(settings)
    node.consuming(f"in::{worker.id}")
    node.consuming(f"in::{failing.id}")
    try:
        _publish(manager, "in", 10)
        assert len(drain(settings, sink, 10)) == 10
        letters = eventually(
            lambda: len(DeadLetters(settings).list()) == 10 and DeadLetters(settings).list(),
            timeout_s=60,
        )
        assert {x.attempts for x in letters} == {2}
        manager.stop_worker(worker.id)
        node.wait_for(f"Canceling queue in::{worker.id}")
        _publish(manager, "in", 3)
        assert manager.bus.queue_depth(f"in::{worker.id}") == 3
    finally:
        for w in (worker, failing):
            manager.delete_worker(w.id)
        manager.unsubscribe("done", "sink")


@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_stream_loses_and_duplicates_nothing(
    pg_settings: Settings, start_node: Any, rng: random.Random
) -> None:
    settings = pg_settings.replace(
        visibility_timeout_s=5, reconcile_interval_s=1.0, redeliver_after_s=20.0
    )
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="done", sleep_ms=2), mime_type=STUB, topic="in"
    )
    ids = _publish(manager, "in", 1000)
    ledger = Ledger(settings)
    for round_ in range(3):
        node = start_node(settings, name=f"victim{round_}")
        node.consuming(f"in::{worker.id}")
        # Killed after a random share of the stream: mid-stream, at a point the seed replays.
        target = ledger.pending(str(worker.id)) - rng.randint(20, 150)
        eventually(
            lambda target=target: ledger.pending(str(worker.id)) <= target,
            timeout_s=60,
            interval_s=0.02,
        )
        node.kill(signal.SIGKILL)
    start_node(settings, name="survivor").consuming(f"in::{worker.id}")
    outputs = drain(settings, sink, 1000, timeout_s=180)
    outputs += drain(settings, sink, 1000, timeout_s=3)  # anything duplicated arrives too
    counts = Counter(e["id"] for e in outputs)
    assert [i for i, n in counts.items() if n > 1] == []
    # Every published event (1000 distinct ones) has its output: the one derived from its key.
    expected = {derive_id(event_key("/tests", i), str(worker.id), 0) for i in ids}
    assert len(expected) == 1000
    assert set(counts) == expected
    inputs = {e["data"]["input"]["n"] for e in outputs}
    broker = redis.Redis.from_url(settings.broker_url)
    missing = sorted(set(range(1000)) - inputs)
    outcomes = Outcomes(settings)
    recorded = [
        (n, outcomes.get(str(worker.id), event_key("/tests", ids[n])) is not None) for n in missing
    ]
    state = (
        missing,
        manager.bus.queue_depth(f"in::{worker.id}"),
        broker.hlen("unacked"),
        DeadLetters(settings).list(),
        recorded,
        manager.bus.queue_depth(sink),
    )
    assert state == ([], 0, 0, [], [], 0), state
    eventually(lambda: ledger.pending(str(worker.id)) == 0, timeout_s=30)


@pytest.mark.slow
def test_lock_contention_retries_at_broker_level_then_dead_letters(
    settings: Settings, start_node: Any
) -> None:
    """A group lock held elsewhere: the delivery backs off, is retried by the broker, and is
    dead-lettered as LockContention — never dropped."""
    fast = settings.replace(
        reconcile_interval_s=1.0, group_lock_retry_base_delay_ms=10, group_lock_max_retries=2
    )
    manager = WorkManager(fast)
    worker = manager.create_worker(
        code=stub(),
        mime_type=STUB,
        topic="in",
        group="busy",
        settings={"max_retries": 2, "retry_base_delay_ms": 20},
    )
    blocker = GroupLocks(fast)
    lease = blocker.acquire("busy", "operator-script")
    try:
        node = start_node(fast)
        node.consuming(f"in::{worker.id}")
        [event_id] = _publish(manager, "in", 1)
        [letter] = eventually(lambda: DeadLetters(fast).list(), timeout_s=60)
    finally:
        blocker.release(lease)
    assert letter.event_id == event_id
    assert (letter.error_type, letter.attempts) == ("LockContention", 3)
    assert "operator-script" in letter.error_message
