"""Pipelined acknowledgements (``wm.dataplane.liveness.Acks``) against a real Redis: none is
lost when its connection is killed with replies unread, and a threads pool's threads may
acknowledge at once."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace
from typing import Any

import redis

from tests.conftest import BROKER_DB, REDIS_HOST, flush_redis
from wm.dataplane.liveness import HOLDERS_KEY, Acks, held_key

NODE = "node-a"
KEYS = ["unacked", "unacked_index", HOLDERS_KEY, held_key(NODE)]


def _held(client: redis.Redis, tags: list[str]) -> None:
    """Messages held by NODE, as a take leaves them."""
    pipe = client.pipeline()
    for tag in tags:
        pipe.hset("unacked", tag, "{}").zadd("unacked_index", {tag: 1}).hset(HOLDERS_KEY, tag, NODE)
        pipe.sadd(held_key(NODE), tag)
    pipe.execute()


def _acks(url: str) -> tuple[Acks, Any]:
    pool = redis.ConnectionPool.from_url(url)
    errors = (redis.ConnectionError, redis.TimeoutError, socket.error)
    return Acks(SimpleNamespace(pool=pool, connection_errors=errors)), pool


def test_acknowledgements_sent_before_their_connection_was_killed_are_not_lost(
    redis_ok: None,
) -> None:
    flush_redis(BROKER_DB)
    url = f"{REDIS_HOST}/{BROKER_DB}"
    client = redis.Redis.from_url(url)
    tags = [f"t{n}" for n in range(300)]
    _held(client, tags)
    acks, pool = _acks(url)
    for tag in tags[:150]:
        acks.send(KEYS, [tag, NODE])
    assert acks.unread, "every reply was read at once: nothing is left to lose"
    host, port = acks.connection._sock.getsockname()[:2]
    assert client.client_kill(f"{host}:{port}")  # its connection alone, replies unread
    for tag in tags[150:]:
        acks.send(KEYS, [tag, NODE])
    acks.close()
    assert client.hlen("unacked") == 0
    assert client.zcard("unacked_index") == 0
    assert client.scard(held_key(NODE)) == 0
    pool.disconnect()


def test_threads_acknowledging_at_once_lose_nothing(redis_ok: None) -> None:
    flush_redis(BROKER_DB)
    url = f"{REDIS_HOST}/{BROKER_DB}"
    client = redis.Redis.from_url(url)
    tags = [f"t{n}" for n in range(800)]
    _held(client, tags)
    acks, pool = _acks(url)
    failed: list[BaseException] = []

    def ack(part: list[str]) -> None:
        try:
            for tag in part:
                acks.send(KEYS, [tag, NODE])
        except BaseException as exc:  # reported below
            failed.append(exc)

    threads = [threading.Thread(target=ack, args=(tags[n::4],)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    acks.close()
    assert failed == []
    assert client.hlen("unacked") == 0
    assert client.scard(held_key(NODE)) == 0
    pool.disconnect()
