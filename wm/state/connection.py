"""The Redis connection for derived state, and the one translation of Redis errors.

WM_REDIS_URL may name a single Redis or any node of a Redis Cluster: :func:`redis_for` asks
the server once per process (``INFO cluster``) and returns a :class:`redis.cluster.RedisCluster`
for a cluster. Every key the state store writes carries a hash tag, so each script, MGET and
transaction touches one slot; docs/guides/nodes.md ("Redis Cluster") lists which tag each key has.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeAlias

import redis
from kombu.utils.url import maybe_sanitize_url
from redis.client import Pipeline
from redis.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import MovedError, RedisClusterException
from redis.sentinel import Sentinel

from wm import sentinelurl
from wm.config import Settings, masked
from wm.errors import BrokerUnavailable, ConfigurationError
from wm.state.packing import connection_options

#: A client of the state store: one server, or a cluster.
StateRedis: TypeAlias = redis.Redis | RedisCluster
#: A pipeline of either (queue scripts with :func:`queue_eval`: cluster pipelines lack EVAL).
StatePipeline: TypeAlias = Pipeline | ClusterPipeline

#: Seconds a new connection may take before the server counts as unreachable.
_CONNECT_TIMEOUT_S = 5
#: Seconds between checks that an idle pooled connection is still alive.
_HEALTH_CHECK_INTERVAL_S = 30

#: This process's clients (pools do not survive fork: a child starts without them).
_clients: dict[tuple[str, float | None], redis.Redis] = {}
_state_clients: dict[str, StateRedis] = {}
_lock = threading.Lock()


def _forget_clients() -> None:
    """In a forked child: none of the parent's clients, and a lock no thread holds."""
    global _lock
    _clients.clear()
    _state_clients.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_clients)


def redis_for(settings: Settings) -> StateRedis:
    """A pooled client for WM_REDIS_URL, one per process (pools do not survive fork): a
    cluster client when the URL names a node of a Redis Cluster. No socket timeout: the
    group locks block in BLPOP for as long as they may wait.

    The first call in a process asks the server whether it is a cluster node (one
    ``INFO cluster``); an unreachable server raises :class:`BrokerUnavailable` and the next
    call asks again."""
    client = _state_clients.get(settings.redis_url)  # asked on every delivery: no lock
    if client is not None:
        return client
    with _lock:
        client = _state_clients.get(settings.redis_url)
        if client is None:
            with redis_errors(settings):
                client = _connect_state(settings.redis_url)
            _state_clients[settings.redis_url] = client
        return client


def pooled_client(url: str, socket_timeout_s: float | None = None) -> redis.Redis:
    """A pooled client for the (single) Redis server at ``url``, one pool per process, URL
    and timeout. A dead connection is dropped and the next command reconnects; with
    ``socket_timeout_s`` a silent server fails a command after that long instead of hanging
    it."""
    key = (url, socket_timeout_s)
    client = _clients.get(key)
    if client is not None:
        return client
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _single(url, socket_timeout_s)
            _clients[key] = client
        return client


def _single(url: str, socket_timeout_s: float | None) -> redis.Redis:
    if sentinelurl.is_sentinel(url):
        return _sentinel_primary(url, socket_timeout_s)
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=_CONNECT_TIMEOUT_S,
        socket_timeout=socket_timeout_s,
        health_check_interval=_HEALTH_CHECK_INTERVAL_S,
        **connection_options(),
    )


def _sentinel_primary(url: str, socket_timeout_s: float | None) -> redis.Redis:
    """A client of the primary the sentinels of ``url`` name: each new connection asks them
    again, so after a failover the pool's next connection reaches the new primary (one
    whose server is no primary any more is refused with a connection error)."""
    where = sentinelurl.parse(url)
    sentinels = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]
        list(where.sentinels),
        sentinel_kwargs={
            "socket_connect_timeout": _CONNECT_TIMEOUT_S,
            "socket_timeout": _CONNECT_TIMEOUT_S,
        },
    )
    client: redis.Redis = sentinels.master_for(  # type: ignore[no-untyped-call,unused-ignore]
        where.master_name,
        db=where.db,
        password=where.password,
        socket_connect_timeout=_CONNECT_TIMEOUT_S,
        socket_timeout=socket_timeout_s,
        health_check_interval=_HEALTH_CHECK_INTERVAL_S,
        **connection_options(),
    )
    return client


def own_client(settings: Settings, socket_timeout_s: float | None = None) -> StateRedis:
    """A client of WM_REDIS_URL with a pool of its own, for a subscription that keeps its
    connection (taking it from the process's pool would make the pool open another), or a
    command that must not wait on the process's pool. With ``socket_timeout_s`` a silent
    server fails a command after that long."""
    with redis_errors(settings):
        return _connect_state(settings.redis_url, socket_timeout_s)


