"""Pipelined acknowledgements (``wm.dataplane.liveness.Acks``) against a real Redis, on
kombu channels of the node's transport: none is lost with its connection (killed with its
acknowledgements unanswered, or Redis away), none raises into Celery, and a threads pool's
threads may acknowledge on one channel at once."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from tests.conftest import BROKER_DB, REDIS_HOST, flush_redis
from tests.helpers import eventually
from wm.dataplane import liveness
from wm.dataplane.queues import EXCHANGE, subscription_queue
from wm.dataplane.transport import Transport

NODE = "node-a"
#: How long Redis holds the acknowledgements written while it is paused (ms): far longer
#: than the test needs, so none runs before its connection is killed.
PAUSE_MS = 10_000
#: Threads of the pool that acknowledge at once.
THREADS = 8
#: Rounds of acknowledgements from the threads, and how long Redis holds the first ones of
#: each (ms).
THREADS_ROUNDS, THREADS_PAUSE_MS = 4, 150
#: Most seconds a round's threads may take.
THREADS_JOIN_S = 20


@pytest.fixture(autouse=True)
def _no_holder_left() -> Iterator[None]:
    yield
    liveness.hold_as("")


@pytest.fixture
def url(redis_ok: None) -> str:
    flush_redis(BROKER_DB)
    return f"{REDIS_HOST}/{BROKER_DB}"


def _taken(url: str, count: int) -> tuple[Connection, list[Any]]:
    """``count`` messages taken by NODE on one channel, unacknowledged."""
    queue = f"in::{uuid.uuid4()}"
    conn = Connection(url, transport=Transport)
    producer = conn.Producer()
    for n in range(count):
        producer.publish(
            {"n": n}, exchange=EXCHANGE, routing_key=queue, declare=[subscription_queue(queue)]
        )
    liveness.hold_as(NODE)
    channel = conn.channel()
    return conn, [channel.basic_get(queue, no_ack=False) for _ in range(count)]


def _held(broker: redis.Redis) -> int:
    """Messages NODE holds, after checking kombu's and the holders' records agree (read in
    one transaction: acknowledgements written earlier may still be running meanwhile)."""
    with broker.pipeline(transaction=True) as pipe:
        pipe.scard(liveness.held_key(NODE))
        pipe.hlen("unacked")
        pipe.zcard("unacked_index")
        pipe.hlen(liveness.HOLDERS_KEY)
        held, unacked, index, holders = pipe.execute()
    assert unacked == index == holders == held
    return int(held)


def _client_id(broker: redis.Redis, connection: Any) -> int:
    host, port = connection._sock.getsockname()[:2]
    [client] = [c for c in broker.client_list() if c["addr"] == f"{host}:{port}"]
    return int(client["id"])


@pytest.mark.parametrize("noticed_by", ["the next acknowledgement", "the heartbeat"])
def test_acknowledgements_unanswered_when_their_connection_is_killed_are_sent_again(
    url: str, noticed_by: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis holds the acknowledgements written while it is paused, unrun, until their
    connection is killed: they are lost with it unless written again. The first ones, run and
    answered but not read yet, are written again too: the script must leave them alone."""
    conn, messages = _taken(url, 120)
    broker = redis.Redis.from_url(url)
    acks = messages[0].channel.qos.acks
    for message in messages[:20]:
        message.ack()
    assert _held(broker) == 100
    killed = _client_id(broker, acks.connection)
    broker.client_pause(PAUSE_MS, all=False)  # writes wait, CLIENT KILL does not
    try:
        for message in messages[20:60]:
            message.ack()
        assert broker.client_kill_filter(_id=killed) == 1
    finally:
        broker.client_unpause()
    assert _held(broker) == 100  # the 40 were lost with their connection
    if noticed_by == "the heartbeat":
        eventually(lambda: (liveness.flush_acks(), _held(broker) == 60)[1], timeout_s=10)
    for message in messages[60:]:
        message.ack()
    acks.close()
    assert _held(broker) == 0
    assert not acks.unread
    assert killed not in {int(c["id"]) for c in broker.client_list()}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    conn.release()


def test_threads_acknowledging_on_one_channel_at_once_lose_nothing(url: str) -> None:
    """A threads pool: each thread acknowledges its deliveries on the node's one channel.
    In each round Redis, paused, answers none of the first acknowledgements: the threads soon
    wait for replies together, which then come to all of them at once."""
    conn, messages = _taken(url, THREADS_ROUNDS * 200)
    broker = redis.Redis.from_url(url)
    failed: list[BaseException] = []

    def ack(part: list[Any]) -> None:
        try:
            for message in part:
                message.ack()
        except BaseException as exc:  # reported below
            failed.append(exc)

    size = len(messages) // THREADS_ROUNDS
    for first in range(0, len(messages), size):
        batch = messages[first : first + size]
        threads = [
            threading.Thread(target=ack, args=(batch[n::THREADS],), daemon=True)
            for n in range(THREADS)
        ]
        broker.client_pause(THREADS_PAUSE_MS, all=False)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=THREADS_JOIN_S)
        assert not [thread for thread in threads if thread.is_alive()], "threads hung"
    closing = threading.Thread(target=messages[0].channel.qos.acks.close, daemon=True)
    closing.start()
    closing.join(timeout=THREADS_JOIN_S)
    assert not closing.is_alive(), "the close waits for replies that will not come"
    assert failed == []
    assert _held(broker) == 0
    conn.release()


def _down(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_acknowledgements_while_redis_is_away_raise_nothing_and_run_once_it_is_back(
    own_redis: tuple[int, Callable[[], None]],
) -> None:
    """Celery is not told an acknowledgement failed (it would log the message as lost while
    it stays held by a live node): each waits, and the heartbeat sends it when Redis is back."""
    port, restart = own_redis
    url = f"redis://127.0.0.1:{port}/0"
    conn, messages = _taken(url, 30)
    for message in messages[:10]:
        message.ack()
    outage = threading.Thread(target=restart)
    outage.start()
    try:
        eventually(lambda: _down(port), timeout_s=10, interval_s=0.02)
        for message in messages[10:]:
            message.ack()
    finally:
        outage.join()
    broker = redis.Redis.from_url(url)
    assert _held(broker) == 20  # kept across the restart by the append-only file
    eventually(lambda: (liveness.flush_acks(), _held(broker) == 0)[1], timeout_s=10)
    conn.release()
