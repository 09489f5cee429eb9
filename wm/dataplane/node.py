"""What a Celery node does besides running tasks: recovery at start (one leader per cluster,
``wm.dataplane.recovery``) and the watch that takes over a recovery left unfinished, and a
reconcile loop that makes the node consume exactly the queues of running workers — also
after a broker reconnect, when consumers added at runtime are known to vanish. On a Redis
broker, messages queued under priority levels the node does not read (WM_PRIORITY_STEPS) are
moved to levels it reads: at start for the queues it consumes, then every reconcile period by
the one node that maintains."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import Celery, bootsteps
from celery.concurrency.solo import TaskPool as SoloPool
from sqlalchemy import select

from wm import store
from wm.config import Settings
from wm.dataplane import (
    infra,
    liveness,
    outbox,
    pending,
    placement,
    probes,
    recovery,
    runtime,
    sweep,
    takenfacts,
    transport,
    workerhealth,
)
from wm.dataplane.app import broker_errors, redis_broker, shared_server
from wm.dataplane.bus import Bus
from wm.dataplane.liveness import Heartbeat
from wm.dataplane.queues import DEFAULT_QUEUE, EXCHANGE
from wm.dataplane.routes import route_of
from wm.dataplane.tasks import first_trip_templates
from wm.engine import check_engines
from wm.errors import RecoveryRunning, Unavailable
from wm.lifecycle import Status
from wm.state.directory import Directory
from wm.state.health import UNHEALTHY, WorkerHealth
from wm.state.ledger import Ledger
from wm.state.unawaited import UNAWAITED
from wm.store.models import Subscription, Worker
from wm.workersettings import WorkerSettings

logger = logging.getLogger(__name__)


@dataclass
class NodeState:
    """What a node's main process knows of its own start, for its health (``wm.ops.health``).

    ``recovery``: ``pending`` (not started), ``running``, ``retrying`` (an attempt failed,
    ``error`` says why), ``done`` (this node led it), ``elsewhere`` (another node leads),
    ``disabled`` (WORKER_RECOVERY_ON_START=false) or ``failed`` (gave up: the node stops).
    A node that did not lead moves to ``running`` again when it takes over a recovery whose
    leader died (``wm.dataplane.recovery.Takeover``), then to ``done`` or ``retrying``.
    ``consuming``: the first reconcile ran, so the node consumes every running worker's queue.
    """

    recovery: str = "pending"
    error: str | None = None
    consuming: bool = False
    #: Worker queues the node consumed at its last reconcile.
    queues: int = 0


#: This process's state (a node's main process; pool processes never change it).
STATE = NodeState()


def running_queues(settings: Settings) -> dict[str, str]:
    """Queue → worker id of running workers, from the database (the source of truth); a
    shared group's one queue → the share's id, while any member runs (``wm.store.shares``).
    A worker paused while unhealthy (``wm.dataplane.features.pause``) is left out."""
    with store.session_scope(settings) as session:
        workers = session.scalars(
            select(Worker)
            .join(Subscription, Worker.id == Subscription.worker_id)
            .where(Worker.status == Status.RUNNING.value)
        ).all()
        routes = [route_of(worker) for worker in workers]
        pausing = [str(w.id) for w in workers if WorkerSettings.of(w.settings).pause_when_unhealthy]
    paused = unhealthy(settings, pausing)
    return {
        route.queue: str(route.worker_id)
        for route in routes
        if route.share is not None or str(route.worker_id) not in paused
    }


def unhealthy(settings: Settings, worker_ids: list[str]) -> set[str]:
    """Those of ``worker_ids`` whose kept verdict is ``unhealthy`` (none while Redis cannot
    say: health is no reason to stop consuming)."""
    try:
        known = WorkerHealth(settings).known(worker_ids)
    except Unavailable as exc:
        logger.warning("consuming every running worker's queue: health unknown (%s)", exc)
        return set()
    return {worker_id for worker_id, health in known.items() if health == UNHEALTHY}


def maintain(
    settings: Settings, bus: Bus, running: Mapping[str, str], node: str | None = None
) -> None:
    """One node per reconcile period repairs derived state: the routing table, lifecycle
    events left in the outbox, deliveries the broker lost (``wm.dataplane.sweep``),
    circuit-breaker back-offs whose end was lost with a node, and every worker's health."""
    if not Ledger(settings).claim_sweep(settings.reconcile_interval_s, node):
        return
    bus.rebuild_routes()
    workerhealth.judge_all(settings, bus)
    outbox.flush(settings, bus)
    # Before the sweep: a message in a list no node reads would count as lost.
    merge_levels(settings, bus.app, [*running, DEFAULT_QUEUE])
    repair_ready(settings, bus.app, running)
    sweep.sweep(settings, bus, running)
    pending.sweep_overdue(settings, bus, slack_s=settings.reconcile_interval_s)
    probes.send_due(settings, bus)


