"""The Celery app factory, its settings, and the one translation of broker errors."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from amqp.exceptions import AMQPError, PreconditionFailed
from celery import Celery
from celery.app.amqp import AMQP
from kombu.connection import Connection
from kombu.exceptions import KombuError
from kombu.messaging import Consumer
from redis.connection import parse_url

from wm import sentinelurl
from wm.config import Settings, deployment_name, masked
from wm.dataplane.queues import DEFAULT_QUEUE, EXCHANGE, READY_LIST, subscription_queue
from wm.errors import BrokerUnavailable, ConfigurationError
from wm.state.connection import CLUSTER_BROKER, cluster_refusal

#: Errors of kombu, py-amqp, redis (a Redis broker) and the sockets under them: the broker
#: is unreachable or refused the operation.
BROKER_ERRORS = (OSError, KombuError, AMQPError, redis.RedisError)

#: The nodes' Redis transport (kombu's, hardened: :mod:`wm.dataplane.transport`).
REDIS_TRANSPORT = "wm.dataplane.transport:Transport"
#: The same through Redis Sentinel (``sentinel://`` broker URLs).
SENTINEL_TRANSPORT = "wm.dataplane.transport:SentinelTransport"


def celery_settings(settings: Settings) -> dict[str, Any]:
    """Celery configuration derived from WorkManager settings (``celeryconfig`` uses it)."""
    return {
        "broker_url": _kombu_url(settings.broker_url),
        "broker_connection_retry_on_startup": True,
        "broker_channel_error_retry": True,  # only wm.dataplane.consumer.PASSING_CHANNEL_ERRORS
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
            # Redis: look for a lost node's unacknowledged messages often, every sweep, and
            # never let a killed node's sweep mutex block the others for long.
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout_s // 2)),
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 30,
            "confirm_publish": True,
            **_redis_options(settings),
        },
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": settings.prefetch_multiplier,
        "worker_concurrency": settings.node_concurrency or None,
        "worker_send_task_events": settings.task_events,
        "task_send_sent_event": settings.task_events,
        "task_default_queue": DEFAULT_QUEUE,
        "task_default_exchange": EXCHANGE.name,
        "task_default_routing_key": DEFAULT_QUEUE,
        "task_default_exchange_type": "direct",
        "task_queues": [subscription_queue(DEFAULT_QUEUE, settings)],
        # ``celery -A wm.celeryapp beat``: WorkManager's schedules (wm.dataplane.beat)
        "beat_scheduler": "wm.dataplane.beat:DatabaseScheduler",
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # Messages that are no delivery are parked, never dropped, never fatal.
        "worker_consumer": "wm.dataplane.consumer:Consumer",
        **control_exchanges(settings),
        **_redis_transport(settings.broker_url),
    }


def control_exchanges(settings: Settings) -> dict[str, str]:
    """The deployment's own remote control (``add_consumer``, ping, Flower's commands) and
    event exchanges: Celery's defaults, ``celery`` and ``celeryev``, are shared by every app
    on a RabbitMQ vhost, so nodes would hear another deployment's broadcasts. Nodes, the
    CLI and Flower (``celery -A wm.celeryapp flower``) build their app from the same
    settings, so they meet on the same names."""
    name = deployment_name(settings)
    return {"control_exchange": f"wm.{name}", "event_exchange": f"wm.{name}.events"}


def redis_broker(broker_url: str) -> bool:
    """True when the broker is Redis (kombu's Redis transport), itself or through Sentinel."""
    return broker_url.startswith(("redis://", "rediss://")) or sentinelurl.is_sentinel(broker_url)


def shared_server(settings: Settings) -> tuple[int, int] | None:
    """(the state store's database, the broker's) where the broker is a database of the
    state store's own Redis server, so one script reaches both (no Sentinel: each may fail
    over apart); else None. A broker is never a Redis Cluster node, nor is its server's."""
    if not redis_broker(settings.broker_url) or any(
        sentinelurl.is_sentinel(url) for url in (settings.broker_url, settings.redis_url)
    ):
        return None
    (broker, broker_db), (state, state_db) = map(_server, (settings.broker_url, settings.redis_url))
    return (state_db, broker_db) if broker == state else None


def _server(url: str) -> tuple[tuple[Any, ...], int]:
    """(what names the Redis server of ``url``, its database)."""
    found = parse_url(url)
    db = int(found.pop("db", 0))
    return tuple(sorted((k, str(v)) for k, v in found.items())), db


def broker_connection(settings: Settings, **options: Any) -> Connection:
    """A kombu connection to the broker of ``settings``, whatever its kind."""
    sentinel = sentinelurl.is_sentinel(settings.broker_url)
    return Connection(
        _kombu_url(settings.broker_url),
        transport=SENTINEL_TRANSPORT if sentinel else None,
        transport_options=_sentinel_options(settings.broker_url),
        **options,
    )


def _kombu_url(broker_url: str) -> str:
    if sentinelurl.is_sentinel(broker_url):
        return sentinelurl.kombu_url(broker_url)
    return broker_url


def _sentinel_options(broker_url: str) -> dict[str, Any]:
    if sentinelurl.is_sentinel(broker_url):
        return {"master_name": sentinelurl.parse(broker_url).master_name}
    return {}


def _redis_options(settings: Settings) -> dict[str, Any]:
    """Transport options only kombu's Redis transport reads. Its priority levels are lists
    per queue that every BRPOP names (WM_PRIORITY_STEPS); RabbitMQ keeps priorities inside
    one queue (``x-max-priority``, which WorkManager does not declare) and is unaffected."""
    if redis_broker(settings.broker_url):
        return {
            "priority_steps": list(settings.priority_steps),
            "ready_key": READY_LIST if settings.ready_list else None,
            "wait_replicas": settings.broker_wait_replicas,
            "wait_timeout_ms": settings.redis_wait_timeout_ms,
            **_sentinel_options(settings.broker_url),
        }
    if settings.broker_wait_replicas:
        raise ConfigurationError(
            f"WM_BROKER_WAIT_REPLICAS={settings.broker_wait_replicas} applies to a Redis broker "
            f"only, not WM_BROKER_URL={masked(settings.broker_url)} (on RabbitMQ, "
            "WM_AMQP_QUEUE_TYPE=quorum replicates a message before the broker confirms it); set it "
            "to 0"
        )
    return {}


def _redis_transport(broker_url: str) -> dict[str, Any]:
    if sentinelurl.is_sentinel(broker_url):
        return {"broker_transport": SENTINEL_TRANSPORT}
    if redis_broker(broker_url):
        return {"broker_transport": REDIS_TRANSPORT}
    return {}


class BrokerConnection(Connection):
    """kombu's connection, naming WorkManager's Redis transport by the URL's scheme.

    kombu writes a connection's URL (``as_uri``, built from ``info``) with the transport's
    name as its scheme, ``wm.dataplane.transport:Transport://…``, which no reader of
    broker URLs knows: Flower's Broker tab answered "'redis' broker is not supported".
    The transport used to connect is unchanged; only its description says ``redis``.
    """

    def info(self) -> dict[str, Any]:
        """Connection info with ``transport`` ``redis`` or ``rediss`` for our transport."""
        info: dict[str, Any] = super().info()
        if info["transport"] == REDIS_TRANSPORT:
            info["transport"] = "rediss" if self.ssl else "redis"
        elif info["transport"] == SENTINEL_TRANSPORT:
            info["transport"] = "sentinel"
        return info


class CallbackFirstConsumer(Consumer):
    """kombu's consumer, which starts consuming only once it has a callback.

    A node's task consumer gets its callback when the event loop starts, and the loop then
    consumes every queue the consumer holds. A queue added before that (an ``add_consumer``
    heard while a later bootstep still starts) would be consumed at once: on RabbitMQ its
    backlog reaches the consumer at the next frame the connection reads, and kombu's
    ``NotImplementedError: Consumer does not have any callbacks`` ends the node. Such a queue is
    held, declared, until the loop's ``consume``."""

    def consume(self, no_ack: bool | None = None) -> None:
        if self.on_message is None and not self.callbacks:
            return
        super().consume(no_ack)


class BrokerAMQP(AMQP):
    """Celery's messaging helpers, with connections that say which broker they reach and
    consumers that wait for their callback."""

    Connection = BrokerConnection
    Consumer = CallbackFirstConsumer


class _WaitsInTheNode(logging.Filter):
    """Celery warns at every countdown sent to a quorum queue on a direct exchange that it
    "may block the worker process until the ETA arrives": WorkManager means it so (a retry
    waits in the node, as on classic queues: docs/guides/replicated-brokers.md)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "not supported with native delayed delivery" not in record.getMessage()


_WAITS_IN_THE_NODE = _WaitsInTheNode()


def make_app(settings: Settings | None = None) -> Celery:
    """A Celery app for ``settings`` (default: the environment, via ``celeryconfig``).

    The consumer task and the node's bootstep are named, not imported, so building an app
    (an admin script publishing an event) loads neither.
    """
    app = Celery("wm", amqp=BrokerAMQP, include=["wm.dataplane.tasks", "wm.dataplane.probes"])
    logging.getLogger("celery.app.base").addFilter(_WAITS_IN_THE_NODE)  # once: it is one object
    if settings is None:
        app.config_from_object("celeryconfig")
    else:
        app.conf.update(celery_settings(settings))
    app.steps["consumer"].add("wm.dataplane.node:Reconciler")
    return app


@contextmanager
def broker_errors(settings: Settings) -> Iterator[None]:
    """Turn a broker error raised inside the block into :class:`BrokerUnavailable`."""
    try:
        yield
    except BROKER_ERRORS as exc:
        shown = masked(settings.broker_url)
        if cluster_refusal(exc):
            raise ConfigurationError(f"WM_BROKER_URL ({shown}) {CLUSTER_BROKER}") from exc
        if isinstance(exc, PreconditionFailed):
            raise ConfigurationError(
                f"the broker at WM_BROKER_URL={shown} refused a queue as declared ({exc}); a "
                "queue keeps the type it was made with: WM_AMQP_QUEUE_TYPE must say the type "
                "the deployment's queues have (new queues, or a new vhost, to change it)"
            ) from exc
        raise BrokerUnavailable(
            f"the broker at WM_BROKER_URL={shown} is unreachable ({exc}); start it or fix "
            "the setting"
        ) from exc
