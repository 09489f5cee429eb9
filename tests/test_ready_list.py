"""The Redis ready list (``WM_READY_LIST``): a node waits on one list naming the worker
queues that hold messages, so its cost per message does not grow with its queues.

The channel-level tests drive kombu's consumer loop (BRPOP, then the take script) against
the real broker database; the node-level tests run real Celery nodes.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Consumer, Producer
from kombu.asynchronous import Hub

from tests.conftest import AMQP_URL, BROKER_DB, STATE_DB, flush_redis, make_settings
from tests.helpers import STUB, command_calls, drain, eventually, stub
from wm import Settings, WorkManager, make_event
from wm.dataplane import liveness, placement
from wm.dataplane.app import celery_settings, make_app
from wm.dataplane.batches import ready_batch
from wm.dataplane.queues import (
    DELIVER_TASK,
    EXCHANGE,
    READY_LIST,
    delivery_labels,
    is_worker_queue,
    subscription_queue,
)
from wm.dataplane.readybatch import TaskTexts
from wm.dataplane.readyscripts import PUT_MESSAGES
from wm.dataplane.takenfacts import KEY_HEADER
from wm.dataplane.transport import refill_at
from wm.events import encode


@pytest.fixture
def broker_settings(tmp_path: Path, redis_ok: None) -> Iterator[Settings]:
    flush_redis(BROKER_DB, STATE_DB)
    yield make_settings(f"sqlite:///{tmp_path / 'wm.db'}")
    flush_redis(BROKER_DB, STATE_DB)


@pytest.fixture
def broker(broker_settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(broker_settings.broker_url)


def worker_queue(topic: str = "t") -> str:
    return f"{topic}::{uuid.uuid4()}"


def publish(settings: Settings, queue: str, count: int, start: int = 0) -> None:
    with make_app(settings).connection_for_write() as conn:
        producer = Producer(conn.default_channel)
        for n in range(start, start + count):
            producer.publish(
                {"queue": queue, "n": n},
                exchange=EXCHANGE,
                routing_key=queue,
                declare=[subscription_queue(queue)],
            )


def body_of(item: bytes) -> Any:
    return json.loads(base64.b64decode(json.loads(item)["body"]))


class Reader:
    """A kombu consumer of ``queues`` on the settings' transport: kombu's BRPOP loop
    (``prefetch``: the most messages it holds unacknowledged; None: no limit)."""

    def __init__(self, settings: Settings, queues: list[str], prefetch: int | None = None) -> None:
        self.conn = make_app(settings).connection_for_read()
        self.channel = self.conn.default_channel
        if prefetch is not None:
            self.channel.basic_qos(0, prefetch, False)
        self.received: list[dict[str, Any]] = []
        self.messages: list[Any] = []
        self.consumer = Consumer(
            self.channel,
            queues=[subscription_queue(q) for q in queues],
            callbacks=[self._on_message],
            accept=["json"],
        )
        self.consumer.consume()

    def _on_message(self, body: Any, message: Any) -> None:
        self.received.append(body)
        self.messages.append(message)

    def read(self, count: int, timeout_s: float = 10) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while len(self.received) < count and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                self.conn.drain_events(timeout=0.2)
        return self.received

    def close(self) -> None:
        self.consumer.cancel()
        self.conn.release()


def test_worker_queues_only_go_through_the_ready_list() -> None:
    assert is_worker_queue(f"topic::{uuid.uuid4()}")
    assert not is_worker_queue(f"topic::sub::{uuid.uuid4()}")  # a plain subscription
    assert not is_worker_queue("wm.default") and not is_worker_queue("topic::not-a-uuid")


def test_a_publish_lists_its_queue_once(broker_settings: Settings, broker: redis.Redis) -> None:
    queue = worker_queue()
    publish(broker_settings, queue, 3)
    assert broker.llen(queue) == 3
    assert broker.lrange(READY_LIST, 0, -1) == [queue.encode()]


def test_a_publish_batch_pushes_each_queue_in_order_and_lists_it_once(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """A batch holds a queue's messages and pushes them with one script per queue (several
    past ``PUT_MESSAGES``); a queue that already held messages is not listed again."""
    first, second, busy = worker_queue("a"), worker_queue("b"), worker_queue("c")
    publish(broker_settings, busy, 1)
    count = PUT_MESSAGES * 2 + 5
    with make_app(broker_settings).connection_for_write() as conn:
        producer = Producer(conn.default_channel)
        with producer.batch(max_size=count * 3 + 1):  # flushed when the block ends
            for n in range(count):
                for queue in (first, second, busy):
                    producer.publish(
                        {"queue": queue, "n": n},
                        exchange=EXCHANGE,
                        routing_key=queue,
                        declare=[subscription_queue(queue)],
                    )
            assert broker.llen(first) == 0, "held until the batch ends"
    for queue, numbers in ((first, range(count)), (second, range(count)), (busy, [0])):
        assert broker.llen(queue) == len(numbers) + (count if queue == busy else 0)
        oldest = [body_of(item)["n"] for item in reversed(broker.lrange(queue, 0, -1))]
        assert oldest[: len(numbers)] == list(numbers)
    assert sorted(broker.lrange(READY_LIST, 0, -1)) == sorted(
        q.encode() for q in (first, second, busy)
    )


@pytest.mark.parametrize("kwargs", [{}, {"seq": 3}], ids=["no keyword arguments", "numbered"])
def test_a_task_held_directly_is_the_text_kombu_would_push(
    broker_settings: Settings, broker: redis.Redis, kwargs: dict[str, Any]
) -> None:
    """``publish_many`` holds most task messages with ``ReadyBatch.put_text``, their text made
    by ``TaskTexts`` from a template: each is, character for character, the message
    ``Producer.publish`` pushes for Celery's ``as_task_v2`` of the same task (but its
    delivery tag), for labels and an event with quotes, escapes and non-ASCII text; and in
    a batch it follows, in the queue's order, a publish that declared the queue."""
    queue = worker_queue()
    app = make_app(broker_settings)
    payload = encode(make_event("t", "/src", {"é": [1, None], 'q"\\': "\u2028\n"}, id='1"'))
    labels = delivery_labels("t\u00e9", 'w"', 'id"\\', "t", 1, payload)
    texts = TaskTexts(app, "gen1@host")
    task_id = texts.task_id()
    message = app.amqp.as_task_v2(
        task_id, DELIVER_TASK, ["w", payload], kwargs, origin="gen1@host", **labels
    )
    message.headers[KEY_HEADER] = 'k"\u00e9'
    with app.producer_or_acquire() as producer:
        producer.publish(  # as Deliveries.send publishes a queue's first message
            message.body,
            exchange=EXCHANGE.name,
            routing_key=queue,
            declare=[subscription_queue(queue)],
            serializer="json",
            delivery_mode=2,
            headers=message.headers,
            **message.properties,
        )
        with producer.batch(max_size=10):
            held = ready_batch(producer)
            assert held is not None and held.takes(queue)
            text = texts.text(queue, task_id, ["w", payload], kwargs, labels, 'k"\u00e9')
            held.put_text(queue, text)
            held.put_text(queue, texts.text(queue, texts.task_id(), ["w", "last"], {}, labels))
    pushed = [item.decode() for item in reversed(broker.lrange(queue, 0, -1))]
    assert len(pushed) == 3
    tag = re.compile(r'"delivery_tag": "[^"]+"')
    assert len({tag.search(text)[0] for text in pushed}) == 3  # type: ignore[index]
    assert tag.sub("", pushed[1]) == tag.sub("", pushed[0])
    reader = Reader(broker_settings, [queue])
    try:
        assert [body[0] for body in reader.read(3)] == [["w", payload]] * 2 + [["w", "last"]]
    finally:
        reader.close()