def merge_levels(settings: Settings, app: Celery, queues: Iterable[str]) -> int:
    """Move the messages of ``queues`` that wait in priority levels outside WM_PRIORITY_STEPS
    (queued under another setting, e.g. kombu's default four) into the levels read now."""
    if not redis_broker(settings.broker_url):
        return 0
    with broker_errors(settings), app.connection_for_write() as conn:
        moved = int(conn.default_channel.merge_unread_levels(queues))
    if moved:
        steps = ",".join(map(str, settings.priority_steps))
        logger.warning(
            "moved %d message(s) queued under other priority levels into WM_PRIORITY_STEPS=%s",
            moved,
            steps,
        )
    return moved


def repair_ready(settings: Settings, app: Celery, queues: Iterable[str]) -> int:
    """List again in the Redis ready list (WM_READY_LIST) the queues of ``queues`` that hold
    messages no node will look for: a node died holding their name, or a client pushed to
    the queue without WorkManager's transport."""
    if not (redis_broker(settings.broker_url) and settings.ready_list):
        return 0
    with broker_errors(settings), app.connection_for_write() as conn:
        fixed = int(conn.default_channel.repair_ready(queues))
    if fixed:
        logger.warning("listed %d queue(s) holding messages in the ready list again", fixed)
    return fixed


def reconcile(consumer: Any, wanted: Iterable[str]) -> tuple[set[str], set[str]]:
    """Consume every running worker's queue and nothing else; returns (added, cancelled).
    ``wanted`` comes from the node's own store: the consumer adds them without asking it
    again (``wm.dataplane.consumer``)."""
    wanted = set(wanted)
    consumer.own_queues = frozenset(wanted)
    current = {q.name for q in consumer.task_consumer.queues}
    ours = {name for name in current if "::" in name}
    added, cancelled = wanted - current, ours - wanted
    started = time.monotonic()
    consumer.add_task_queues(
        sorted(added), exchange=EXCHANGE.name, exchange_type="direct", durable=True
    )
    for name in sorted(cancelled):
        consumer.cancel_task_queue(name)
    if added or cancelled:
        elapsed = time.monotonic() - started
        logger.info("reconciled consumers: +%d -%d in %.2f s", len(added), len(cancelled), elapsed)
    return added, cancelled


