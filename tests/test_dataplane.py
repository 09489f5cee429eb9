"""Topic delivery through real Celery node processes (Redis broker unless said otherwise)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Queue
from kombu.utils.json import dumps as kombu_dumps

from tests.helpers import STUB, drain, eventually, publish_numbered, queue_empty, stub
from wm import DeadLetters, Settings, WorkManager, make_event
from wm.dataplane.app import make_app
from wm.dataplane.bus import Route
from wm.dataplane.outputs import _QUEUE, _TAG, OutputPublisher, _prepared
from wm.dataplane.recovery import LEADER_KEY
from wm.dataplane.routes import DROPPED, DROPPED_TTL_S, READY, READY_TTL_S, topic_key
from wm.events import (
    LIFECYCLE_TOPIC,
    LIFECYCLE_TYPE_PREFIX,
    derive_id,
    encode,
    event_key,
    key_of,
)
from wm.state.connection import redis_for
from wm.state.ledger import Ledger
from wm.state.outcomes import Outcomes

FAST = {"retry_base_delay_ms": 20, "max_retries": 2}


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.replace(reconcile_interval_s=1.0)


@pytest.mark.slow
def test_fan_out_to_workers_and_plain_subscriptions(fast: Settings, start_node: Any) -> None:
    manager = WorkManager(fast)
    node = start_node(fast)
    sink_a = manager.subscribe("done.a", "sink")
    sink_b = manager.subscribe("done.b", "sink")
    observer = manager.subscribe("orders", "observer")
    a = manager.create_worker(code=stub(output_type="done.a"), mime_type=STUB, topic="orders")
    b = manager.create_worker(code=stub(output_type="done.b"), mime_type=STUB, topic="orders")
    node.consuming(f"orders::{a.id}")
    node.consuming(f"orders::{b.id}")
    ids = publish_numbered(manager, "orders", 10, correlationid="corr-1")

    out_a, out_b = drain(fast, sink_a, 10), drain(fast, sink_b, 10)
    keys = [event_key("/tests", i) for i in ids]
    assert {e["id"] for e in out_a} == {derive_id(k, str(a.id), 0) for k in keys}
    assert {e["id"] for e in out_b} == {derive_id(k, str(b.id), 0) for k in keys}
    assert all(e["correlationid"] == "corr-1" for e in out_a + out_b)
    assert len(drain(fast, observer, 10)) == 10
    assert manager.publish(make_event("nobody.listens", "/tests", {})) == 0
    assert manager.bus.dropped("nobody.listens") == 1
    # a topic named once leaves nothing for ever: its loaded flag and drop count end
    redis = redis_for(fast)
    assert 0 < redis.ttl(topic_key("nobody.listens", READY)) <= READY_TTL_S
    assert 0 < redis.ttl(topic_key("nobody.listens", DROPPED)) <= DROPPED_TTL_S


@pytest.mark.slow
def test_stopped_worker_keeps_its_queue_and_resumes(fast: Settings, start_node: Any) -> None:
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    node.consuming(f"in::{worker.id}")
    manager.stop_worker(worker.id)
    node.wait_for(f"Canceling queue in::{worker.id}")
    publish_numbered(manager, "in", 5)
    assert queue_empty(fast, sink, 2.0)
    assert manager.bus.queue_depth(f"in::{worker.id}") == 5
    manager.start_worker(worker.id)
    assert len(drain(fast, sink, 5)) == 5


@pytest.mark.slow
def test_a_node_takes_a_backlog_several_messages_at_a_time_and_delivers_all_of_it(
    pg_settings: Settings, start_node: Any
) -> None:
    """On the defaults (two pool processes, a prefetch multiplier of 4) a node takes a
    backlog again once its window has room for three messages, not at each acknowledgement
    (``wm.dataplane.transport.refill_at``), and every message of the backlog is delivered."""
    manager = WorkManager(pg_settings)
    sink = manager.subscribe("paced.out", "sink")
    manager.create_worker(code=stub(output_type="paced.out"), mime_type=STUB, topic="paced")
    publish_numbered(manager, "paced", 60)
    node = start_node(pg_settings)
    node.wait_for("the prefetch window of 8 takes again once it has room for 3 (2 pool processes)")
    outputs = drain(pg_settings, sink, 60)
    assert len({e["id"] for e in outputs}) == 60


@pytest.mark.slow
def test_deleting_a_worker_removes_its_queue(fast: Settings, start_node: Any) -> None:
    manager = WorkManager(fast)
    start_node(fast)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="in", start=False)
    publish_numbered(manager, "in", 3)
    assert manager.bus.queue_depth(f"in::{worker.id}") == 3
    manager.delete_worker(worker.id)
    assert manager.bus.routes("in") == []
    assert manager.bus.queue_depth(f"in::{worker.id}") == 0
    assert manager.list_subscriptions("in") == []


@pytest.mark.slow
def test_code_update_reaches_a_running_node(fast: Settings, start_node: Any) -> None:
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    node.consuming(f"in::{worker.id}")
    publish_numbered(manager, "in", 3)
    assert {e["data"]["version"] for e in drain(fast, sink, 3)} == {1}
    manager.load_code_from_content(worker.id, stub(output_type="done", outputs=2))
    publish_numbered(manager, "in", 3)
    second = drain(fast, sink, 6)
    assert {e["data"]["version"] for e in second} == {2}
    assert len(second) == 6


@pytest.mark.slow
def test_retries_then_dead_letter_then_replay(fast: Settings, start_node: Any) -> None:
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("done", "sink")
    dead = manager.subscribe("in-dead", "alerts")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(
        code=stub(fail="boom"), mime_type=STUB, topic="in", settings=FAST
    )
    node.consuming(f"in::{worker.id}")
    [event_id] = publish_numbered(manager, "in", 1)

    [alert] = drain(fast, dead, 1)
    assert alert["data"]["event_id"] == event_id and alert["data"]["attempts"] == 3
    letters = DeadLetters(fast).list(worker_id=str(worker.id))
    assert len(letters) == 1
    letter = letters[0]
    assert (letter.error_type, letter.error_message, letter.attempts) == (
        "WorkerExecutionError",
        "boom",
        3,
    )
    assert letter.version == 1 and letter.sha256 == manager.get_worker(worker.id).sha256
    assert letter.first_failure_at < letter.last_failure_at
    errors = [
        e for e in drain(fast, lifecycle, 20, 3) if e["type"] == LIFECYCLE_TYPE_PREFIX + "error"
    ]
    assert [e["data"]["attempt"] for e in errors] == [1, 2, 3]

    manager.load_code_from_content(worker.id, stub(output_type="done"))
    assert DeadLetters(fast).replay([letter.id], to_version="current") == 1
    [output] = drain(fast, sink, 1)
    assert output["data"]["version"] == 2
    assert DeadLetters(fast).list() == []
    assert len(DeadLetters(fast).list(include_replayed=True)) == 1
    assert DeadLetters(fast).purge([letter.id]) == 1


@pytest.mark.slow
def test_replay_to_the_same_version_fails_again(fast: Settings, start_node: Any) -> None:
    manager = WorkManager(fast)
    node = start_node(fast)
    worker = manager.create_worker(
        code=stub(fail="v1 fails"), mime_type=STUB, topic="in", settings={**FAST, "max_retries": 0}
    )
    node.consuming(f"in::{worker.id}")
    publish_numbered(manager, "in", 1)
    letters = DeadLetters(fast)
    [letter] = eventually(letters.list)
    manager.load_code_from_content(worker.id, stub(output_type="done"))
    letters.replay([letter.id], to_version="same")
    again = eventually(lambda: [x for x in letters.list() if x.replay_count == 1])
    assert again[0].version == 1 and again[0].error_message == "v1 fails"


@pytest.mark.slow
def test_malformed_message_is_dead_lettered_at_once(fast: Settings, start_node: Any) -> None:
    manager = WorkManager(fast)
    node = start_node(fast)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="in", settings=FAST)
    node.consuming(f"in::{worker.id}")
    route = Route(f"in::{worker.id}", str(worker.id))
    manager.bus.send('{"specversion": "1.0", "type": "x"}', [route])
    manager.bus.send("this is not json", [route])
    letters = eventually(lambda: len(DeadLetters(fast).list()) == 2 and DeadLetters(fast).list())
    assert {x.error_type for x in letters} == {"EventDecodeError"}
    assert {x.attempts for x in letters} == {1}
    assert "lacks required attribute(s): id, source" in " ".join(x.error_message for x in letters)


@pytest.mark.slow
def test_node_start_recovers_state_redis_lost(fast: Settings, start_node: Any) -> None:
    """Redis lost the routing table and the worker cache: the recovery leader rebuilds them
    from the database, releases its lease, and delivery works."""
    manager = WorkManager(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    state = redis.Redis.from_url(fast.redis_url)
    state.flushdb()
    node = start_node(fast)
    node.wait_for("recovery done: 2 queue(s) declared")
    assert state.hlen("wm:topic:{in}:routes") == 1 and state.exists("wm:topic:{in}:ready")
    assert not state.exists(LEADER_KEY)
    node.consuming(f"in::{worker.id}")
    publish_numbered(manager, "in", 2)
    assert len(drain(fast, sink, 2)) == 2


@pytest.mark.slow
def test_deliveries_the_broker_lost_are_sent_again(fast: Settings, start_node: Any) -> None:
    """The pending ledger: a delivery whose broker message vanished (as kombu's Redis
    transport can lose one to a kill between BRPOP and its unacked record) is sent again."""
    settings = fast.replace(redeliver_after_s=1.0)
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="done"), mime_type=STUB, topic="in", start=False
    )
    ids = publish_numbered(manager, "in", 3)
    ledger = Ledger(settings)
    assert ledger.pending(str(worker.id)) == 3
    redis.Redis.from_url(settings.broker_url).delete(f"in::{worker.id}")  # the broker lost them
    assert manager.bus.queue_depth(f"in::{worker.id}") == 0
    start_node(settings)
    manager.start_worker(worker.id)
    outputs = drain(settings, sink, 3)
    assert {e["data"]["input"]["n"] for e in outputs} == {0, 1, 2}
    assert {e["id"] for e in outputs} == {
        derive_id(event_key("/tests", i), str(worker.id), 0) for i in ids
    }
    eventually(lambda: ledger.pending(str(worker.id)) == 0)
    assert queue_empty(settings, sink, 2.0)  # sent again once, not over and over


@pytest.mark.slow
def test_legacy_ledger_entries_are_sent_again_and_settled(fast: Settings, start_node: Any) -> None:
    """Entries of earlier releases (a bare key, the payload in a hash beside it) whose
    broker message was lost are still sent again, then replaced, and leave no hash behind."""
    settings = fast.replace(redeliver_after_s=1.0)
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="done"), mime_type=STUB, topic="in", start=False
    )
    wid, event = str(worker.id), make_event("in", "/tests", {"n": 7})
    state = redis.Redis.from_url(settings.redis_url)
    state.zadd(f"wm:pending:{{{wid}}}", {key_of(event): 1.0})
    state.hset(f"wm:pending:{{{wid}}}:body", key_of(event), encode(event))
    start_node(settings)
    manager.start_worker(worker.id)
    [output] = drain(settings, sink, 1)
    assert output["data"]["input"]["n"] == 7
    eventually(lambda: Ledger(settings).pending(wid) == 0)
    assert not state.exists(f"wm:pending:{{{wid}}}:body")


@pytest.mark.slow
def test_settled_and_dead_lettered_deliveries_leave_the_ledger(
    fast: Settings, start_node: Any
) -> None:
    manager = WorkManager(fast)
    ok = manager.create_worker(code=stub(), mime_type=STUB, topic="in")
    bad = manager.create_worker(
        code=stub(fail="no"), mime_type=STUB, topic="in", settings={**FAST, "max_retries": 0}
    )
    node = start_node(fast)
    node.consuming(f"in::{ok.id}")
    node.consuming(f"in::{bad.id}")
    publish_numbered(manager, "in", 4)
    ledger = Ledger(fast)
    eventually(lambda: len(DeadLetters(fast).list()) == 4)
    eventually(lambda: ledger.pending(str(ok.id)) == ledger.pending(str(bad.id)) == 0)
    manager.stop_worker(bad.id)
    publish_numbered(manager, "in", 1)
    assert ledger.pending(str(bad.id)) == 1
    manager.delete_worker(bad.id)
    assert ledger.pending(str(bad.id)) == 0


def test_a_republished_output_reaches_a_plain_subscription_once(fast: Settings) -> None:
    manager = WorkManager(fast)
    sink = manager.subscribe("done", "sink")
    publisher = OutputPublisher(manager.bus)
    output = make_event("done", "/tests", {"n": 1})
    for _ in range(3):  # a redelivered event republishes its recorded outputs
        publisher.publish(output)
    other = make_event("done", "/tests", {"n": 2})
    publisher.publish(other)
    assert [e["id"] for e in drain(fast, sink, 2)] == [output.get_id(), other.get_id()]
    assert queue_empty(fast, sink, 0.5)  # published synchronously: a copy would be there now


@pytest.mark.slow
def test_a_route_lost_behind_workmanagers_back_is_repaired(fast: Settings, start_node: Any) -> None:
    manager = WorkManager(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    node = start_node(fast)
    node.consuming(f"in::{worker.id}")
    state = redis.Redis.from_url(fast.redis_url)
    # In one transaction: the node's reconcile (every second) may repair the table at any
    # moment, but not between these commands.
    with state.pipeline(transaction=True) as pipe:
        pipe.hdel("wm:topic:{in}:routes", f"in::{worker.id}")
        pipe.hset("wm:topic:{in}:routes", "in::gone", "")  # its subscription does not exist
        pipe.hgetall("wm:topic:{in}:routes")
        *_, broken = pipe.execute()
    assert broken == {b"in::gone": b""}
    eventually(lambda: manager.bus.routes("in") == [Route(f"in::{worker.id}", str(worker.id))])
    publish_numbered(manager, "in", 1)
    assert len(drain(fast, sink, 1)) == 1


@pytest.mark.slow
def test_events_are_told_apart_by_source_and_id(fast: Settings, start_node: Any) -> None:
    """CloudEvents makes source + id unique: two producers may both send id "1"."""
    manager = WorkManager(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    start_node(fast).consuming(f"in::{worker.id}")
    for source in ("/sensor/a", "/sensor/b"):
        manager.publish(make_event("in", source, {"from": source}, id="1"))
    outputs = drain(fast, sink, 2)
    assert sorted(e["data"]["input"]["from"] for e in outputs) == ["/sensor/a", "/sensor/b"]
    assert len({e["id"] for e in outputs}) == 2


def test_a_task_consumer_holds_its_queues_until_it_has_a_callback(amqp_settings: Settings) -> None:
    """On RabbitMQ a queue consumed before the node's event loop gives the task consumer its
    callback (an ``add_consumer`` heard while bootsteps still start) would hand its backlog to
    a consumer without callbacks at the next frame read, and kombu's NotImplementedError would
    end the node: the consumer holds the queue until the callback is there."""
    app = make_app(amqp_settings)
    name = f"held.{uuid.uuid4().hex}"
    queue = Queue(name, routing_key=name, auto_delete=True)
    with app.connection_for_write() as conn:
        conn.Producer().publish({"n": 1}, routing_key=queue.name, declare=[queue])
        consumer = app.amqp.TaskConsumer(conn, queues=[queue])
        consumer.consume()  # before the callback: held
        with contextlib.suppress(socket.timeout):
            conn.drain_events(timeout=0.5)  # a delivery here would raise NotImplementedError
        received: list[Any] = []
        consumer.on_message = received.append
        consumer.consume()
        conn.drain_events(timeout=10)
        [message] = received
        assert message.decode() == {"n": 1}
        message.ack()


@pytest.mark.slow
def test_an_output_is_pushed_in_the_round_trip_of_its_record(
    fast: Settings, start_node: Any
) -> None:
    """The broker is a database of the state store's Redis server, as by default: each
    output's push to its plain subscriptions is written by the script that runs behind its
    record, in the same round trip (its delivery tags say so: the script's, not kombu's), as
    kombu's Redis transport would write it; each output reaches the subscription once."""
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("folded.done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="folded.done"), mime_type=STUB, topic="folded"
    )
    node.consuming(f"folded::{worker.id}")
    broker = redis.Redis.from_url(fast.broker_url)
    ids = publish_numbered(manager, "folded", 10)
    eventually(lambda: broker.llen(sink) == 10, timeout_s=30)
    pushed = [json.loads(raw) for raw in broker.lrange(sink, 0, -1)]
    assert all(re.fullmatch(r"[0-9a-f]{32}-1", m["properties"]["delivery_tag"]) for m in pushed)
    assert {m["properties"]["delivery_info"]["routing_key"] for m in pushed} == {sink}
    outputs = drain(fast, sink, 10)
    keys = [event_key("/tests", i) for i in ids]
    assert sorted(e["id"] for e in outputs) == sorted(derive_id(k, str(worker.id), 0) for k in keys)
    assert queue_empty(fast, sink)


