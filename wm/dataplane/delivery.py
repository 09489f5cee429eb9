"""The consumer side of one delivery (DESIGN.md §5.3): decode → idempotency check → group lock
→ engine → record outcome → publish outputs. Failure policy lives in ``wm.dataplane.tasks``."""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass

from celery import Celery

from wm.config import Settings
from wm.dataplane import enginecontrol, outbox, tracing
from wm.dataplane.bus import Bus, Route
from wm.dataplane.deadletters import DeadLetters
from wm.dataplane.observe import notify
from wm.dataplane.outputs import OutputPublisher
from wm.engine import Engine, Outputs, WorkerSpec, engine_class, resident_bytes
from wm.errors import HopLimitExceeded, InvalidArgument, OutputRefused, WorkerCrashed
from wm.events import (
    LIFECYCLE_TOPIC,
    CloudEvent,
    derive_id,
    key_of,
    lifecycle_event,
    with_attributes,
)
from wm.lifecycle import Status
from wm.names import check_name, reserved_topic
from wm.state.connection import StatePipeline
from wm.state.directory import Directory, WorkerMeta
from wm.state.health import Tally
from wm.state.ledger import Ledger, Settlement
from wm.state.locks import GroupLocks, Lease
from wm.state.ordering import Ordering
from wm.state.outcomes import Outcomes
from wm.state.slots import Slots
from wm.views import OUTPUT_TOPICS

logger = logging.getLogger(__name__)
#: Pause before a message goes back to its queue (the platform is down, or the worker does
#: not run now), so a node does not spin on it.
REQUEUE_PAUSE_S = 1.0
#: Extension attributes copied from an input event to every output that lacks them.
PROPAGATED = ("correlationid", "traceparent", "tracestate")
FENCE_EXTENSION = "wmfence"
#: Workers an event passed through on its way here; every output carries one more.
HOPS_EXTENSION = "wmhops"


class EngineCache:
    """Loaded engines by worker id, reloaded when the worker's version moves.

    Sized by memory, not by a count: a process keeps every worker it serves while they fit.
    Each engine is charged what loading it added to this process's resident memory plus the
    resident memory of the processes it keeps (:meth:`Engine.processes`); beyond
    ``WM_ENGINE_CACHE_MB`` the least recently used are closed, never the one just used.
    """

    def __init__(self, settings: Settings, directory: Directory) -> None:
        self.settings = settings
        self.directory = directory
        self.budget_bytes = cache_budget_bytes(settings)
        self._engines: OrderedDict[str, tuple[int, Engine, int]] = OrderedDict()
        self._lock = threading.Lock()
        #: Per worker: held while one thread (of a ``-P threads`` pool) loads it.
        self._loading: dict[str, threading.Lock] = {}

    def __len__(self) -> int:
        return len(self._engines)

    def processes(self) -> int:
        """Processes the loaded engines keep (sandboxes, helpers)."""
        return sum(len(engine.processes()) for _, engine, _ in list(self._engines.values()))

    @property
    def charged_bytes(self) -> int:
        """What the loaded engines are charged, together."""
        return sum(charge for _, _, charge in list(self._engines.values()))

    def engine(self, meta: WorkerMeta, version: int) -> tuple[Engine, bool]:
        """(engine, temporary): a pinned old version gets a temporary engine to close after."""
        if version != meta.version:
            return self._load(meta, version), True
        with self._lock:
            cached = self._engines.get(meta.id)
            if cached is not None and cached[0] == version:
                self._engines.move_to_end(meta.id)
                return cached[1], False
            loading = self._loading.setdefault(meta.id, threading.Lock())
        with loading:  # the threads that miss together wait for one load, not one each
            return self._load_cached(meta, version)

    def _load_cached(self, meta: WorkerMeta, version: int) -> tuple[Engine, bool]:
        with self._lock:
            cached = self._engines.get(meta.id)
            if cached is not None and cached[0] == version:  # loaded while this one waited
                self._engines.move_to_end(meta.id)
                return cached[1], False
        engine = cached[1] if cached is not None else None
        if engine is None:
            engine = engine_class(meta.mime_type)(self.settings)
        before = resident_bytes()
        engine.load(self.directory.code(meta.id, version), _spec(meta, version))
        charge = max(0, resident_bytes() - before) + sum(map(resident_bytes, engine.processes()))
        with self._lock:
            self._engines[meta.id] = (version, engine, charge)
            self._engines.move_to_end(meta.id)
            evicted = self._evict()
        for old in evicted:  # outside the lock: closing may wait for calls in flight
            old.close()
        notify("engines", meta, len(self))
        notify("sandboxes", meta, self.processes())
        return engine, False

    def _load(self, meta: WorkerMeta, version: int) -> Engine:
        engine = engine_class(meta.mime_type)(self.settings)
        engine.load(self.directory.code(meta.id, version), _spec(meta, version))
        return engine

    def _evict(self) -> list[Engine]:
        """The least recently used engines beyond the budget, taken out of the cache."""
        evicted = []
        total = self.charged_bytes
        while total > self.budget_bytes and len(self._engines) > 1:
            worker_id, (_, engine, charge) = self._engines.popitem(last=False)
            logger.info("unloading worker %s: engines over WM_ENGINE_CACHE_MB", worker_id)
            evicted.append(engine)
            total -= charge
        return evicted

    def loaded(self, worker_id: str) -> Engine | None:
        with self._lock:
            cached = self._engines.get(worker_id)
        return cached[1] if cached is not None else None

    def drop(self, worker_id: str) -> Engine | None:
        """Take the worker's engine out of the cache (the caller closes it)."""
        with self._lock:
            cached = self._engines.pop(worker_id, None)
        return cached[1] if cached is not None else None

    def close(self) -> None:
        with self._lock:
            for _, engine, _ in self._engines.values():
                engine.close()
            self._engines.clear()


