"""Infrastructure events (``WM_INFRA_EVENTS``, off by default): node heartbeats on
``workmanager.infra.heartbeat`` and group-lock changes on ``workmanager.infra.grouplock``,
finer-grained than the lifecycle events (seed 001).

They are telemetry, so nothing waits for them and nothing fails with them: each process
hands them to one thread of its own (:class:`Sender`), which publishes them through the bus
in their order. A delivery never holds its group lock longer for one, a node's heartbeat
never waits for the broker; a failed publish is logged (once until one succeeds again), and
an event offered while :data:`QUEUE_CAPACITY` wait is dropped and counted.

Volume: acquired and released locks are folded per group and process to one event of each
per :data:`FOLD_S` (its ``count`` says how many it stands for, counted since the last one
sent); a steal is never folded; a node sends at most one heartbeat per WM_NODE_HEARTBEAT_S.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from wm.config import Settings
from wm.dataplane.bus import Bus
from wm.events import GROUPLOCK_TOPIC, HEARTBEAT_TOPIC, CloudEvent, infra_event, tenant_fields
from wm.names import split_route_topic
from wm.state.locks import Lease

__all__ = [
    "FOLD_S",
    "QUEUE_CAPACITY",
    "Folding",
    "HeartbeatEvents",
    "Sender",
    "lock_released",
    "lock_taken",
    "sender",
]

logger = logging.getLogger(__name__)

#: Events waiting for the sender thread, at most; more are dropped (the broker is slow).
QUEUE_CAPACITY = 1000
#: Interval (s) within which acquired (or released) events of one group are folded into one.
FOLD_S = 1.0


class Sender:
    """Publishes infrastructure events from a daemon thread, started at the first one."""

    def __init__(self, capacity: int = QUEUE_CAPACITY) -> None:
        self.queue: queue.Queue[tuple[Bus, CloudEvent, str]] = queue.Queue(maxsize=capacity)
        self.thread: threading.Thread | None = None
        self.start_lock = threading.Lock()
        self.failing = False  # the last publish failed; said once
        self.dropped = 0

    def offer(self, bus: Bus, event: CloudEvent, topic: str) -> bool:
        """Queue ``event`` for ``topic``; False when it was dropped (the queue is full)."""
        self._start()
        try:
            self.queue.put_nowait((bus, event, topic))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning(
                    "infra events: %d dropped so far, %d wait for the broker",
                    self.dropped,
                    self.queue.qsize(),
                )
            return False
        return True

    def wait_sent(self, timeout_s: float) -> bool:
        """Wait until every queued event was published (or failed); for tests and shutdown."""
        deadline = time.monotonic() + timeout_s
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.queue.unfinished_tasks

    def _start(self) -> None:
        if self.thread is not None:
            return
        with self.start_lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="wm-infra", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            bus, event, topic = self.queue.get()
            try:
                bus.publish(event, topic)
            except Exception as exc:
                if not self.failing:
                    logger.warning(
                        "infra event %s to %s not published (%s); infra events that fail are "
                        "dropped until one is published again",
                        event.get_type(),
                        topic,
                        exc,
                    )
                self.failing = True
            else:
                if self.failing:
                    logger.info("infra events are published again")
                self.failing = False
            finally:
                self.queue.task_done()


class Folding:
    """Counts occurrences per key, and lets one through per ``interval_s`` with the count of
    those it stands for (itself and the ones folded since the last one let through)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self.lock = threading.Lock()
        self.sent: dict[Any, float] = {}
        self.folded: dict[Any, int] = {}

    def take(self, key: Any) -> int | None:
        """The count to send now, or None: folded into the next one sent for ``key``."""
        now = self.clock()
        with self.lock:
            count = self.folded.pop(key, 0) + 1
            last = self.sent.get(key)
            if last is not None and now - last < self.interval_s:
                self.folded[key] = count
                return None
            self.sent[key] = now
            return count


_sender = Sender()
_acquired = Folding(FOLD_S)
_released = Folding(FOLD_S)


def _forget_at_fork() -> None:
    """A forked process has none of its parent's threads: it starts its own sender."""
    global _sender, _acquired, _released
    _sender, _acquired, _released = Sender(), Folding(FOLD_S), Folding(FOLD_S)


os.register_at_fork(after_in_child=_forget_at_fork)


def sender() -> Sender:
    """This process's sender."""
    return _sender


def lock_taken(bus: Bus, lease: Lease, worker_id: str) -> None:
    """``lock_stolen`` when the lock was taken from a holder whose lease expired, else a
    (folded) ``lock_acquired``; nothing unless WM_INFRA_EVENTS is on."""
    if not bus.settings.infra_events:
        return
    if lease.stolen_from is not None:
        previous, previous_fence = lease.stolen_from
        data = {"previous_holder": previous, "previous_fence": previous_fence}
        logger.warning(
            "group lock %r taken by %s (fence %d) from %s (fence %d), whose lease expired",
            lease.group,
            lease.owner,
            lease.fence,
            previous,
            previous_fence,
        )
        _lock_event(bus, "lock_stolen", lease, worker_id, data)
        return
    count = _acquired.take(lease.group)
    if count is not None:
        _lock_event(bus, "lock_acquired", lease, worker_id, {"count": count})


def lock_released(bus: Bus, lease: Lease, worker_id: str) -> None:
    """A (folded) ``lock_released``; nothing unless WM_INFRA_EVENTS is on."""
    if not bus.settings.infra_events:
        return
    count = _released.take(lease.group)
    if count is not None:
        _lock_event(bus, "lock_released", lease, worker_id, {"count": count})


def _lock_event(bus: Bus, kind: str, lease: Lease, worker_id: str, extra: dict[str, Any]) -> None:
    tenant, group = split_route_topic(lease.group)
    data: dict[str, Any] = {
        "group": group,  # as its tenant names it; the subject stays the qualified group
        "fence": lease.fence,
        "holder": lease.owner,
        "worker_id": worker_id,
        **extra,
        **tenant_fields(tenant),
    }
    if lease.item is not None:
        data["item"] = lease.item
    _sender.offer(bus, infra_event(f"grouplock.{kind}", lease.group, data), GROUPLOCK_TOPIC)


class HeartbeatEvents:
    """A node's heartbeat events: at most one per WM_NODE_HEARTBEAT_S (a heartbeat may beat
    sooner when its liveness runs short); the dead nodes found and the messages restored by
    beats in between are told by the next one."""

    def __init__(self, settings: Settings, bus: Bus) -> None:
        self.settings, self.bus = settings, bus
        self.last: float | None = None
        self.dead: list[str] = []
        self.restored = 0

    def beat(self, node: str, dead: list[str], restored: int) -> None:
        """One heartbeat of ``node`` found ``dead`` nodes and put back ``restored`` messages."""
        self.dead += [name for name in dead if name not in self.dead]
        self.restored += restored
        now = time.monotonic()
        if self.last is not None and now - self.last < self.settings.node_heartbeat_s:
            return
        self.last = now
        data = {
            "node": node,
            "pid": os.getpid(),
            "time": datetime.datetime.now(datetime.UTC).isoformat(),
            "dead_nodes": self.dead,
            "restored": self.restored,
        }
        self.dead, self.restored = [], 0
        _sender.offer(self.bus, infra_event("heartbeat", node, data), HEARTBEAT_TOPIC)