class Reconciler(bootsteps.StartStopStep):
    """Consumer bootstep: reconcile at (re)start and every WM_RECONCILE_INTERVAL_S."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.settings = Settings.from_env()
        self.tref: Any = None
        self.first: Any = None
        self.turns: Any = None
        self.heartbeat: Heartbeat | None = None
        self.watcher: placement.Watcher | None = None
        self.watching: Any = None
        self.beats: Any = None
        self.recovered = False

    def start(self, parent: Any) -> None:
        if not self.recovered:  # once per node; the step restarts after broker reconnects
            check_engines(self.settings)  # a host that cannot run an engine safely stops here
            recover_with_retries(self.settings, parent.app, parent.hostname)
            self.heartbeat = start_heartbeat(self.settings, parent.app, parent.hostname)
            self.watcher = start_placement(self.settings, self.heartbeat)
            takenfacts.offer(shared_server(self.settings), first_trip_templates())
            self.recovered = True
        elif self.heartbeat is not None:  # the step restarts after a broker reconnect
            self.heartbeat.new_life()
            if self.watcher is not None:
                self.watcher.rename(self.heartbeat.node)
        self.turns = watch_loop(self.heartbeat, parent)
        pace_takes(parent)
        if self.heartbeat is None and self.beats is None:
            self.beats = tell_heartbeats(self.settings, parent)
        if parent.hub is not None:
            # The first reconcile runs in the event loop, once the task consumer has its
            # callback: a queue added before would wait for the loop's consume anyway
            # (``wm.dataplane.app.CallbackFirstConsumer``).
            self.first = parent.timer.call_after(0.0, self._tick, (parent, True), priority=10)
        else:
            self._tick(parent, starting=True)
        self.tref = parent.timer.call_repeatedly(
            self.settings.reconcile_interval_s, self._tick, (parent,), priority=10
        )

    def stop(self, parent: Any) -> None:
        for entry in (self.first, self.tref, self.turns, self.watching, self.beats):
            if entry is not None:
                entry.cancel()
        self.first = self.tref = self.turns = self.watching = self.beats = None
        if self.watcher is not None:
            leave_placement(self.watcher, parent.app)

    def _tick(self, parent: Any, starting: bool = False) -> None:
        try:
            running = running_queues(self.settings)
            if starting:
                warm(self.settings, running.values())
            reconcile(parent, running)
            STATE.consuming, STATE.queues = True, len(set(running))
            if self.watching is None:  # a member once it consumes (the first reconcile may
                # hold the loop longer than a membership lasts)
                every_s = self.settings.node_heartbeat_s
                self.watching = watch_nodes(self.watcher, parent, every_s)
            if starting:
                consumed = [queue.name for queue in parent.task_consumer.queues]
                merge_levels(self.settings, parent.app, consumed)
            maintain(self.settings, Bus(self.settings, parent.app), running, parent.hostname)
        except Exception:
            logger.exception(
                "reconcile failed; next try in %ss", self.settings.reconcile_interval_s
            )


def warm(settings: Settings, worker_ids: Iterable[str]) -> None:
    """Before a starting node consumes: the facts and code of the running workers, cached in
    a few queries (``Directory.warm``) rather than by each pool process on its first
    delivery to each, one query for the facts and one for the code. Best effort: a failure
    is logged, and the deliveries read what they need as before."""
    started = time.monotonic()
    try:
        read = Directory(settings).warm(set(worker_ids))
    except Exception:
        logger.warning("could not cache the running workers' facts ahead", exc_info=True)
        return
    if read:
        elapsed = time.monotonic() - started
        logger.info("cached the facts and code of %d worker(s) in %.2f s", read, elapsed)


def start_heartbeat(settings: Settings, app: Celery, hostname: str) -> Heartbeat | None:
    """On a Redis broker, the node's liveness (``wm.dataplane.liveness``): before it takes a
    message, so that every message it takes is known to be its own. A restarted node is
    another one (a name of its own), whose predecessor's messages go back at once."""
    if not redis_broker(settings.broker_url):
        return None  # RabbitMQ gives a closed connection's messages back itself
    told = infra.HeartbeatEvents(settings, Bus(settings, app)) if settings.infra_events else None
    on_beat = None if told is None else told.beat
    heartbeat = Heartbeat(settings, app, f"{hostname}.{uuid.uuid4().hex[:12]}", on_beat)
    heartbeat.start()
    return heartbeat


def tell_heartbeats(settings: Settings, parent: Any) -> Any:
    """Where the node keeps no liveness record (RabbitMQ), its heartbeat events
    (WM_INFRA_EVENTS) come from a timer entry of its event loop; returns the entry."""
    if not settings.infra_events:
        return None
    told = infra.HeartbeatEvents(settings, Bus(settings, parent.app))
    return parent.timer.call_repeatedly(
        settings.node_heartbeat_s, told.beat, (parent.hostname, [], 0), priority=10
    )


def start_placement(settings: Settings, heartbeat: Heartbeat | None) -> placement.Watcher | None:
    """Worker placement (``wm.dataplane.placement``), where the node keeps a liveness record
    and waits on the ready list; None when off (WM_PLACEMENT_SPILL=0)."""
    if heartbeat is None or not settings.ready_list or not settings.placement_spill:
        return None
    return placement.Watcher(heartbeat.node, settings.placement_spill, settings.node_dead_after_s)


def watch_nodes(watcher: placement.Watcher | None, parent: Any, every_s: float) -> Any:
    """Refresh the placement's view of the live nodes now and every ``every_s`` seconds,
    from the node's event loop; returns the timer entry."""
    if watcher is None:
        return None

    def refresh() -> None:
        try:
            watcher.refresh(parent.task_consumer.channel)
        except Exception as exc:  # Redis away: the heartbeat says so too; next turn retries
            logger.warning("placement: could not read the live nodes (%s)", exc)

    refresh()
    return parent.timer.call_repeatedly(every_s, refresh, priority=10)


def leave_placement(watcher: placement.Watcher, app: Celery) -> None:
    """The node stops consuming: its share goes to the others now, not when it lapses."""
    try:
        with app.connection_for_write() as conn:
            watcher.leave(conn.default_channel)
    except Exception as exc:  # the broker is away: the membership lapses instead
        logger.warning("placement: could not leave (%s); the others wait for it to lapse", exc)


def pace_takes(parent: Any) -> None:
    """Tell the task consumer's channel (a new one after each broker reconnect) how many pool
    processes the node has, so that while a backlog lasts it takes several messages at once
    (``transport.refill_at``)."""
    channel = getattr(parent.task_consumer, "channel", None)
    processes = int(getattr(parent.pool, "num_processes", 0) or 0)
    if not isinstance(channel, transport.Channel) or processes < 1:
        return
    channel.processes = processes
    window = channel.qos.prefetch_count
    if window:
        logger.info(
            "takes: while a backlog lasts, the prefetch window of %d takes again once it "
            "has room for %d (%d pool processes)",
            window,
            transport.refill_at(window, processes),
            processes,
        )


