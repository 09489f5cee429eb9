"""The Redis connection for derived state, and the one translation of Redis errors."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from kombu.utils.url import maybe_sanitize_url

from wm.config import Settings
from wm.errors import BrokerUnavailable

_clients: dict[tuple[int, str], redis.Redis] = {}
_lock = threading.Lock()


def redis_for(settings: Settings) -> redis.Redis:
    """A pooled client for WM_REDIS_URL, one pool per process (pools do not survive fork)."""
    key = (os.getpid(), settings.redis_url)
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = redis.Redis.from_url(
                settings.redis_url, socket_connect_timeout=5, health_check_interval=30
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
