"""Defects found by chaos runs, each reproduced first (through real node processes where the
defect needs one)."""

from __future__ import annotations

import base64
import re
import threading
from typing import Any

import pytest
import redis
from kombu import Connection

from tests.helpers import STUB, drain, eventually, stub
from wm import DeadLetters, InvalidArgument, Settings, WorkManager, make_event
from wm.dataplane.deadletters import MAX_ERROR_MESSAGE_CHARS, Failure
from wm.dataplane.deadletters import DeadLetters as ParkedLetters
from wm.dataplane.queues import EXCHANGE, subscription_queue
from wm.dataplane.transport import Transport
from wm.events import LIFECYCLE_TOPIC, LIFECYCLE_TYPE_PREFIX, encode, key_of
from wm.state.ledger import Ledger

ONE_ATTEMPT = {"max_retries": 0}


@pytest.mark.slow
def test_a_nul_byte_in_an_error_is_parked_once_not_looped(
    pg_settings: Settings, start_node: Any
) -> None:
    """PostgreSQL refuses NUL in text: the dead letter once failed to store, and the delivery
    was requeued every second for ever, each time with a lifecycle error."""
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(
        code=stub(fail="bad\x00byte"), mime_type=STUB, topic="in", settings=ONE_ATTEMPT
    )
    node.consuming(f"in::{worker.id}")
    manager.publish(make_event("in", "/tests", {"n": 1}))

    [letter] = eventually(lambda: DeadLetters(fast).list(), timeout_s=30)
    assert letter.error_message == "bad\\x00byte" and letter.attempts == 1
    events = drain(fast, lifecycle, 50, timeout_s=5)
    errors = [e for e in events if e["type"] == LIFECYCLE_TYPE_PREFIX + "error"]
    assert len(errors) == 1, f"the delivery ran {len(errors)} times"


def test_a_letter_the_database_refuses_is_stored_bounded(pg_settings: Settings) -> None:
    """Parking always ends: what PostgreSQL cannot store is kept as a bounded copy."""
    event = make_event("in", "/tests", {"n": 1})
    huge = "x" * (MAX_ERROR_MESSAGE_CHARS * 4) + "\x00"
    failure = Failure(
        topic="in",
        worker_id=None,
        envelope=encode(event) + "\x00",
        key=key_of(event),
        event_id=event.get_id() + "\x00" * 300,
        error_type="Weird\x00Error",
        error_message=huge,
        attempts=1,
    )
    letters = DeadLetters(pg_settings)
    letter = letters.get(letters.park(failure))
    assert letter.error_type == "Weird\\x00Error"
    assert len(letter.error_message) <= MAX_ERROR_MESSAGE_CHARS
    assert letter.error_message.endswith("characters]") and "\x00" not in letter.envelope
    assert letter.event_id is not None and len(letter.event_id) <= 255


def test_a_letter_that_fails_again_while_its_replay_commits_is_listed(
    pg_settings: Settings,
) -> None:
    """A node may fail a replayed letter before the replay has committed; the new failure
    must come after the replay's mark and clear it, not be hidden as "replayed"."""
    manager = WorkManager(pg_settings)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="in")
    event = make_event("in", "/tests", {"n": 1})
    failure = Failure(
        topic="in",
        worker_id=str(worker.id),
        envelope=encode(event),
        key=key_of(event),
        event_id=event.get_id(),
        error_type="WorkerExecutionError",
        error_message="boom",
        attempts=1,
    )
    parking = ParkedLetters(pg_settings)
    letter_id = parking.park(failure)
    letters = DeadLetters(pg_settings)
    again = threading.Thread(target=parking.park, args=(failure,))
    real_send = letters.bus.send

    def send_then_fail_at_once(*args: Any, **kwargs: Any) -> Any:
        sent = real_send(*args, **kwargs)
        again.start()  # the node's second failure, as fast as it can come
        again.join(0.5)
        return sent

    letters.bus.send = send_then_fail_at_once  # type: ignore[method-assign]
    assert letters.replay([letter_id]) == 1
    again.join(10)
    [listed] = letters.list()
    assert (listed.id, listed.replay_count) == (letter_id, 1)