def _connect_state(url: str, socket_timeout_s: float | None = None) -> StateRedis:
    """A client of the right kind for ``url``, found by asking the server."""
    single = _single(url, socket_timeout_s)
    try:
        enabled = int(single.info("cluster").get("cluster_enabled", 0))
    except redis.ResponseError as exc:
        if "SELECT" in str(exc) and "cluster" in str(exc):
            single.close()
            raise ConfigurationError(
                f"WM_REDIS_URL={maybe_sanitize_url(url)} names a database other than 0, but "
                "it points at a Redis Cluster node and a cluster has only database 0; "
                "drop the database number from the URL"
            ) from exc
        enabled = 0  # INFO refused (an ACL): a single server answers every key anyway
    if not enabled:
        return single
    single.close()
    return RedisCluster.from_url(
        url,
        socket_connect_timeout=_CONNECT_TIMEOUT_S,
        socket_timeout=socket_timeout_s,
        health_check_interval=_HEALTH_CHECK_INTERVAL_S,
    )


#: Why a Redis Cluster cannot be the broker, and what to use instead.
CLUSTER_BROKER = (
    "is a node of a Redis Cluster, and Redis Cluster is not supported as a broker (kombu "
    "keeps a queue's messages, its unacknowledged deliveries and the ready list under keys "
    "of different slots); point WM_BROKER_URL at a single Redis server or RabbitMQ "
    "(WM_REDIS_URL may stay on the cluster)"
)


def refuse_cluster_broker(client: redis.Redis, where: str) -> None:
    """Raise :class:`ConfigurationError` when the broker's server is a Redis Cluster node
    (one ``INFO cluster``; a server that refuses INFO is taken as it comes, and a MOVED
    later says what it is)."""
    try:
        enabled = int(client.info("cluster").get("cluster_enabled", 0))
    except redis.ResponseError:
        return
    if enabled:
        raise ConfigurationError(f"WM_BROKER_URL ({where}) {CLUSTER_BROKER}")


def cluster_refusal(exc: BaseException) -> bool:
    """Whether a Redis error says the server is a cluster node (MOVED, or SELECT of a
    database other than 0)."""
    text = str(exc)
    return isinstance(exc, MovedError) or ("SELECT" in text and "cluster" in text)


def queue_eval(pipe: StatePipeline, script: str, keys: list[str], *args: Any) -> None:
    """Queue a Lua script in ``pipe``; a cluster pipeline sends it to the node of its keys'
    slot (redis-py's cluster pipeline has no ``eval`` method, so the command is spelt out)."""
    pipe.execute_command("EVAL", script, len(keys), *keys, *args)  # type: ignore[no-untyped-call,unused-ignore]


def queue_wait(pipe: StatePipeline, settings: Settings, key: str) -> bool:
    """Queue ``WAIT`` behind the writes queued in ``pipe`` before it, when
    WM_REDIS_WAIT_REPLICAS asks for replicas' acknowledgements; False when it does not (and
    nothing was queued). WAIT counts the writes of its own connection, and a pipeline sends
    what goes to one server on one connection: on a cluster, WAIT goes to the server of
    ``key``'s slot, so ``key`` must be a key the writes to wait for live with."""
    if not settings.redis_wait_replicas:
        return False
    args = ("WAIT", settings.redis_wait_replicas, settings.redis_wait_timeout_ms)
    if isinstance(pipe, ClusterPipeline):
        node = pipe.get_node_from_key(key)  # type: ignore[no-untyped-call,unused-ignore]
        pipe.execute_command(*args, target_nodes=node)  # type: ignore[no-untyped-call,unused-ignore]
    else:
        pipe.execute_command(*args)  # type: ignore[no-untyped-call,unused-ignore]
    return True


def check_wait(settings: Settings, acknowledged: Any, what: str) -> None:
    """Raise :class:`BrokerUnavailable` when fewer replicas than WM_REDIS_WAIT_REPLICAS
    acknowledged ``what`` (a reply of :func:`queue_wait`'s WAIT): the write is on the
    primary, but a failover could lose it."""
    wanted, got = settings.redis_wait_replicas, int(acknowledged)
    if got < wanted:
        raise BrokerUnavailable(
            f"{what} reached {got} replica(s) of the Redis at WM_REDIS_URL="
            f"{maybe_sanitize_url(settings.redis_url)} within WM_REDIS_WAIT_TIMEOUT_MS="
            f"{settings.redis_wait_timeout_ms}, not WM_REDIS_WAIT_REPLICAS={wanted}; "
            "start the missing replicas or lower the setting"
        )


@contextmanager
def redis_errors(settings: Settings) -> Iterator[None]:
    """Turn a Redis error raised inside the block into :class:`BrokerUnavailable`. Keys of
    one command in different cluster slots are a bug in this package, not an outage: that
    error passes untranslated."""
    try:
        yield
    except (redis.RedisError, RedisClusterException) as exc:
        if _cross_slot(exc):
            raise
        where = f"Redis at WM_REDIS_URL={masked(settings.redis_url)}"
        if isinstance(exc, MovedError):
            raise BrokerUnavailable(
                f"{where} is a Redis Cluster node, but it refused INFO, which tells WorkManager "
                f"so ({exc}); allow INFO to the URL's user"
            ) from exc
        raise BrokerUnavailable(
            f"{where} is unreachable ({exc}); start it or fix the setting"
        ) from exc


def _cross_slot(exc: Exception) -> bool:
    message = str(exc)
    return "CROSSSLOT" in message or "same slot" in message or "same key slot" in message


def text(value: Any) -> str:
    """A Redis reply as text (redis-py returns bytes unless told to decode)."""
    return value.decode() if isinstance(value, bytes) else str(value)