def test_task_ids_are_unique_uuids(broker_settings: Settings) -> None:
    """``TaskTexts.task_id``: the last four hex digits count under a random prefix, drawn
    again when they run out."""
    texts = TaskTexts(make_app(broker_settings), "gen1@host")
    ids = [texts.task_id() for _ in range(0x10000 + 2)]
    assert len(set(ids)) == len(ids)
    assert all(uuid.UUID(found).version == 4 for found in ids[::0x1000])
    assert ids[0][:-4] == ids[0xFFFF][:-4] != ids[0x10000][:-4]


def test_a_producer_without_a_batch_or_on_rabbitmq_has_no_ready_batch(
    broker_settings: Settings,
) -> None:
    with make_app(broker_settings).producer_or_acquire() as producer:
        assert ready_batch(producer) is None
    amqp = broker_settings.replace(broker_url=AMQP_URL)
    with make_app(amqp).producer_or_acquire() as producer, producer.batch(max_size=2):
        assert ready_batch(producer) is None


def test_busy_queues_are_served_in_turn_and_the_list_empties(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    first, second = worker_queue("a"), worker_queue("b")
    publish(broker_settings, first, 4)
    publish(broker_settings, second, 4)
    reader = Reader(broker_settings, [first, second])
    try:
        got = reader.read(8)
        for message in reader.messages:
            message.ack()
    finally:
        reader.close()
    order = [body["queue"] for body in got]
    assert order == [first, second] * 4, "round robin over busy queues"
    assert [body["n"] for body in got if body["queue"] == first] == [0, 1, 2, 3]
    assert broker.llen(READY_LIST) == 0


def test_a_name_lost_with_its_node_is_listed_again_by_the_repair(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """A node that popped a queue's name and died before taking: the queue waits unseen
    until the maintaining node's repair lists it again."""
    queue = worker_queue()
    reader = Reader(broker_settings, [queue])
    publish(broker_settings, queue, 2)
    assert broker.rpop(READY_LIST) == queue.encode()  # the node that died
    try:
        assert reader.read(1, timeout_s=1.5) == []
        with make_app(broker_settings).connection_for_write() as conn:
            channel = conn.default_channel
            assert channel.repair_ready([queue, worker_queue()]) == 1
        assert [body["n"] for body in reader.read(2)] == [0, 1]
    finally:
        reader.close()


def test_a_queue_nobody_reads_waits_and_is_listed_when_consumed(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """A node pops the name of a queue it does not consume (a stopped worker's): it leaves
    the messages unlisted; the node that starts consuming the queue lists it."""
    other, stopped = worker_queue("other"), worker_queue("stopped")
    publish(broker_settings, stopped, 2)
    reader = Reader(broker_settings, [other])
    try:
        assert reader.read(1, timeout_s=1.5) == []
    finally:
        reader.close()
    assert broker.llen(stopped) == 2 and broker.llen(READY_LIST) == 0

    later = Reader(broker_settings, [stopped])
    try:
        assert [body["n"] for body in later.read(2)] == [0, 1]
    finally:
        later.close()


@pytest.mark.parametrize("prefetch", [None, 8])
def test_a_backlog_is_taken_without_blocking_and_leaves_queues_it_does_not_consume(
    broker_settings: Settings, broker: redis.Redis, prefetch: int | None
) -> None:
    """While names wait, a node takes names and messages in one script (as many messages
    as its prefetch window has room for); a message of a queue it does not consume goes
    back, in order, and its name off the list."""
    busy, stopped = worker_queue("busy"), worker_queue("stopped")
    publish(broker_settings, busy, 3)
    publish(broker_settings, stopped, 3)
    publish(broker_settings, busy, 3, start=3)
    reader = Reader(broker_settings, [busy], prefetch)
    try:
        assert [body["n"] for body in reader.read(6)] == [0, 1, 2, 3, 4, 5]
        assert reader.read(7, timeout_s=1) == reader.received[:6]
        for message in reader.messages:
            message.ack()
    finally:
        reader.close()
    assert broker.lrange(READY_LIST, 0, -1) == [], (busy, stopped)
    left = [body_of(item)["n"] for item in broker.lrange(stopped, 0, -1)]
    assert left == [2, 1, 0]  # kombu pops from the right: 0 is still next


def count_takes(reader: Reader) -> list[int]:
    """The number of messages each take without blocking of ``reader`` returns, from now."""
    takes: list[int] = []
    took = reader.channel._took_next

    def counted(reply: Any) -> bool:
        takes.append(len(reply or []))
        return took(reply)

    reader.channel._took_next = counted
    return takes


def test_a_take_without_blocking_takes_what_the_prefetch_window_has_room_for(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """One script takes several messages of a backlog, each as a take of its own would:
    round robin over the listed queues, each queue in order, each recorded as held
    (unacknowledged) before the reply; never more than the window has room for."""
    first, second = worker_queue("a"), worker_queue("b")
    publish(broker_settings, first, 6)
    publish(broker_settings, second, 6)
    reader = Reader(broker_settings, [first, second], prefetch=4)
    takes = count_takes(reader)
    try:
        for held in (4, 8, 12):  # a window's worth, then no more until it is acknowledged
            assert len(reader.read(held)) == held
            assert reader.read(held + 1, timeout_s=1) == reader.received[:held]
            assert broker.hlen("unacked") == 4
            for message in reader.messages[held - 4 : held]:
                message.ack()
    finally:
        reader.close()
    assert max(takes) > 1 and max(takes) <= 4, takes
    assert [body["queue"] for body in reader.received] == [first, second] * 6
    for queue in (first, second):
        mine = [body["n"] for body in reader.received if body["queue"] == queue]
        assert mine == list(range(6)), (queue, mine)
    assert broker.hlen("unacked") == 0 and broker.llen(READY_LIST) == 0


def test_a_node_takes_a_backlog_again_once_its_window_has_room_for_several(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """A node's channel (its pool processes known) takes a backlog again only once its
    prefetch window has room for ``refill_at`` messages, then takes them in one script; with
    no backlog left, a new message is taken at once, whatever the room."""
    queue = worker_queue()
    publish(broker_settings, queue, 12)
    reader = Reader(broker_settings, [queue], prefetch=8)
    reader.channel.processes = 2
    assert refill_at(8, 2) == 3  # half of the six held beyond one message per process
    takes = count_takes(reader)
    try:
        assert len(reader.read(8)) == 8  # one by BRPOP, then seven in one take
        for message in reader.messages[:2]:
            message.ack()
        assert len(reader.read(9, timeout_s=1)) == 8  # room for two: no take
        reader.messages[2].ack()
        assert len(reader.read(11)) == 11 and takes[-1] == 3  # room for three: one take
        for message in reader.messages[3:6]:
            message.ack()
        assert len(reader.read(12)) == 12  # the last one: the backlog is over
        publish(broker_settings, queue, 1, start=12)
        assert len(reader.read(13)) == 13  # room for two, taken at once
        for message in reader.messages[6:]:
            message.ack()
    finally:
        reader.close()
    assert [body["n"] for body in reader.received] == list(range(13))
    eventually(lambda: broker.hlen("unacked") == 0, timeout_s=10, interval_s=0.05)


def test_the_room_a_backlog_take_waits_for() -> None:
    """One message a process (a fair share's shallow prefetch) leaves nothing to wait for;
    a deep window waits for half a take's most at most."""
    assert refill_at(2, 2) == refill_at(1, 1) == refill_at(3, 2) == 1
    assert refill_at(8, 2) == 3 and refill_at(64, 16) == 4


def test_a_message_whose_delivery_fails_keeps_no_other_of_its_take_from_delivery(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """A take of several messages delivers each even when one's delivery raises; the error
    comes out of the take afterwards, as a take of that message alone would raise it."""
    queue = worker_queue()
    publish(broker_settings, queue, 6)
    reader = Reader(broker_settings, [queue], prefetch=4)
    deliver, calls = reader.channel._deliver_item, []

    def failing_once(item: bytes, *args: Any) -> None:
        calls.append(body_of(item)["n"])
        if len(calls) == 3:  # the second of the first backlog take (the first came by BRPOP)
            raise RuntimeError("a delivery failed")
        deliver(item, *args)

    reader.channel._deliver_item = failing_once
    try:
        with pytest.raises(RuntimeError, match="a delivery failed"):
            reader.read(6)
        assert calls == [0, 1, 2, 3], calls  # one take of three after the first message
        assert [body["n"] for body in reader.received] == [0, 1, 3]
    finally:
        reader.close()


def test_a_message_whose_delivery_raises_goes_back_to_the_head_of_its_queue(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """On a node, a message the take recorded as held whose delivery raises before kombu
    took it is not left held (the node's heartbeat would keep it from every other node until
    this one stopped): it is the next one of its queue, and nothing stays held."""
    queue = worker_queue()
    publish(broker_settings, queue, 6)
    liveness.hold_as("node-a")
    reader = Reader(broker_settings, [queue], prefetch=4)
    transport = reader.channel.connection
    deliver, calls = transport._deliver, []

    def failing_once(message: Any, *args: Any) -> None:
        calls.append(message)
        if len(calls) == 3:  # the second of the first backlog take (the first came by BRPOP)
            raise RuntimeError("a delivery failed")
        deliver(message, *args)

    transport._deliver = failing_once
    try:
        with pytest.raises(RuntimeError, match="a delivery failed"):
            reader.read(6)
        assert broker.scard(liveness.held_key("node-a")) == 3  # 0, 1 and 3
        assert broker.hlen("unacked") == 3 and broker.llen(queue) == 3
        for message in reader.messages:  # the window has room for the rest
            message.ack()
        assert [body["n"] for body in reader.read(6)] == [0, 1, 3, 2, 4, 5]
        for message in reader.messages[3:]:
            message.ack()
        # acknowledgements are pipelined on a connection of their own: Redis runs them soon
        eventually(lambda: broker.hlen("unacked") == 0, timeout_s=10, interval_s=0.05)
        assert broker.scard(liveness.held_key("node-a")) == 0
    finally:
        reader.close()
        liveness.hold_as("")


def test_the_event_loop_adds_the_transports_sockets_once_and_again_after_a_lost_connection(
    broker_settings: Settings,
) -> None:
    """In an event loop (a node's), the transport's socket is added to the poller when it is
    new, not again at every turn of the loop; after its connection is lost, the new socket
    is added, and messages still come."""
    queue = worker_queue()
    hub = Hub()
    conn = make_app(broker_settings).connection_for_read()
    received: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body["n"])
        message.ack()

    consumer = Consumer(
        conn.default_channel, queues=[subscription_queue(queue)], callbacks=[on_message]
    )
    registered: list[int] = []
    register = hub.poller.register

    def counted(fd: Any, flags: int) -> Any:
        registered.append(fd if isinstance(fd, int) else fd.fileno())
        return register(fd, flags)

    hub.poller.register = counted
    try:
        consumer.consume()
        conn.transport.register_with_event_loop(conn.connection, hub)

        def turn_until(count: int) -> None:
            deadline = time.monotonic() + 10
            while len(received) < count and time.monotonic() < deadline:
                hub.run_once()

        def socket() -> int:
            return int(conn.default_channel.client.connection._sock.fileno())

        for _ in range(3):
            hub.run_once()
        publish(broker_settings, queue, 2)
        turn_until(2)
        assert received == [0, 1]
        # kombu's poller registers it, the loop's reader once: not once a turn
        assert registered.count(socket()) == 2, registered
        conn.default_channel.client.connection.disconnect()  # kombu's hook: out of the loop
        before = len(registered)
        publish(broker_settings, queue, 2, start=2)
        turn_until(4)
        assert received == [0, 1, 2, 3]
        assert registered[before:].count(socket()) == 2, registered
    finally:
        consumer.cancel()
        conn.release()
        hub.close()


def test_an_unacknowledged_message_restored_is_listed_again(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    queue = worker_queue()
    publish(broker_settings, queue, 1)
    reader = Reader(broker_settings, [queue])
    try:
        assert len(reader.read(1)) == 1
        assert broker.llen(READY_LIST) == 0
        reader.messages[0].requeue()  # kombu's restore: back in the queue, in one transaction
        assert broker.lrange(READY_LIST, 0, -1) == [queue.encode()]
        assert len(reader.read(2)) == 2
        assert reader.received[0] == reader.received[1]
        reader.messages[1].ack()
    finally:
        reader.close()


@pytest.fixture
def placed() -> Iterator[tuple[str, str]]:
    """This process places as node ``me`` of the live nodes ``me`` and ``other`` (a spill of
    20); yields their names."""
    view = placement.VIEW
    saved = view.node, view.spill, view.nodes
    view.node, view.spill, view.nodes = "me", 20, ("me", "other")
    yield "me", "other"
    view.node, view.spill, view.nodes = saved


def placed_queue(topic: str, node: str, nodes: tuple[str, ...]) -> str:
    """A worker queue of ``topic`` that placement puts on ``node``."""
    while True:
        queue = worker_queue(topic)
        if placement.owner(queue, nodes) == node:
            return queue


def test_a_name_in_the_inbox_of_a_queue_the_node_does_not_consume_leaves_the_inbox(
    broker_settings: Settings, broker: redis.Redis, placed: tuple[str, str]
) -> None:
    """A queue placed on this node that it does not consume (its worker stopped): its
    messages go back in order and its name leaves the inbox, where it would be popped again
    at every take for as long as the node runs."""
    me, _ = placed
    busy, stopped = (placed_queue(topic, me, placed) for topic in ("busy", "stopped"))
    inbox = placement.inbox_key(READY_LIST, me)
    publish(broker_settings, stopped, 3)
    publish(broker_settings, busy, 3)
    for queue in (stopped, busy):  # where another node's take puts a name placed here
        broker.lrem(READY_LIST, 0, queue)
        broker.lpush(inbox, queue)
    reader = Reader(broker_settings, [busy])
    try:
        assert [body["n"] for body in reader.read(3)] == [0, 1, 2]
        assert reader.read(4, timeout_s=1) == reader.received[:3]
        for message in reader.messages:
            message.ack()
    finally:
        reader.close()
    assert broker.lrange(inbox, 0, -1) == [] and broker.llen(READY_LIST) == 0
    assert [body_of(item)["n"] for item in broker.lrange(stopped, 0, -1)] == [2, 1, 0]


def test_the_repair_leaves_a_name_held_in_a_live_nodes_inbox_listed_once(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """A name in the inbox of a member of placement is listed; one in the inbox of a node
    that is no member (gone) is not, and the repair lists it."""
    held, orphaned = worker_queue("held"), worker_queue("orphaned")
    broker.zadd(placement.members_key(READY_LIST), {"other": time.time() * 1000 + 60_000})
    for queue, node in ((held, "other"), (orphaned, "gone")):
        publish(broker_settings, queue, 2)
        broker.lrem(READY_LIST, 0, queue)
        broker.lpush(placement.inbox_key(READY_LIST, node), queue)
    with make_app(broker_settings).connection_for_write() as conn:
        assert conn.default_channel.repair_ready([held, orphaned]) == 1
    assert broker.lrange(READY_LIST, 0, -1) == [orphaned.encode()]


def test_raw_bytes_pushed_past_the_transport_reach_the_reader_after_a_repair(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """A client writing to the list directly lists nothing; the repair does."""
    queue = worker_queue()
    broker.lpush(queue, b"\xff not a kombu message")
    assert broker.llen(READY_LIST) == 0
    with make_app(broker_settings).connection_for_write() as conn:
        assert conn.default_channel.repair_ready([queue]) == 1
    reader = Reader(broker_settings, [queue])
    try:
        reader.consumer.accept = None  # the node's consumer parks what it cannot decode
        reader.read(1)
    finally:
        reader.close()
    assert reader.messages and reader.messages[0].content_type == "application/octet-stream"


def test_without_the_ready_list_nothing_is_listed(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    plain = broker_settings.replace(ready_list=False)
    queue = worker_queue()
    publish(plain, queue, 2)
    assert broker.llen(queue) == 2 and not broker.exists(READY_LIST)
    reader = Reader(plain, [queue])
    try:
        assert [body["n"] for body in reader.read(2)] == [0, 1]
    finally:
        reader.close()


@pytest.mark.slow
def test_a_rolling_switch_in_either_direction_loses_nothing(
    pg_settings: Settings, start_node: Any
) -> None:
    """A publisher without the ready list feeds a node that waits on it (the maintaining
    node's repair, every reconcile period, lists the queue), and a publisher with it feeds a
    node without it (kombu's BRPOP names the queue itself)."""
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    old = settings.replace(ready_list=False)
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    queue = f"in::{worker.id}"

    node = start_node(settings)
    node.consuming(queue)
    WorkManager(old).publish(make_event("in", "/old-publisher", {"n": 1}))
    assert len(drain(settings, sink, 1)) == 1
    node.wait_for("in the ready list again")
    node.stop()

    old_node = start_node(old, name="old")
    old_node.consuming(queue)
    manager.publish(make_event("in", "/new-publisher", {"n": 2}))
    assert len(drain(settings, sink, 1)) == 1


def test_the_ready_list_is_on_by_default_and_reaches_redis_brokers_only() -> None:
    options = celery_settings(Settings.from_env({}))["broker_transport_options"]
    assert options["ready_key"] == READY_LIST
    off = Settings.from_env({"WM_READY_LIST": "false"})
    assert celery_settings(off)["broker_transport_options"]["ready_key"] is None
    amqp = Settings.from_env({"WM_BROKER_URL": AMQP_URL})
    assert "ready_key" not in celery_settings(amqp)["broker_transport_options"]


def test_the_queues_consumed_are_kept_between_changes_and_follow_each_change(
    broker_settings: Settings,
) -> None:
    """``active_queues`` (read several times per message) is built once per change of the
    consumers, not per read, and follows every consume and cancel."""
    first, second = worker_queue("a"), worker_queue("b")
    reader = Reader(broker_settings, [first])
    channel = reader.channel
    try:
        assert channel.active_queues == {first}
        assert channel.active_queues is channel.active_queues  # kept, not built per read
        later = Consumer(channel, queues=[subscription_queue(second)], accept=["json"])
        later.consume()
        assert channel.active_queues == {first, second}
        reader.consumer.cancel()
        assert channel.active_queues == {second}
        later.cancel()
        assert channel.active_queues == frozenset()
    finally:
        reader.conn.release()


def test_queues_added_together_are_listed_in_one_round_trip_and_not_counted(
    broker_settings: Settings, broker: redis.Redis
) -> None:
    """A node adding many queues at once (its first reconcile, its recovery's declares)
    lists those that waited with messages in one pipeline at the end, not in two round trips
    a queue, and does not count each queue's messages: one round trip a queue is left, its
    binding. Each queue that waited is listed once and read."""
    waiting = [worker_queue(f"w{n}") for n in range(6)]
    empty = [worker_queue(f"e{n}") for n in range(6)]
    for queue in waiting:
        publish(broker_settings, queue, 1)
    broker.delete(READY_LIST)  # their names popped by a node that does not consume them
    reader = Reader(broker_settings, [])
    channel = reader.channel
    before = command_calls(broker)
    with channel.adding_together():
        for queue in [*waiting, *empty]:
            Consumer(
                channel, queues=[subscription_queue(queue)], callbacks=[reader._on_message]
            ).consume()
        assert broker.llen(READY_LIST) == 0  # nothing listed before the end
    spent = command_calls(broker) - before
    try:
        assert spent["script|exists"] <= 1
        assert spent["evalsha"] == len(waiting) + len(empty)
        assert spent["exec"] == len(waiting) + len(empty)  # the bindings
        assert sorted(broker.lrange(READY_LIST, 0, -1)) == sorted(q.encode() for q in waiting)
        assert sorted(body["queue"] for body in reader.read(len(waiting))) == sorted(waiting)
    finally:
        reader.close()
