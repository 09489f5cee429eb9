"""The Celery application. A node starts with ``celery -A wm.celeryapp worker``."""

from __future__ import annotations

from typing import Any

from celery import Celery, signals
from kombu.entity import Exchange, Queue

from wm.config import Settings

#: Direct exchange every subscription queue is bound to (routing key = queue name).
EXCHANGE = Exchange("wm", type="direct", durable=True)
#: Queue of WorkManager's own tasks (dead-letter replay, maintenance).
DEFAULT_QUEUE = "wm.default"
DELIVER_TASK = "wm.deliver"


def subscription_queue(name: str) -> Queue:
    """The durable queue of one subscription."""
    return Queue(name, EXCHANGE, routing_key=name, durable=True)


def celery_settings(settings: Settings) -> dict[str, Any]:
    """Celery configuration derived from WorkManager settings (``celeryconfig`` uses it)."""
    return {
        "broker_url": settings.broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
            # Redis: look for a lost node's unacknowledged messages often, every sweep, and
            # never let a killed node's sweep mutex block the others for long.
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout_s // 2)),
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 30,
            "confirm_publish": True,
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
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_default_queue": DEFAULT_QUEUE,
        "task_default_exchange": EXCHANGE.name,
        "task_default_exchange_type": "direct",
        "task_default_routing_key": DEFAULT_QUEUE,
        "task_queues": [subscription_queue(DEFAULT_QUEUE)],
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }


def make_app(settings: Settings | None = None) -> Celery:
    """A Celery app for ``settings`` (default: the environment, via ``celeryconfig``)."""
    app = Celery("wm", include=["wm.tasks"])
    if settings is None:
        app.config_from_object("celeryconfig")
    else:
        app.conf.update(celery_settings(settings))
    app.steps["consumer"].add("wm.node:Reconciler")
    return app


# Node hooks are connected here, in the module ``celery -A wm.celeryapp`` imports first
# (the worker imports the ``include`` modules only later).
@signals.worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    from wm.node import on_process_init

    on_process_init()


@signals.worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    from wm.node import on_process_shutdown

    on_process_shutdown()


app = make_app()