@pytest.mark.slow
def test_a_worker_feeding_itself_is_parked_after_max_hops(
    settings: Settings, start_node: Any
) -> None:
    """A worker whose output type was its own topic once ran thousands of generations."""
    fast = settings.replace(reconcile_interval_s=1.0, max_hops=3)
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("loop", "sink")
    worker = manager.create_worker(code=stub(output_type="loop"), mime_type=STUB, topic="loop")
    node.consuming(f"loop::{worker.id}")
    manager.publish(make_event("loop", "/tests", {"n": 1}))

    [letter] = eventually(lambda: DeadLetters(fast).list(), timeout_s=30)
    assert letter.error_type == "HopLimitExceeded" and letter.attempts == 1
    assert "WM_MAX_HOPS=3" in letter.error_message
    seen = drain(fast, sink, 10, timeout_s=3)
    assert [e.get("wmhops") for e in seen] == [None, 1, 2, 3]


@pytest.mark.slow
def test_outputs_to_reserved_or_unlisted_topics_are_refused(
    settings: Settings, start_node: Any
) -> None:
    """Workers could publish forged lifecycle and dead-letter events."""
    fast = settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    forged_dead = manager.subscribe("in-dead", "alerts")
    outputs = {
        LIFECYCLE_TOPIC: {},
        "in-dead": {},
        "elsewhere": {"output_topics": ["allowed"]},
    }
    for output_type, worker_settings in outputs.items():
        worker = manager.create_worker(
            code=stub(output_type=output_type),
            mime_type=STUB,
            topic="in",
            settings=worker_settings,
        )
        node.consuming(f"in::{worker.id}")
    manager.publish(make_event("in", "/tests", {"n": 1}))

    letters = eventually(lambda: len(DeadLetters(fast).list()) == 3 and DeadLetters(fast).list())
    assert {(d.error_type, d.attempts) for d in letters} == {("OutputRefused", 1)}
    messages = sorted(d.error_message for d in letters)
    assert "is not in the worker's output_topics" in messages[0]
    assert all("reserved" in m for m in messages[1:])
    events = drain(fast, lifecycle, 100, timeout_s=3)
    assert all(e["source"] == "/workmanager" for e in events)
    alerts = drain(fast, forged_dead, 10, timeout_s=3)
    assert [a["type"] for a in alerts] == ["com.virtufin.workmanager.deadletter"] * 3


def test_output_topics_must_be_valid_names(manager: WorkManager) -> None:
    with pytest.raises(InvalidArgument, match="output topic"):
        manager.create_worker(
            code=stub(), mime_type=STUB, topic="in", settings={"output_topics": ["a::b"]}
        )
    with pytest.raises(InvalidArgument, match="list of topics"):
        manager.create_worker(
            code=stub(), mime_type=STUB, topic="in", settings={"output_topics": "a"}
        )


@pytest.mark.slow
def test_messages_that_are_no_delivery_are_parked_and_the_node_lives(
    pg_settings: Settings, start_node: Any
) -> None:
    """Raw bytes on a worker queue ended the node (kombu's JSON decode); an unknown task,
    a pickle or a text/plain body was dropped with a log line."""
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    queue = f"in::{worker.id}"
    node.consuming(queue)

    broker = redis.Redis.from_url(fast.broker_url)
    broker.lpush(queue, b"\xff\xfe raw \x00 bytes")
    broker.lpush(queue, b'{"hello": "json, but no kombu message"}')
    app = manager.bus.app
    with app.producer_or_acquire() as producer:
        app.send_task("no.such.task", args=[1], queue=subscription_queue(queue), producer=producer)
        pickled = (b"\x80\x04K\x01.", "application/x-python-serialize")
        for body, content_type in ((b"plain words", "text/plain"), pickled):
            producer.publish(
                body,
                exchange=EXCHANGE,
                routing_key=queue,
                serializer=None,
                content_type=content_type,
                content_encoding="binary",
            )

    letters = eventually(lambda: len(DeadLetters(fast).list()) == 5 and DeadLetters(fast).list())
    assert {(d.error_type, d.worker_id, d.topic) for d in letters} == {
        ("MalformedMessage", str(worker.id), "in")
    }
    envelopes = {d.envelope for d in letters}
    # kombu decodes a popped item as UTF-8 (with replacement) before anyone else sees it.
    assert "\ufffd\ufffd raw \\x00 bytes" in envelopes
    assert "base64:" + base64.b64encode(b"\x80\x04K\x01.").decode() in envelopes
    assert '{"hello": "json, but no kombu message"}' in envelopes
    assert "plain words" in envelopes
    reasons = " ".join(d.error_message for d in letters)
    assert "no task named 'no.such.task'" in reasons and "text/plain" in reasons

    manager.publish(make_event("in", "/tests", {"n": 1}))
    assert len(drain(fast, sink, 1)) == 1
    assert node.proc.poll() is None, node.tail()