def test_a_folded_push_s_message_is_the_one_kombu_makes(settings: Settings) -> None:
    """The message the folded push writes is made once and each body put in: for any body
    (non-ASCII, quotes, escapes, long) it is, character for character, kombu's own."""
    publisher = OutputPublisher(WorkManager(settings).bus)
    channel = publisher._message_channel()
    for payload in ['{"n": 1}', '{"t": "é \\"q\\" \u2028 \\u0000"}', "x" * 5000, ""]:
        message = _prepared(channel, payload, _QUEUE)
        message["properties"]["delivery_tag"] = _TAG
        assert publisher._message_template(payload) == kombu_dumps(message), payload


@pytest.mark.slow
def test_an_outcome_recorded_during_the_run_is_the_one_published(
    fast: Settings, start_node: Any, tmp_path: Path
) -> None:
    """A copy of the delivery that ran alongside recorded its outcome first (here written
    while the code runs): the run's own outputs are not pushed, although the push runs in
    its record's round trip; the outcome recorded first reaches the subscription, once."""
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("raced.done", "sink")
    trace = tmp_path / "runs.jsonl"
    worker = manager.create_worker(
        code=stub(output_type="raced.done", sleep_ms=1500, trace=str(trace)),
        mime_type=STUB,
        topic="raced",
    )
    node.consuming(f"raced::{worker.id}")
    event = make_event("raced", "/tests", {"n": 1})
    manager.publish(event)
    eventually(trace.exists, timeout_s=30, interval_s=0.02)  # the code runs: outcome read
    owner, key = str(worker.id), key_of(event)
    first = make_event("raced.done", "/first", {"copy": 1}, id=derive_id(key, owner, 0))
    settlement = Ledger(fast).settlement(owner, key, encode(event))
    Outcomes(fast).record(owner, key, [first], settlement)
    [output] = drain(fast, sink, 1)
    assert (output["source"], output["data"]) == ("/first", {"copy": 1})
    eventually(lambda: Ledger(fast).pending(owner) == 0, timeout_s=10)
    assert queue_empty(fast, sink)


