"""What a Celery node does besides running tasks: recovery at start (one leader per cluster,
lease ``workmanager/recovery/leader``), and a reconcile loop that makes the node consume
exactly the queues of running workers — also after a broker reconnect, when consumers added
at runtime are known to vanish."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from celery import Celery, bootsteps, signals
from sqlalchemy import select

from wm import store
from wm.bus import Bus
from wm.celeryapp import EXCHANGE
from wm.config import Settings
from wm.directory import Directory
from wm.lifecycle import Status
from wm.manager import WorkManager
from wm.models import Subscription, Worker
from wm.state import redis_for

logger = logging.getLogger(__name__)
LEADER_KEY = "workmanager/recovery/leader"
#: Recovery state of this node, for health reporting (seed 000 "Monitoring").
HEALTH = {"recovery": "degraded"}


def running_queues(settings: Settings) -> set[str]:
    """Queues of running workers, from the database (the source of truth)."""
    with store.session_scope(settings) as session:
        rows = session.scalars(
            select(Subscription.queue).join(Worker, Worker.id == Subscription.worker_id)
            .where(Worker.status == Status.RUNNING.value)
        ).all()
    return set(rows)


def recover(settings: Settings, app: Celery) -> bool:
    """Rebuild derived state from the database if this node wins the leader lease."""
    if not settings.worker_recovery_on_start:
        HEALTH["recovery"] = "healthy"
        return False
    redis = redis_for(settings)
    token = str(uuid.uuid4())
    if not redis.set(LEADER_KEY, token, nx=True, ex=settings.worker_recovery_lease_ttl_seconds):
        HEALTH["recovery"] = "healthy"
        logger.info("another node leads recovery")
        return False
    try:
        bus = Bus(settings, app)
        bus.rebuild_routes()
        Directory(settings).invalidate()
        with store.session_scope(settings) as session:
            queues = session.scalars(select(Subscription.queue)).all()
        for queue in queues:
            bus.declare_queue(queue)
        WorkManager(settings, bus=bus).flush_outbox()
        HEALTH["recovery"] = "healthy"
        logger.info("recovery done: %d queue(s) declared", len(queues))
        return True
    except Exception:
        HEALTH["recovery"] = "unhealthy"
        logger.exception("recovery failed")
        raise
    finally:
        if redis.get(LEADER_KEY) == token.encode():
            redis.delete(LEADER_KEY)


def reconcile(consumer: Any, settings: Settings) -> tuple[set[str], set[str]]:
    """Consume every running worker's queue and nothing else; returns (added, cancelled)."""
    wanted = running_queues(settings)
    current = {q.name for q in consumer.task_consumer.queues}
    ours = {name for name in current if "::" in name}
    added, cancelled = wanted - current, ours - wanted
    for name in sorted(added):
        consumer.add_task_queue(name, exchange=EXCHANGE.name, exchange_type="direct",
                                routing_key=name, durable=True)
    for name in sorted(cancelled):
        consumer.cancel_task_queue(name)
    if added or cancelled:
        logger.info("reconciled consumers: +%d -%d", len(added), len(cancelled))
    return added, cancelled


class Reconciler(bootsteps.StartStopStep):
    """Consumer bootstep: reconcile at (re)start and every WM_RECONCILE_INTERVAL_S."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.settings = Settings.from_env()
        self.tref: Any = None

    def start(self, parent: Any) -> None:
        self._tick(parent)
        self.tref = parent.timer.call_repeatedly(
            self.settings.reconcile_interval_s, self._tick, (parent,), priority=10
        )

    def stop(self, parent: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None

    def _tick(self, parent: Any) -> None:
        try:
            reconcile(parent, self.settings)
        except Exception:
            logger.exception("reconcile failed; next try in %ss",
                             self.settings.reconcile_interval_s)


@signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    settings = Settings.from_env()
    started = time.monotonic()
    deadline = started + settings.worker_recovery_acquire_timeout_seconds
    while True:
        try:
            recover(settings, sender.app)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


@signals.worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    from wm.tasks import reset_runtime

    store.dispose_engines()
    reset_runtime()


@signals.worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    from wm.tasks import reset_runtime

    reset_runtime()
