"""Quorum queues on a three-node RabbitMQ cluster started by the test (issue 30, point 1):
every queue is replicated, a server's loss loses nothing, and a message RabbitMQ gives up on
becomes a dead letter, never a drop."""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection

from tests.conftest import FIGURE, need
from tests.helpers import STUB, drain, drain_each, eventually, publish_numbered, stub
from tests.rabbitcluster import BIN, RabbitCluster, start_cluster
from wm import ConfigurationError, DeadLetters, Settings, WorkManager
from wm.dataplane.queues import subscription_queue
from wm.events import derive_id, event_key
from wm.state.ledger import Ledger

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitCluster]:
    if not (BIN / "rabbitmq-server").exists():
        need("rabbitmq-server", FileNotFoundError(str(BIN / "rabbitmq-server")))
    # A short home: the Erlang cookie lives there, and node names stay short.
    started = start_cluster(tmp_path_factory.mktemp("rmq"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def quorum(pg_settings: Settings, cluster: RabbitCluster) -> Settings:
    """Every setting at its default but the broker: the cluster, with quorum queues."""
    return pg_settings.replace(broker_url=cluster.url, amqp_queue_type="quorum")


def _types(cluster: RabbitCluster) -> dict[str, str]:
    node = next(n for n in cluster.nodes if n.process and n.process.poll() is None)
    rows = cluster.ctl(node, "list_queues", "name", "type").splitlines()
    return dict(tuple(row.rsplit("\t", 1)) for row in rows if "\t" in row)  # type: ignore[misc]


def test_kill_9_of_the_queue_leader_loses_nothing(
    quorum: Settings,
    cluster: RabbitCluster,
    start_node: Any,
    rng: random.Random,
    record_property: Callable[[str, object], None],
) -> None:
    """The server leading the worker's queue is killed mid-stream: every event's output
    arrives, a repeat only from a pool process caught between an output's publish and its
    marker (at most one per process, docs/guarantees.md), and deliveries resume within 30 s."""
    topic, done = f"q.{uuid.uuid4().hex[:8]}", f"qd.{uuid.uuid4().hex[:8]}"
    manager = WorkManager(quorum)
    sink = manager.subscribe(done, "sink")
    worker = manager.create_worker(
        code=stub(output_type=done, sleep_ms=20), mime_type=STUB, topic=topic
    )
    queue = f"{topic}::{worker.id}"
    processes = 2
    nodes = [start_node(quorum, name=f"n{i}", concurrency=processes) for i in range(2)]
    for node in nodes:
        node.consuming(queue)
    types = _types(cluster)
    assert types[queue] == "quorum" and types[sink] == "quorum" and types["wm.default"] == "quorum"
    count = 600
    leader = cluster.leader(queue)  # asked before the stream: rabbitmqctl takes a second
    ids = publish_numbered(manager, topic, count)
    ledger = Ledger(quorum)
    target = count - rng.randint(40, 160)
    eventually(lambda: ledger.pending(str(worker.id)) <= target, timeout_s=90, interval_s=0.05)
    leader.kill()
    killed_at = time.monotonic()
    # Past what the nodes held at the kill (prefetch 4 per process): new deliveries, or the
    # stream's end if a loaded machine let it come within that before the kill.
    left = max(ledger.pending(str(worker.id)) - 4 * processes * len(nodes) - 5, 0)
    try:
        eventually(lambda: ledger.pending(str(worker.id)) <= left, timeout_s=30, interval_s=0.1)
    except AssertionError:
        alive = next(n for n in cluster.nodes if n is not leader)
        state = cluster.ctl(alive, "list_queues", "name", "leader", "consumers", "messages")
        stalled = f"no delivery within 30 s of killing {leader.name}:\n{state}"
        raise AssertionError(stalled) from None
    resumed_s = time.monotonic() - killed_at
    expected = {derive_id(event_key("/tests", i), str(worker.id), 0) for i in ids}
    outputs = drain_each(quorum, sink, expected)
    outputs += drain(quorum, sink, count, timeout_s=3)  # a repeat arrives too
    counts = Counter(e["id"] for e in outputs)
    repeated = [i for i, n in counts.items() if n > 1]
    bound = len(nodes) * processes
    assert len(repeated) <= bound and all(counts[i] == 2 for i in repeated), (
        f"{len(repeated)} outputs repeated (at most {bound}): {sorted(counts[i] for i in repeated)}"
    )
    lost = len(expected - set(counts))
    record_property(
        FIGURE,
        f"quorum failover: kill -9 of {leader.name} (the queue's leader): {lost} lost, "
        f"{len(repeated)} repeated, "
        + (f"deliveries resumed after {resumed_s:.1f} s" if left else "killed at the stream's end"),
    )
    assert set(counts) == expected, f"{lost} outputs lost"
    exited = [node for node in nodes if node.proc.poll() is not None]
    assert not exited, "\n".join(
        f"node {node.name} exited ({node.proc.returncode}):\n{node.tail()}" for node in exited
    )
    assert ledger.pending(str(worker.id)) == 0


def test_a_message_rabbitmq_gives_up_on_is_a_dead_letter(quorum: Settings, start_node: Any) -> None:
    """A message delivered more often than WM_AMQP_DELIVERY_LIMIT (here 2) goes to
    ``wm.default``, where a node parks it naming the limit: a worker's delivery and a plain
    subscription's event alike."""
    settings = quorum.replace(amqp_delivery_limit=2)
    manager = WorkManager(settings)
    topic = f"g.{uuid.uuid4().hex[:8]}"
    sink = manager.subscribe(topic, "inbox")
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic=topic)
    queue = f"{topic}::{worker.id}"
    publish_numbered(manager, topic, 1)
    for name in (queue, sink):  # a consumer that fails it again and again
        _reject(settings, name, times=3)
    node = start_node(settings)
    node.consuming(queue)
    letters = eventually(lambda: len(found := DeadLetters(settings).list()) == 2 and found)
    by_type = {x.error_type: x for x in letters}
    assert set(by_type) == {"DeliveryLimitExceeded", "MalformedMessage"}, by_type
    assert f"from queue {queue} more than WM_AMQP_DELIVERY_LIMIT=2" in (
        by_type["DeliveryLimitExceeded"].error_message
    )
    plain = by_type["MalformedMessage"]
    assert "WM_AMQP_DELIVERY_LIMIT" in plain.error_message and sink in plain.error_message
    assert plain.topic == topic
    assert node.proc.poll() is None


def _reject(settings: Settings, queue: str, times: int) -> None:
    with Connection(settings.broker_url) as conn:
        for _ in range(times):
            with conn.channel() as channel:
                bound = subscription_queue(queue, settings).bind(channel)
                message = eventually(lambda bound=bound: bound.get(no_ack=False), timeout_s=10)
                message.reject(requeue=True)


def test_a_quorum_setting_on_a_classic_queue_is_refused_by_name(
    pg_settings: Settings, cluster: RabbitCluster
) -> None:
    """Switching a deployment to quorum queues needs new queues: RabbitMQ refuses to declare
    an existing classic queue as quorum, and the error says which queue and why."""
    classic = pg_settings.replace(broker_url=cluster.url)
    manager = WorkManager(classic)
    name = f"c.{uuid.uuid4().hex[:8]}"
    manager.subscribe(name, "inbox")
    refused = r"refused a queue as declared .*WM_AMQP_QUEUE_TYPE must say"
    with pytest.raises(ConfigurationError, match=refused):
        WorkManager(classic.replace(amqp_queue_type="quorum")).subscribe(name, "inbox")