#: A node's main process in miniature: the app imported, then a fork as Celery forks a pool
#: process, whose init runs; the child prints how many objects it inherited, froze and tracks.
FORKED_INIT = """
import gc, json, os
import wm.celeryapp
from wm.dataplane.node import on_process_init

pid = os.fork()
if pid == 0:
    inherited = len(gc.get_objects())
    on_process_init()
    print(json.dumps([inherited, gc.get_freeze_count(), len(gc.get_objects())]), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


FORKED_CLIENTS = """
import json, os, sys
from wm.config import Settings
from wm.state.connection import pooled_client, redis_for

settings = Settings(redis_url=sys.argv[1])
state, plain = redis_for(settings), pooled_client(settings.redis_url)
state.ping(), plain.ping()
pid = os.fork()
if pid == 0:
    mine = [redis_for(settings), pooled_client(settings.redis_url)]
    print(json.dumps([mine[0] is state, mine[1] is plain, [c.ping() for c in mine]]), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps([redis_for(settings) is state, pooled_client(settings.redis_url) is plain]))
"""


def test_a_forked_process_makes_redis_clients_of_its_own(settings: Settings) -> None:
    """A pool process never shares its parent's connections: the clients a process caches
    are dropped in a forked child (and kept in the parent)."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED_CLIENTS, settings.redis_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    child, parent = map(json.loads, done.stdout.splitlines())
    assert child == [False, False, [True, True]]
    assert parent == [True, True]


def test_a_pool_process_freezes_what_it_inherited_out_of_the_collector_s_reach() -> None:
    """After its init, a pool process's full collections no longer walk (nor write to) the
    objects the fork shared."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED_INIT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    inherited, frozen, tracked = json.loads(done.stdout)
    assert frozen > inherited // 2
    assert tracked < inherited // 10
