"""Redis connections for derived state (routing table, locks, fences, outcomes, leases).

Everything kept here can be rebuilt from PostgreSQL; see ``wm.bus.Router.rebuild``.
"""

from __future__ import annotations

import os
import threading

import redis

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


def unavailable(settings: Settings, exc: Exception) -> BrokerUnavailable:
    """Translate a redis error into the error an operator can act on."""
    return BrokerUnavailable(
        f"Redis at WM_REDIS_URL={settings.redis_url} is unreachable ({exc}); start it or fix "
        "the setting"
    )