def watch_loop(heartbeat: Heartbeat | None, parent: Any) -> Any:
    """Let the heartbeat see the node's event loop turn (a timer entry of the loop, every
    half heartbeat); returns the entry. Not where there is no event loop, nor on the solo
    pool, which runs each delivery inside the loop (a long delivery is no wedge there)."""
    if heartbeat is None or parent.hub is None or isinstance(parent.pool, SoloPool):
        return None
    heartbeat.turn()
    return parent.timer.call_repeatedly(
        heartbeat.settings.node_heartbeat_s / 2, heartbeat.turn, priority=10
    )


def recover_with_retries(settings: Settings, app: Celery, hostname: str) -> None:
    """Recovery at node start, retried until WORKER_RECOVERY_ACQUIRE_TIMEOUT_SECONDS; then
    the watch that takes over a recovery whose leader dies before it is done."""
    if not settings.worker_recovery_on_start:
        STATE.recovery = "disabled"
        return
    deadline = time.monotonic() + settings.worker_recovery_acquire_timeout_seconds
    STATE.recovery = "running"
    while True:
        try:
            recovery.recover(settings, app, hostname)
            STATE.recovery = "done"
        except RecoveryRunning:
            logger.info("another node leads recovery")
            STATE.recovery = "elsewhere"
        except Exception as exc:
            STATE.error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                STATE.recovery = "failed"
                raise
            STATE.recovery = "retrying"
            time.sleep(1.0)
            continue
        STATE.error = None
        recovery.Takeover(settings, app, hostname, _took_over).start()
        return


def _took_over(state: str, error: str | None) -> None:
    STATE.recovery, STATE.error = state, error


#: Set when a node's warm shutdown begins (:func:`on_shutting_down`).
_WARM_STOP = threading.Event()


def arm_shutdown_grace(settings: Settings) -> None:
    """In a node's main process, at its start: the thread that turns a warm shutdown into
    a cold one past WM_SHUTDOWN_GRACE_S (:func:`on_shutting_down`). Started now, so that
    the shutdown, which Celery begins inside its signal handler, only sets an event there:
    starting a thread takes a lock of ``threading``'s own that the code the signal
    interrupted may hold, and reading the settings may raise into that code."""
    grace_s = settings.shutdown_grace_s
    if not grace_s:
        return

    def cut() -> None:
        _WARM_STOP.wait()
        time.sleep(grace_s)
        logger.warning(
            "deliveries still running %.1fs after the stop began (WM_SHUTDOWN_GRACE_S): "
            "ending them; they will be delivered again",
            grace_s,
        )
        os.kill(os.getpid(), signal.SIGQUIT)

    # a daemon: a node done before the grace exits without waiting for it
    threading.Thread(target=cut, name="wm-shutdown-grace", daemon=True).start()


def on_shutting_down(how: str) -> None:
    """A warm shutdown (SIGTERM, or Ctrl-C once) has begun: Celery stops consuming and waits
    for the deliveries in flight, without a limit. Past WM_SHUTDOWN_GRACE_S this turns it
    into a cold shutdown (SIGQUIT to the node itself, from :func:`arm_shutdown_grace`'s
    thread), which ends the pool processes: their deliveries were never acknowledged, so the
    broker delivers them again (RabbitMQ when the connection closes; on Redis the consumer
    puts them back as it closes), their group locks expire within a lease, and a sandbox
    ends with its pool process. Nothing is lost; an interrupted run recorded nothing, so it
    runs again."""
    if how == "Warm":
        liveness.drain()
        _WARM_STOP.set()


def on_process_init() -> None:
    """In each pool process after fork: fresh database pools and a fresh runtime; then
    what the process inherited from the node (about 120,000 objects: Celery, kombu,
    SQLAlchemy, the app) is frozen out of the garbage collector's reach. A full collection
    walked them all, a 120 ms pause in the middle of a delivery (5 ms frozen). The price: a
    cycle among those objects that the process drops is never freed, which bounds the leak
    by what it inherited."""
    store.dispose_engines(close=False)
    runtime.reset_runtime()
    runtime.POOL_CHILD = True
    gc.freeze()


def on_process_shutdown() -> None:
    """Close the engines (and their sandboxed subprocesses) of a pool process, and read the
    reply of its last record nobody waited for (an error in it is logged)."""
    UNAWAITED.settle()
    runtime.reset_runtime()
