"""What the deliveries of one process share: its connections, engines and state clients,
made lazily after fork (``wm.dataplane.node`` resets them), and the listener of engine
commands (``wm.dataplane.enginecontrol``) for the engines loaded here."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import Counter

from celery import Celery, Task

from wm.config import Settings
from wm.dataplane import enginecontrol
from wm.dataplane.app import shared_server
from wm.dataplane.bus import Bus
from wm.dataplane.deadletters import DeadLetters
from wm.dataplane.enginecache import EngineCache
from wm.dataplane.outputs import OutputPublisher
from wm.dataplane.watchdog import Watchdog
from wm.state.directory import Directory
from wm.state.health import Tally
from wm.state.ledger import Ledger
from wm.state.locks import GroupLocks
from wm.state.ordering import Ordering
from wm.state.outcomes import Outcomes
from wm.state.slots import Slots
from wm.state.tenantlimits import TenantGate

logger = logging.getLogger(__name__)


#: This process is a prefork pool process (set by ``wm.dataplane.node`` after fork): it may
#: end itself to stop code running inside it, and the node replaces it.
POOL_CHILD = False


class Runtime:
    """Per-process collaborators of deliveries (created lazily, after fork), and the listener
    of engine commands (``wm.dataplane.enginecontrol``) for the engines loaded here."""

    def __init__(self, settings: Settings, app: Celery) -> None:
        self.settings = settings
        self.bus = Bus(settings, app)
        self.directory = Directory(settings)
        self.outcomes = Outcomes(settings)
        self.ledger = Ledger(settings)
        self.outputs = OutputPublisher(self.bus)
        #: The node's take reads a delivery's first facts (``wm.dataplane.takenfacts``).
        self.takes_facts = shared_server(settings) is not None
        self.locks = GroupLocks(settings)
        self.slots = Slots(settings)
        self.tenant_gate = TenantGate(settings)
        self.ordering = Ordering(settings)
        self.tally = Tally()
        self.dead_letters = DeadLetters(settings, self.bus)
        self.engines = EngineCache(settings, self.directory)
        self.node = f"{socket.gethostname()}:{os.getpid()}"
        #: Deliveries running in this process, by worker id.
        self.in_flight: Counter[str] = Counter()
        self._flight_lock = threading.Lock()
        #: When each worker's engine was last killed here (its deliveries begun before were
        #: interrupted by the stop, not failed).
        self.killed_at: dict[str, float] = {}
        #: When this process last heard a command about each worker (a stop's question, an
        #: unload): facts a take read before it are read again (``wm.dataplane.takenfacts``).
        self.told_at: dict[str, float] = {}
        self.listener = enginecontrol.Listener(settings, self.command)
        self.listener.start()
        self.watchdog = Watchdog()
        #: Why this pool process ends once the delivery in hand is settled (None: it goes on).
        self.replacing: str | None = None

    def begin(self, worker_id: str) -> None:
        with self._flight_lock:
            self.in_flight[worker_id] += 1

    def end(self, worker_id: str) -> None:
        with self._flight_lock:
            self.in_flight[worker_id] -= 1
            if self.in_flight[worker_id] <= 0:
                del self.in_flight[worker_id]

    def interrupted(self, worker_id: str, began: float) -> bool:
        """A delivery to ``worker_id`` begun at ``began`` was cut short by a stop's kill."""
        return self.killed_at.get(worker_id, 0.0) >= began

    def replace(self, reason: str) -> None:
        """End this pool process once the delivery in hand is settled (``wm.dataplane.tasks``);
        the node starts another. For code that keeps running in it, or grew it too much."""
        if not POOL_CHILD:
            logger.error(
                "%s; this process is the node's own and is not replaced (run the node with "
                "the prefork pool to have it replaced)",
                reason,
            )
            return
        logger.warning("%s: pool process %d is replaced after this delivery", reason, os.getpid())
        self.replacing = reason

    def command(self, op: str, worker_id: str) -> int | None:
        """An engine command: ``ask`` how many of the worker's deliveries run here, ``kill``
        its engine if they do, or ``unload`` it."""
        self.told_at[worker_id] = time.time()
        if op == enginecontrol.ASK:
            return self.in_flight[worker_id]
        if op == enginecontrol.UNLOAD:
            engine = self.engines.drop(worker_id)
            if engine is not None:  # closing may wait for a call in flight: not on this thread
                threading.Thread(target=engine.close, name="wm-unload", daemon=True).start()
                logger.info("unloaded worker %s (stopped, deleted or replaced)", worker_id)
            return None
        if op != enginecontrol.KILL or not self.in_flight[worker_id]:
            return None
        self.killed_at[worker_id] = time.time()
        engine = self.engines.loaded(worker_id)
        if engine is not None and engine.kill():
            logger.warning("killed worker %s's engine: its stop's grace period passed", worker_id)
        elif POOL_CHILD:
            logger.warning(
                "worker %s's code runs inside pool process %d and outlived its stop's grace "
                "period: ending the process (the node starts another)",
                worker_id,
                os.getpid(),
            )
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            logger.error(
                "worker %s's code runs inside this node's process and cannot be killed apart "
                "from it; its delivery runs to its time limit (run the node with the prefork "
                "pool to have it killed)",
                worker_id,
            )
        return None


_runtime: Runtime | None = None
#: Threads of a ``-P threads`` pool share the process's runtime: one of them builds it.
_runtime_lock = threading.Lock()


def runtime(task: Task) -> Runtime:
    """The per-process runtime (reset after fork by ``wm.dataplane.node``)."""
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = Runtime(Settings.from_env(), task.app)
    return _runtime


def reset_runtime() -> None:
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            _runtime.listener.stop()
            _runtime.engines.close()
        _runtime = None