@pytest.mark.slow
def test_a_backlog_is_not_sent_again_while_it_waits(settings: Settings, start_node: Any) -> None:
    """The ledger sweep re-sent every delivery pending over WM_REDELIVER_AFTER_S, though its
    message still waited in the queue: a 1,000-event backlog peaked at 2,300 messages. Only a
    message the broker lost is sent again, once."""
    fast = settings.replace(reconcile_interval_s=0.5, redeliver_after_s=1.0)
    manager = WorkManager(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="done", sleep_ms=20), mime_type=STUB, topic="in"
    )
    queue = f"in::{worker.id}"
    events = 150
    for n in range(events):
        manager.publish(make_event("in", "/tests", {"n": n}))
    broker = redis.Redis.from_url(fast.broker_url)
    lost = broker.rpop(queue)  # the broker lost the oldest one (as a kill after BRPOP does)
    assert lost is not None
    node = start_node(fast, concurrency=1)  # ~3 s of work: several sweeps see a backlog
    node.consuming(queue)

    outputs = drain(fast, sink, events, timeout_s=60)
    assert sorted(e["data"]["input"]["n"] for e in outputs) == list(range(events))
    eventually(lambda: Ledger(fast).pending(str(worker.id)) == 0)
    log = node.log.read_text()
    executed = len(re.findall(r"Task wm\.deliver\[[^]]+\] received", log))
    assert executed <= events + 2, f"{executed} task runs for {events} events"
    assert "sent 1 lost delivery(ies) again" in log


@pytest.mark.slow
def test_two_nodes_under_load_survive_a_redis_restart(
    pg_settings: Settings,
    own_redis: Any,
    start_node: Any,
) -> None:
    """A Redis restart under load once ended a node: kombu's restore of unacknowledged
    messages during the reconnect failed ("Unrecoverable error: AttributeError")."""
    port, restart = own_redis
    settings = pg_settings.replace(
        broker_url=f"redis://127.0.0.1:{port}/0",
        redis_url=f"redis://127.0.0.1:{port}/1",
        reconcile_interval_s=1.0,
        redeliver_after_s=5.0,
        visibility_timeout_s=10,  # unacknowledged messages of the lost connections return
    )
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="done", sleep_ms=5), mime_type=STUB, topic="in"
    )
    nodes = [start_node(settings, name=f"node{i}") for i in (1, 2)]
    for node in nodes:
        node.consuming(f"in::{worker.id}")
    events = 400
    for n in range(events):
        manager.publish(make_event("in", "/tests", {"n": n}))
    eventually(lambda: manager.bus.queue_depth(f"in::{worker.id}") < events - 50)
    restart()

    outputs = drain(settings, sink, events, timeout_s=180)
    assert {e["data"]["input"]["n"] for e in outputs} == set(range(events))
    for node in nodes:
        assert node.proc.poll() is None, node.tail()


def test_a_closed_broker_connection_is_a_connection_error(settings: Settings) -> None:
    """kombu asked a connection detached by a Redis restart for its host ('NoneType' object
    has no attribute 'hostname'), an error nothing expects, and the node ended."""
    with Connection(settings.broker_url, transport=Transport) as conn:
        channel = conn.default_channel
        conn._do_close_transport()  # what Celery's close does when Redis goes away
        with pytest.raises(redis.exceptions.ConnectionError, match="connection is closed"):
            channel._connparams()
        assert isinstance(redis.exceptions.ConnectionError(), tuple(conn.connection_errors))


@pytest.mark.slow
def test_a_node_refuses_to_start_without_a_required_sandbox_layer(
    settings: Settings, start_node: Any
) -> None:
    """WM_SANDBOX_REQUIRE: a node that could not sandbox Python workers as demanded never
    takes work (here the demand names a layer no host has)."""
    with pytest.raises(AssertionError, match="exited") as exited:
        start_node(settings, WM_SANDBOX_REQUIRE="teleportation")
    assert "Unrecoverable error: ConfigurationError" in str(exited.value)
    assert "WM_SANDBOX_REQUIRE names unknown layers ['teleportation']" in str(exited.value)
