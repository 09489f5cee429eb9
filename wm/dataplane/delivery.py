"""One attempt to deliver one event to one worker: the core's steps (DESIGN.md §5.3) —
its recorded outcome, the engine, the outcome's record, the outputs' publish. The pipeline
(``wm.dataplane.pipeline``) runs them with the features around them."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from wm.dataplane import outbox, tracing
from wm.dataplane.bus import Route
from wm.dataplane.deadletters import Failure
from wm.dataplane.message import DeliveryState
from wm.dataplane.observe import notify
from wm.dataplane.runtime import Runtime
from wm.dataplane.watchdog import OVERRUN_GRACE_S, Watch
from wm.engine import Engine, Outputs
from wm.errors import (
    IdempotencyKeyMissing,
    InvalidArgument,
    OutputRefused,
    WorkerExecutionError,
    WorkerTimeout,
)
from wm.events import (
    LIFECYCLE_TOPIC,
    TENANT_EXTENSION,
    CloudEvent,
    derive_id,
    encode,
    key_of,
    lifecycle_event,
    tenant_fields,
    with_attributes,
)
from wm.idempotency import operation_key
from wm.lifecycle import Status
from wm.names import DEFAULT_TENANT, bare_group, check_name, reserved_topic, split_route_topic
from wm.state.connection import StatePipeline
from wm.state.directory import WorkerMeta
from wm.state.ledger import Settlement
from wm.state.locks import Heartbeat, Lease
from wm.text import storable
from wm.workersettings import OUTPUT_TOPICS, WorkerSettings

logger = logging.getLogger(__name__)
#: Pause before a message goes back to its queue (the platform is down, or the worker does
#: not run now), so a node does not spin on it.
REQUEUE_PAUSE_S = 1.0
#: Extension attributes copied from an input event to every output that lacks them.
PROPAGATED = ("correlationid", "traceparent", "tracestate")
FENCE_EXTENSION = "wmfence"
#: Workers an event passed through on its way here; every output carries one more.
HOPS_EXTENSION = "wmhops"


def reported_type(error: Exception) -> str:
    """The type an error is reported as: a worker's own for a ``WorkerExecutionError``."""
    return error.error_type if isinstance(error, WorkerExecutionError) else type(error).__name__