def cache_budget_bytes(settings: Settings) -> int:
    """``WM_ENGINE_CACHE_MB``, or half the machine's memory shared by the node's processes."""
    if settings.engine_cache_mb > 0:
        return settings.engine_cache_mb << 20
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    processes = settings.node_concurrency or os.cpu_count() or 1
    return physical // 2 // processes


def _spec(meta: WorkerMeta, version: int) -> WorkerSpec:
    return WorkerSpec(meta.id, meta.topic, meta.group, version, meta.sha256, None, meta.settings)


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
        self.locks = GroupLocks(settings)
        self.slots = Slots(settings)
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
        self.listener = enginecontrol.Listener(settings, self.command)
        self.listener.start()

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

    def command(self, op: str, worker_id: str) -> int | None:
        """An engine command: ``ask`` how many of the worker's deliveries run here, ``kill``
        its engine if they do, or ``unload`` it."""
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


@dataclass
class Delivery:
    """One attempt to deliver one event to one worker."""

    rt: Runtime
    meta: WorkerMeta
    event: CloudEvent
    #: The event as the broker delivered it (the pending ledger's entry holds it too).
    payload: str
    delivery_id: str
    pin_version: int | None = None
    attempt: int = 1
    #: The broker delivers this message again (its consumer died without acknowledging it).
    redelivered: bool = False
    lease: Lease | None = None
    #: The event's recorded outcome as stored (None: none), when read already; used once.
    prefetched: bool = False
    prefetched_outcome: bytes | str | None = None
    #: When the engine part of the run began (``time.time()``; 0: not yet).
    began: float = 0.0

    @functools.cached_property
    def key(self) -> str:
        return key_of(self.event)

    @property
    def version(self) -> int:
        return self.pin_version or self.meta.version

    @functools.cached_property
    def hops(self) -> int:
        try:
            return max(0, int(self.event.get_extension(HOPS_EXTENSION) or 0))
        except (TypeError, ValueError):
            return 0

    @property
    def timeout_s(self) -> float:
        """The per-message time limit of the worker's code."""
        return float(
            self.meta.settings.get("timeout_s", self.rt.settings.message_handling_timeout_seconds)
        )

    @property
    def max_retries(self) -> int:
        return int(self.meta.settings.get("max_retries", self.rt.settings.max_retries))

    @property
    def hold_limit_s(self) -> float:
        """How long a group member may keep its lock renewed: its time limit plus one lease
        of grace for recording and publishing (each write renews the lease too)."""
        return self.timeout_s + self.rt.locks.lease_ms / 1000

    @property
    def longest_hold_s(self) -> float:
        """How long one holder can keep this group's lock without writing: renewed up to
        :attr:`hold_limit_s`, then one more lease until it expires."""
        return self.hold_limit_s + self.rt.locks.lease_ms / 1000

    def run(self) -> list[CloudEvent]:
        """Process the event, or republish its recorded outcome; returns the outputs.

        A group member whose lock stays held through the hand-off window raises
        :class:`~wm.errors.LockContention`: the task sends the delivery again with a delay
        (``wm.dataplane.tasks``), so waiting does not keep a pool process.
        """
        if self.prefetched:
            self.prefetched = False
            recorded = self.rt.outcomes.parse(self.prefetched_outcome)
        else:
            recorded = self.rt.outcomes.get(self.meta.id, self.key)
        if recorded is not None:
            notify("duplicate", self.meta)
            logger.info(
                "event %s already processed by worker %s; republishing its outcome",
                self.event.get_id(),
                self.meta.id,
            )
            self.publish(recorded)
            return recorded
        if self.hops >= self.rt.settings.max_hops:
            raise HopLimitExceeded(
                f"event {self.event.get_id()} already passed through {self.hops} workers "
                f"(WM_MAX_HOPS={self.rt.settings.max_hops}); a chain of workers may loop"
            )
        if self.redelivered:
            self.count_run()
        self.began = time.time()
        self.rt.begin(self.meta.id)
        try:
            engine, temporary = self.rt.engines.engine(self.meta, self.version)
            try:
                group = self.meta.group
                if group:
                    return self.run_locked(engine, group)
                limit = int(self.meta.settings.get("max_concurrency") or 0)
                if not limit:
                    return self.process(engine)
                holder = f"{self.rt.node}:{self.delivery_id}"
                with self.rt.slots.hold(self.meta.id, holder, limit, self.hold_limit_s):
                    return self.process(engine)
            finally:
                if temporary:
                    engine.close()
        except BaseException:
            if self.redelivered:  # the run ended, if not well: it did not take the process down
                self.rt.ledger.end_run(self.meta.id, self.key)
            raise
        finally:
            self.rt.end(self.meta.id)

    def count_run(self) -> None:
        """Count this run of a message the broker delivers again because the process that
        had it died. Runs end with the outcome's record or an error; when they keep ending
        with their process (a crash in code that shares it, such as in-process native code,
        or a node killed every time), the event is parked past the worker's attempts."""
        runs = self.rt.ledger.begin_run(self.meta.id, self.key)
        if runs > self.max_retries:
            raise WorkerCrashed(
                f"the process running worker {self.meta.id} on event {self.event.get_id()} "
                f"died {runs} times before finishing it; the event is parked instead of run "
                "again (code that crashes its process, such as in-process native code, "
                "is contained by isolation 'subprocess')"
            )

    def run_locked(self, engine: Engine, group: str) -> list[CloudEvent]:
        """Process under the group lock, its lease renewed by a heartbeat meanwhile.

        The lock may come from a holder that died after recording its outcome, or this event
        may have been processed by another copy while this one waited: a recorded outcome is
        republished, never run again (it is read as the lock is taken, in the same round trip
        on one Redis server).
        """
        owner = f"{self.rt.node}:{self.delivery_id}"
        outcome = self.rt.outcomes.key(self.meta.id, self.key)
        waited = time.monotonic()
        with tracing.step("lock wait"):
            self.lease, raw = self.rt.locks.take_reading(group, owner, outcome)
        notify("lock_wait", self.meta, time.monotonic() - waited)
        try:
            with self.rt.locks.keep_alive(self.lease, self.hold_limit_s):
                recorded = self.rt.outcomes.parse(raw)
                if recorded is not None:
                    notify("duplicate", self.meta)
                    self.publish(recorded)
                    return recorded
                return self.process(engine)
        finally:
            self.rt.locks.release(self.lease)

    def process(self, engine: Engine) -> list[CloudEvent]:
        """Run the code, record its outcome (fence-checked in the record's script, or just
        before it on a Redis Cluster), publish what was recorded.
        An error the worker answered with is reported as ``worker.error`` once published."""
        produced = self.execute(engine)
        outputs = self.stamp(produced)
        fence = None if self.lease is None else self.rt.locks.write_fence(self.lease)
        lookups = self.rt.outputs.lookups(outputs)
        self.rt.tally.add(self.meta.id, ok=True)  # flushed with this record when due

        def also(pipe: StatePipeline) -> None:  # after the lookups: their results come first
            lookups(pipe)
            self.rt.tally.queue_if_due(pipe)  # the process's health tally, once a second

        recorded, found = self.rt.outcomes.record(
            self.meta.id, self.key, outputs, self.settlement(), also, fence
        )
        if recorded is outputs:  # the routes looked up with the record are these outputs'
            routes = [self.rt.bus.parse_routes(flat) for flat in found[: len(outputs)]]
            self.publish(outputs, routes, settled=True)
        else:
            self.publish(recorded, settled=True)
        outputs = recorded
        sent = self.event.get_time()
        if outputs and sent is not None:  # publish → output, on the publisher's clock
            notify("latency", self.meta, max(0.0, time.time() - sent.timestamp()))
        if isinstance(produced, Outputs) and produced.worker_error is not None:
            self.emit_error("WorkerAnswer", produced.worker_error)
        if isinstance(produced, Outputs) and produced.done is not None:
            reason = f"finished: its code said it is done ({produced.done})"
            wid = uuid.UUID(self.meta.id)
            outbox.leave_running(
                self.rt.settings, self.rt.bus, wid, Status.FINISHED, reason, actor="node"
            )
        return outputs

    def execute(self, engine: Engine) -> list[CloudEvent]:
        started = time.monotonic()
        try:
            with tracing.step("engine call"):
                return engine.process(self.event, self.timeout_s)
        finally:
            notify("engine", self.meta, time.monotonic() - started)

    def stamp(self, outputs: list[CloudEvent]) -> list[CloudEvent]:
        """Deterministic ids, propagated trace/correlation attributes, the hop count and the
        fence; an output to a topic the worker may not publish to refuses them all."""
        stamped = []
        traced = tracing.carrier()  # the delivery's span: the next worker's parent
        for index, output in enumerate(outputs):
            self.check_output_topic(output.get_type())
            extra: dict[str, object] = {
                "id": derive_id(self.key, self.meta.id, index),
                HOPS_EXTENSION: self.hops + 1,
            }
            for name in PROPAGATED:
                if traced and name in tracing.TRACE_ATTRIBUTES:
                    value = traced.get(name)
                else:
                    value = self.event.get_extension(name)
                if value is not None and output.get_extension(name) is None:
                    extra[name] = value
            if self.lease is not None:
                extra[FENCE_EXTENSION] = self.lease.fence
            stamped.append(with_attributes(output, **extra))
        return stamped

    def check_output_topic(self, topic: str) -> None:
        allowed = self.meta.settings.get(OUTPUT_TOPICS)
        try:
            check_name("output topic", topic)
        except InvalidArgument as exc:
            raise OutputRefused(str(exc)) from exc
        if reserved_topic(topic):
            raise OutputRefused(
                f"output topic {topic!r} is reserved for WorkManager's own events "
                "(lifecycle, dead letters)"
            )
        if allowed is not None and topic not in allowed:
            raise OutputRefused(
                f"output topic {topic!r} is not in the worker's {OUTPUT_TOPICS}: {allowed}"
            )

    def emit_error(self, error_type: str, error_message: str) -> None:
        """Publish a ``worker.error`` lifecycle event about this attempt."""
        data = {
            "group": self.meta.group,
            "topic": self.meta.topic,
            "version": self.version,
            "error_type": error_type,
            "error_message": error_message,
            "event_id": self.event.get_id(),
            "attempt": self.attempt,
        }
        self.rt.bus.publish(lifecycle_event("error", self.meta.id, data), LIFECYCLE_TOPIC)

    def publish(
        self,
        outputs: list[CloudEvent],
        routes: list[list[Route] | None] | None = None,
        *,
        settled: bool = False,
    ) -> None:
        """Publish each output to the topic of its type (plain subscriptions get it once,
        see ``wm.dataplane.outputs``), then settle the delivery in the pending ledger unless
        the outcome's record ``settled`` it already. ``routes``: each output's, when looked
        up already (None: look it up)."""
        for index, output in enumerate(outputs):
            with tracing.step("output publish"):
                if self.lease is not None:
                    self.rt.locks.mark_write(self.lease)
                self.rt.outputs.publish(output, routes[index] if routes else None)
        if not settled:
            self.rt.ledger.settle(self.meta.id, self.key, self.payload, ran_again=self.redelivered)

    def settlement(self) -> Settlement:
        """The pending ledger's entry of this delivery (and its count of runs, if kept)."""
        return self.rt.ledger.settlement(
            self.meta.id, self.key, self.payload, ran_again=self.redelivered
        )
