"""The Redis connection for derived state, and the one translation of Redis errors."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.utils.url import maybe_sanitize_url

from wm.config import Settings
from wm.errors import BrokerUnavailable

_clients: dict[tuple[int, str, float | None], redis.Redis] = {}
_lock = threading.Lock()


def redis_for(settings: Settings) -> redis.Redis:
    """A pooled client for WM_REDIS_URL, one pool per process (pools do not survive fork).
    No socket timeout: the group locks block in BLPOP for as long as they may wait."""
    return pooled_client(settings.redis_url)


def pooled_client(url: str, socket_timeout_s: float | None = None) -> redis.Redis:
    """A pooled client for the Redis server at ``url``, one pool per process, URL and
    timeout. A dead connection is dropped and the next command reconnects; with
    ``socket_timeout_s`` a silent server fails a command after that long instead of hanging
    it."""
    key = (os.getpid(), url, socket_timeout_s)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = redis.Redis.from_url(
                url,
                socket_connect_timeout=5,
                socket_timeout=socket_timeout_s,
                health_check_interval=30,
            )
            _clients[key] = client
        return client


@contextmanager
def redis_errors(settings: Settings) -> Iterator[None]:
    """Turn a Redis error raised inside the block into :class:`BrokerUnavailable`."""
    try:
        yield
    except redis.RedisError as exc:
        raise BrokerUnavailable(
            f"Redis at WM_REDIS_URL={maybe_sanitize_url(settings.redis_url)} is unreachable "
            f"({exc}); start it or fix the setting"
        ) from exc


def text(value: Any) -> str:
    """A Redis reply as text (redis-py returns bytes unless told to decode)."""
    return value.decode() if isinstance(value, bytes) else str(value)