@dataclass(eq=False)
class Delivery:
    """One attempt to deliver one event to one worker."""

    rt: Runtime
    meta: WorkerMeta
    event: CloudEvent
    #: The event as the broker delivered it (the pending ledger's entry holds it too).
    payload: str
    delivery_id: str
    state: DeliveryState = field(default_factory=DeliveryState)
    attempt: int = 1
    #: The broker delivers this message again (its consumer died without acknowledging it).
    redelivered: bool = False
    #: What the first round trip read beside the worker's facts: the event's recorded
    #: outcome, the features' keys (``Feature.facts``) and, when this process had not loaded
    #: the worker, its cached code, by key, as stored.
    facts: Mapping[str, Any] = field(default_factory=dict)
    lease: Lease | None = None
    #: What renews :attr:`lease` while the call runs (``wm.dataplane.features.grouplock``).
    heartbeat: Heartbeat | None = None
    #: Whether the outcome's record released the lease too (it had nothing to publish
    #: under it); None: not released with the record, the group lock releases it after.
    released: bool | None = None
    #: The outcome found recorded once the run began (read under the group lock).
    recorded: list[CloudEvent] | None = None
    #: When the engine part of the run began (``time.time()``; 0: not yet).
    began: float = 0.0
    #: The node's name (Celery's hostname), as its health records it.
    node: str = ""
    #: The shared group's id when the event came through its queue (``wm.store.shares``):
    #: then the pending ledger, the recorded outcome and the output ids are the share's, and
    #: only the code, settings and counts are the member's (``meta``).
    share: str | None = None
    #: Settles this delivery from the watchdog's thread when its call outlived its limit and
    #: cannot be stopped; the process ends after (``wm.dataplane.watchdog``). None: the
    #: process cannot be ended apart from the node, the overrun is only logged.
    on_overrun: Callable[[Delivery], None] | None = None
    #: The watchdog's watch of the engine call (None: not watched, the engine stops calls).
    watch: Watch | None = None

    @functools.cached_property
    def key(self) -> str:
        return key_of(self.event)

    @property
    def worker_settings(self) -> WorkerSettings:
        return self.meta.worker_settings

    @property
    def version(self) -> int:
        return self.state.pin_version or self.meta.version

    @property
    def owner(self) -> str:
        """Whose pending ledger and outcomes this delivery's are: the share's, or the worker's."""
        return self.share or self.meta.id

    @functools.cached_property
    def operation(self) -> str:
        """What the outcome is recorded under: the event's key, or the business key the
        worker declares (``wm.idempotency``; ``IdempotencyKeyMissing`` when it lacks it)."""
        declared = self.worker_settings.idempotency_key
        return operation_key(declared, self.event, self.owner, self.key)

    @functools.cached_property
    def outcome_key(self) -> str:
        return self.rt.outcomes.key(self.owner, self.operation)

    def outcome_key_or_none(self) -> str | None:
        """:attr:`outcome_key`, or None when the event lacks its business key."""
        try:
            return self.outcome_key
        except IdempotencyKeyMissing:
            return None

    def forget_recorded(self) -> None:
        """Read the outcome afresh when asked, not from the first round trip's facts."""
        key = self.outcome_key_or_none()
        self.facts = {k: v for k, v in self.facts.items() if k != key}

    @property
    def timeout_s(self) -> float:
        """The per-message time limit of the worker's code."""
        return self.worker_settings.timeout_s_on(self.rt.settings)

    @property
    def message_key(self) -> str:
        """This message among the deliveries of the event (each resend is a new message)."""
        return f"{self.owner}:{self.delivery_id}:{self.attempt}:{self.state.lock_waits}"

    @property
    def max_retries(self) -> int:
        return self.worker_settings.max_retries_on(self.rt.settings)

    @property
    def holder(self) -> str:
        """Who holds a lock or slot for this delivery."""
        return f"{self.rt.node}:{self.delivery_id}"

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

    def recorded_outcome(self) -> list[CloudEvent] | None:
        """The event's outcome recorded by an earlier run (read in the first round trip)."""
        if self.outcome_key in self.facts:
            return self.rt.outcomes.parse(self.facts[self.outcome_key])
        return self.rt.outcomes.get(self.owner, self.operation)

    def republish(self, recorded: list[CloudEvent]) -> None:
        """Publish a recorded outcome again instead of running the code again."""
        notify("duplicate", self.meta)
        logger.info(
            "event %s already processed by worker %s; republishing its outcome",
            self.event.get_id(),
            self.meta.id,
        )
        self.publish(recorded)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The engine's part: counted among this process's deliveries in flight (a stop asks
        for them, and may kill what runs past its grace period)."""
        self.began = time.time()
        self.rt.begin(self.meta.id)
        try:
            yield
        finally:
            self.rt.end(self.meta.id)

    def load_engine(self) -> tuple[Engine, bool]:
        """(engine, temporary): a pinned old version gets a temporary engine to close after."""
        return self.rt.engines.engine(self.meta, self.version, self.facts)

    def process(
        self, engine: Engine, recording: Callable[[StatePipeline], None], awaited: bool = False
    ) -> None:
        """Run the code, record its outcome (fence-checked in the record's script, or just
        before it on a Redis Cluster) with the features' writes (``recording``), publish
        what was recorded. An error the worker answered with is reported as
        ``worker.error`` once published. A group member with no output releases its lease
        in the record's round trip: nothing is left to do under it. The record's reply is
        not waited for where nothing is left to do after it (:meth:`_unread`), unless
        ``awaited`` (a feature acts on it)."""
        produced = self.execute(engine)
        outputs = self.stamp(produced)
        fence = None if self.lease is None else self.rt.locks.write_fence(self.lease)
        texts = [encode(e) for e in outputs]  # once, for the record and the publishes
        body = self.rt.outcomes.encoded(outputs, texts)
        # No lease to check before each push: the pushes may fold into the record's round trip
        folds = bool(outputs) and self.lease is None and self.rt.outputs.folds
        unread, settlement = None if awaited else self._unread(outputs, folds), self.settlement()
        folding = None
        if folds:
            owed = None if unread is None else settlement
            folding = self.rt.outputs.folded(outputs, texts, self.outcome_key, body, owed)
        lookups = folding or self.rt.outputs.lookups(outputs)
        # The lease to release with the record: a fenced record with nothing to publish after
        releasing = self.lease if fence is not None and not outputs else None
        if releasing is not None and self.heartbeat is not None:
            self.heartbeat.stop()  # the lease outlasts one round trip: no renewal races it

        def also(pipe: StatePipeline) -> None:  # after the lookups: their results come first
            lookups(pipe)
            recording(pipe)
            if releasing is not None:
                self.rt.locks.queue_release(pipe, releasing)

        recorded, found = self.rt.outcomes.record(
            self.owner, self.operation, outputs, settlement, also, fence, body, unread
        )
        if releasing is not None:
            self.released = self.rt.locks.released(releasing, found[-1])
        if recorded is not outputs:
            self.publish(recorded, settled=True)
        elif found:  # the routes looked up with the record (none: nothing left to publish)
            routes = self.rt.outputs.looked_up(outputs, found[: len(outputs)], bool(folding))
            self.publish(outputs, routes, settled=True, texts=texts)
        self.published(recorded, produced)

    def _unread(self, outputs: list[CloudEvent], folds: bool) -> int | None:
        """How many of the record's round trip's commands after it need not be read, when its
        reply need not be (None: it must): without outputs, the record is all; with outputs
        pushed in its round trip (``folds``) to topics without worker subscribers
        (:meth:`~wm.dataplane.outputs.OutputPublisher.quiet`), their pushes are all, and
        nothing is left to publish after them."""
        if not outputs:
            return 0
        return len(outputs) if folds and self.rt.outputs.quiet(outputs) else None

    def published(self, outputs: list[CloudEvent], produced: list[CloudEvent]) -> None:
        sent = self.event.get_time()
        if outputs and sent is not None:  # publish → output, on the publisher's clock
            notify("latency", self.meta, max(0.0, time.time() - sent.timestamp()))
        if isinstance(produced, Outputs) and produced.worker_error is not None:
            self.emit_error(produced.error_type, produced.worker_error)
        if isinstance(produced, Outputs) and produced.done is not None:
            reason = f"finished: its code said it is done ({produced.done})"
            wid = uuid.UUID(self.meta.id)
            outbox.leave_running(
                self.rt.settings, self.rt.bus, wid, Status.FINISHED, reason, actor="node"
            )

    def execute(self, engine: Engine) -> list[CloudEvent]:
        started = time.monotonic()
        try:
            with tracing.step("engine call"), self.watched(engine, started):
                return engine.process(self.event, self.timeout_s)
        finally:
            notify("engine", self.meta, time.monotonic() - started)

    def watched(self, engine: Engine, started: float) -> AbstractContextManager[object]:
        """A call the engine cannot stop is watched: at its limit the watchdog reports it
        (:meth:`tell_limit`) while it runs on; past a grace it takes the call over
        (``on_overrun``) and ends the process."""
        if engine.stops_calls():
            return contextlib.nullcontext()
        limit = started + self.timeout_s
        what = f"the call of worker {self.meta.id} on event {self.event.get_id()}"
        overrun = None if self.on_overrun is None else functools.partial(self.on_overrun, self)
        self.watch = self.rt.watchdog.watch(
            limit + OVERRUN_GRACE_S, what, overrun, limit=limit, on_limit=self.tell_limit
        )
        return self.watch

    @property
    def limit_told(self) -> bool:
        """The watchdog reported this attempt's call past its limit (``worker.error``)."""
        return self.watch is not None and self.watch.told

    def tell_limit(self) -> None:
        """``worker.error`` for a call still running past its limit, from the watchdog's
        thread, while it runs on (seed 001's unmanaged timeout)."""
        ends = (
            f"its process is replaced if it still runs {OVERRUN_GRACE_S:g} s later"
            if self.on_overrun is not None
            else "it runs on until it returns, its answer then dropped"
        )
        self.emit_error(
            WorkerTimeout.__name__,
            f"worker {self.meta.id} did not return within {self.timeout_s:g} s and its call "
            f"cannot be stopped in this process: {ends}",
        )

    def stamp(self, outputs: list[CloudEvent]) -> list[CloudEvent]:
        """Deterministic ids, propagated trace/correlation attributes, the hop count and the
        fence; an output to a topic the worker may not publish to refuses them all."""
        traced = tracing.carrier()  # the delivery's span: the next worker's parent
        return [self._stamped(index, output, traced) for index, output in enumerate(outputs)]

    def _stamped(self, index: int, output: CloudEvent, traced: Mapping[str, str]) -> CloudEvent:
        self.check_output_topic(output.get_type())
        extra: dict[str, object] = {
            "id": derive_id(self.key, self.owner, index),
            HOPS_EXTENSION: self.hops + 1,
            # the worker's own tenant, whatever its code set: its outputs stay in it
            TENANT_EXTENSION: None if self.meta.tenant == DEFAULT_TENANT else self.meta.tenant,
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
        return with_attributes(output, **extra)

    @functools.cached_property
    def hops(self) -> int:
        """Workers the event passed through on its way here."""
        try:
            return max(0, int(self.event.get_extension(HOPS_EXTENSION) or 0))
        except (TypeError, ValueError):
            return 0

    def check_output_topic(self, topic: str) -> None:
        allowed = self.worker_settings.output_topics
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
                f"output topic {topic!r} is not in the worker's {OUTPUT_TOPICS}: {list(allowed)}"
            )

    def emit_error(self, error_type: str, error_message: str) -> None:
        """Publish a ``worker.error`` lifecycle event about this attempt."""
        tenant, topic = split_route_topic(self.meta.topic)
        data = {
            "group": bare_group(self.meta.group),
            "topic": topic,  # as its tenant names it, as the other lifecycle events
            "version": self.version,
            "error_type": storable(error_type),
            "error_message": storable(error_message),
            "event_id": self.event.get_id(),
            "attempt": self.attempt,
            **tenant_fields(tenant),
        }
        self.rt.bus.publish(lifecycle_event("error", self.meta.id, data), LIFECYCLE_TOPIC)

    def publish(
        self,
        outputs: list[CloudEvent],
        routes: list[list[Route] | None] | None = None,
        *,
        settled: bool = False,
        texts: list[str] | None = None,
    ) -> None:
        """Publish each output to the topic of its type (plain subscriptions get it once,
        see ``wm.dataplane.outputs``), then settle the delivery in the pending ledger unless
        the outcome's record ``settled`` it already. ``routes``: each output's, when looked
        up already (None: look it up); ``texts``: each one's encoding, when written already."""
        for index, output in enumerate(outputs):
            with tracing.step("output publish"):
                if self.lease is not None:
                    self.rt.locks.mark_write(self.lease)
                found = routes[index] if routes else None
                self.rt.outputs.publish(output, found, texts[index] if texts else None)
        if not settled:
            self.rt.ledger.settle(self.owner, self.key, self.payload, ran_again=self.redelivered)

    def settlement(self) -> Settlement:
        """The pending ledger's entry of this delivery (and its count of runs, if kept)."""
        return self.rt.ledger.settlement(
            self.owner, self.key, self.payload, ran_again=self.redelivered
        )

    def failure(self, error: Exception) -> Failure:
        """What parking this delivery records about ``error``."""
        return Failure(
            topic=self.meta.topic,
            worker_id=self.meta.id,
            envelope=self.payload,
            key=self.key,
            event_id=self.event.get_id(),
            error_type=type(error).__name__,
            error_message=str(error),
            attempts=self.attempt,
            version=self.version,
            sha256=self.meta.sha256,
            fence=self.lease.fence if self.lease else None,
            first_failure_at=self.state.first_failure_at,
            share=self.share,
        )
