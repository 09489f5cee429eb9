"""The worker lifecycle as a Python API for admin scripts (and the ``wm`` CLI)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete as sa_delete
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from wm import codesource, store
from wm.config import Settings
from wm.engine import WorkerSpec, engine_class
from wm.errors import (
    AmbiguousReference,
    BrokerUnavailable,
    InvalidArgument,
    ScheduleNotFound,
    SubscriptionNotFound,
    VersionNotFound,
    WorkerNotFound,
    WorkManagerError,
)
from wm.events import CloudEvent
from wm.lifecycle import ALREADY_STARTED, ALREADY_STOPPED, Status, check_actor
from wm.names import check_name
from wm.schedules import MISSED, Timing
from wm.state.breaker import Breaker
from wm.state.health import WorkerHealth
from wm.state.ledger import Ledger
from wm.state.ordering import Ordering
from wm.store import records
from wm.store.models import Schedule, Subscription, Worker, WorkerTransition, WorkerVersion
from wm.views import (
    ScheduleInfo,
    TransitionInfo,
    VersionInfo,
    WorkerInfo,
)
from wm.workersettings import WorkerSettings, validate_worker_settings

# The data plane (Celery, kombu) is imported by the methods that use it: reading the store,
# as ``wm worker list`` does, needs none of it, and the command line starts faster without.
if TYPE_CHECKING:
    from wm.dataplane import overview, workerdetails
    from wm.dataplane.bus import Bus


logger = logging.getLogger(__name__)
#: Missed firings a ``catch_up`` schedule sends at most, unless told otherwise.
DEFAULT_MAX_CATCH_UP = 10


class WorkManager:
    """Create, start, stop, update, roll back and delete workers.

    Every change is one database transaction that also records the transition and writes the
    lifecycle event to an outbox; the event is published after commit, so no event is ever
    published for a change that did not happen, and none is lost if the broker is down.
    """

    def __init__(
        self, settings: Settings | None = None, *, bus: Bus | None = None, actor: str = "api"
    ) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        self._bus = bus
        #: Who the transitions this object makes are recorded as asked by (``cli`` for ``wm``).
        self.actor = check_actor(actor)

    @property
    def bus(self) -> Bus:
        from wm.dataplane import bus as bus_module

        if self._bus is None:
            self._bus = bus_module.Bus(self.settings)
        return self._bus

    # -- creation and code -----------------------------------------------------------------

    def create_worker(
        self,
        *,
        code: bytes | str | None = None,
        url: str | None = None,
        mime_type: str,
        topic: str,
        group: str | None = None,
        name: str | None = None,
        start: bool = True,
        sha256: str | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> WorkerInfo:
        """Validate everything, persist the worker (status ``created``), optionally start it."""
        from wm.dataplane import bus as bus_module
        from wm.dataplane import outbox, queues

        check_name("topic", topic)
        if name is not None:
            check_name("worker name", name)
        worker_settings = validate_worker_settings(
            settings or {}, engine_class(mime_type).worker_settings
        )
        fetched = self._fetch(code, url, sha256)
        worker_id = uuid.uuid4()
        spec = WorkerSpec(str(worker_id), topic, group, 1, fetched.sha256, name, worker_settings)
        self._validate_code(mime_type, fetched.code, spec)
        queue = queues.worker_queue_name(topic, str(worker_id))

        def insert(session: Session) -> None:
            worker = Worker(
                id=worker_id,
                name=name,
                topic=topic,
                group=group,
                mime_type=mime_type,
                status=Status.CREATED,
                current_version=1,
                settings=dict(worker_settings),
            )
            session.add(worker)
            session.flush()
            session.add(_version_row(worker_id, 1, fetched, note="created"))
            session.add(Subscription(topic=topic, queue=queue, worker_id=worker_id))
            records.record_transition(
                session,
                worker,
                None,
                Status.CREATED,
                "created",
                version=1,
                extra={"group": group, "topic": topic},
                actor=self.actor,
            )

        records.transaction(self.settings, insert, name_hint=name)
        self.bus.add_route(
            topic,
            bus_module.Route(queue, str(worker_id), bus_module.ordered(worker_settings), name),
        )
        outbox.changed(self.settings, self.bus, worker_id)
        logger.info("created worker %s on topic %s", worker_id, topic)
        return self.start_worker(worker_id) if start else self.get_worker(worker_id)

    def load_code_from_content(
        self,
        worker_id: uuid.UUID | str,
        code: bytes | str,
        *,
        sha256: str | None = None,
        note: str | None = None,
    ) -> WorkerInfo:
        """Add a new code version from inline bytes and make it current (hot reload)."""
        return self._update_code(worker_id, self._fetch(code, None, sha256), note)

    def load_code_from_url(
        self,
        worker_id: uuid.UUID | str,
        url: str,
        *,
        sha256: str | None = None,
        note: str | None = None,
    ) -> WorkerInfo:
        """Fetch code from ``url`` (SSRF-guarded), add it as a version, make it current."""
        return self._update_code(worker_id, self._fetch(None, url, sha256), note)

    def rollback_worker(self, worker_id: uuid.UUID | str, version: int) -> WorkerInfo:
        """Make an earlier version current again; recorded as a transition and an event."""
        from wm.dataplane import outbox

        wid = self._resolve(worker_id)

        def rollback(session: Session) -> None:
            worker = records.lock_worker(session, wid, live=True)
            exists = session.get(WorkerVersion, (wid, version))
            if exists is None:
                raise VersionNotFound(f"worker {wid} has no version {version}")
            previous = worker.current_version
            worker.current_version = version
            records.record_transition(
                session,
                worker,
                worker.status,
                worker.status,
                f"rolled back from version {previous} to version {version}",
                version=version,
                event="code_updated",
                actor=self.actor,
            )

        records.transaction(self.settings, rollback)
        outbox.changed(self.settings, self.bus, wid)
        return self.get_worker(wid)

    # -- state changes ---------------------------------------------------------------------

    def start_worker(
        self, worker_id: uuid.UUID | str, *, delay_s: float | None = None
    ) -> WorkerInfo:
        """Start consuming the worker's queue; idempotent. A suspended worker resumes; a
        worker paused by its circuit breaker starts at once with the breaker closed; a
        finished one runs again with a fresh ``max_events``.

        With ``delay_s`` the start waits: the worker is ``pending`` now and starts by itself
        after ``delay_s`` seconds (``start`` or ``stop`` meanwhile replace the wait)."""
        from wm.dataplane import outbox, pending
        from wm.state import quota

        wid = self._resolve(worker_id)
        if delay_s is not None:
            if not (math.isfinite(delay_s) and delay_s > 0):
                raise InvalidArgument(
                    f"start delay must be a positive number of seconds, not {delay_s}"
                )
            if pending.delay_start(self.settings, self.bus, self.bus.app, wid, delay_s, self.actor):
                Breaker(self.settings).succeeded(str(wid))
                quota.reset(self.settings, str(wid))
            return self.get_worker(wid)
        changed = records.transaction(self.settings, lambda s: self._start(s, wid))
        outbox.changed(self.settings, self.bus, wid)
        pending.forget_delayed_start(self.settings, str(wid))
        if changed:
            Ledger(self.settings).restart_clocks(str(wid))
            Breaker(self.settings).succeeded(str(wid))  # started by request: breaker closed
            quota.reset(self.settings, str(wid))  # and a fresh max_events
            self.bus.broadcast_consume(changed)
        return self.get_worker(wid)

    def suspend_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """Stop consuming on every node but keep the queue (messages accumulate) and the
        loaded engines; :meth:`resume_worker` delivers what accumulated. Idempotent."""
        from wm.dataplane import outbox

        wid = self._resolve(worker_id)
        queue = records.transaction(self.settings, lambda session: self._suspend(session, wid))
        outbox.changed(self.settings, self.bus, wid)
        if queue:
            self.bus.broadcast_cancel(queue)
        return self.get_worker(wid)

    def resume_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """A suspended worker consumes again (a running one is left as it is)."""
        return self.start_worker(worker_id)

    def stop_worker(
        self, worker_id: uuid.UUID | str, *, grace_s: float | None = None
    ) -> WorkerInfo:
        """Stop consuming, wait for the deliveries in flight, unload the engines; the queue is
        kept so the worker resumes where it left off. Idempotent.

        Deliveries still running after ``grace_s`` (default: the worker's ``stop_grace_s``,
        else 30 s) have their engine killed on their node and the worker ends ``killed``
        instead of ``stopped``; those deliveries go back to the queue and run again when the
        worker starts."""
        from wm.dataplane import enginecontrol, outbox, pending

        if grace_s is not None and not (math.isfinite(grace_s) and grace_s >= 0):
            raise InvalidArgument(
                f"grace period must be a non-negative number of seconds, not {grace_s}"
            )
        wid = self._resolve(worker_id)
        stopping = records.transaction(self.settings, lambda session: self._stop(session, wid))
        outbox.changed(self.settings, self.bus, wid)
        pending.forget_delayed_start(self.settings, str(wid))
        if stopping is None:
            return self.get_worker(wid)
        queue, settings = stopping
        self.bus.broadcast_cancel(queue)
        if grace_s is None:
            grace_s = WorkerSettings.of(settings).stop_grace_s
        running = enginecontrol.wait_idle(self.settings, str(wid), grace_s)
        if running:
            enginecontrol.send(self.settings, enginecontrol.KILL, str(wid))
            target, reason = (
                Status.KILLED,
                f"{running} deliveries still ran after the grace period of {grace_s:g} s: "
                "their engine was killed; they are delivered again when the worker starts",
            )
        else:
            target, reason = Status.STOPPED, "stopped"
        records.transaction(self.settings, lambda s: self._stopped(s, wid, target, reason))
        outbox.changed(self.settings, self.bus, wid)
        enginecontrol.send(self.settings, enginecontrol.UNLOAD, str(wid))
        return self.get_worker(wid)

    def delete_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """Delete from any state; the queue goes, versions and transitions stay for audit."""
        from wm.dataplane import enginecontrol, outbox

        wid = self._resolve(worker_id)
        removed = records.transaction(self.settings, lambda s: self._delete(s, wid))
        outbox.changed(self.settings, self.bus, wid)
        for topic, queue in removed:
            self.bus.broadcast_cancel(queue)
            self.bus.remove_route(topic, queue)
        if removed:
            Ledger(self.settings).forget_worker(str(wid))
            Ordering(self.settings).forget_worker(str(wid))
            enginecontrol.send(self.settings, enginecontrol.UNLOAD, str(wid))
        return self.get_worker(wid)

    def record_failure(
        self,
        worker_id: uuid.UUID | str,
        error_type: str,
        error_message: str,
        *,
        fail: bool = False,
    ) -> None:
        """Publish ``worker.error``; with ``fail`` also move the worker to ``failed``, which
        stops consumption (its queue keeps the messages until it is started again)."""
        from wm.dataplane import outbox

        wid = self._resolve(worker_id)
        outbox.record_failure(self.settings, self.bus, wid, error_type, error_message, fail=fail)

    # -- queries ---------------------------------------------------------------------------

    def get_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        return self._with_health([self._stored(worker_id)])[0]

    def _stored(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """The worker as the database has it (no health: a lookup, not a view)."""
        wid = self._resolve(worker_id)
        with store.session_scope(self.settings) as session:
            worker = session.get(Worker, wid)
            if worker is None:
                raise WorkerNotFound(f"no worker with id {wid}")
            version = session.get(WorkerVersion, (wid, worker.current_version))
            assert version is not None
            return records.worker_info(worker, version)

    def list_workers(
        self,
        *,
        topic: str | None = None,
        group: str | None = None,
        status: str | None = None,
    ) -> list[WorkerInfo]:
        """Workers matching every given filter, oldest first; deleted ones only if asked."""
        query = select(Worker, WorkerVersion).join(
            WorkerVersion,
            (WorkerVersion.worker_id == Worker.id)
            & (WorkerVersion.version == Worker.current_version),
        )
        if topic is not None:
            query = query.where(Worker.topic == topic)
        if group is not None:
            query = query.where(Worker.group == group)
        if status is not None:
            query = query.where(Worker.status == _status(status).value)
        else:
            query = query.where(Worker.status != Status.DELETED.value)
        with store.session_scope(self.settings) as session:
            rows = session.execute(query.order_by(Worker.created_at, Worker.id)).all()
            found = [records.worker_info(w, v) for w, v in rows]
        return self._with_health(found)

    def worker_names(self, worker_ids: Iterable[uuid.UUID | str | None]) -> dict[str, str | None]:
        """Each worker's name (None if it has none) by its id as text, deleted workers too,
        in one query that asks Redis nothing: how a listing labels the workers it mentions."""
        wanted = {uuid.UUID(str(worker_id)) for worker_id in worker_ids if worker_id}
        if not wanted:
            return {}
        with store.session_scope(self.settings) as session:
            rows = session.execute(select(Worker.id, Worker.name).where(Worker.id.in_(wanted)))
            return {str(worker_id): name for worker_id, name in rows}

    def _with_health(self, infos: list[WorkerInfo]) -> list[WorkerInfo]:
        """Each worker's last health verdict (``unknown`` while Redis cannot be asked)."""
        try:
            known = WorkerHealth(self.settings).known([str(i.id) for i in infos])
        except BrokerUnavailable as exc:
            logger.warning("workers' health unknown: %s", exc)
            return infos
        return [dataclasses.replace(i, health=known.get(str(i.id), "unknown")) for i in infos]

    def worker_details(self, worker_id: uuid.UUID | str) -> workerdetails.WorkerDetails:
        """The worker with what an operator looks at next: its queue's depth, dead letters
        not replayed, last error, recent deliveries and circuit breaker (a part whose
        service does not answer is None, and named in ``unavailable``)."""
        from wm.dataplane import workerdetails

        info = self.get_worker(worker_id)
        return workerdetails.worker_details(self.settings, self.bus, info)

    def status(self, *, ping_timeout_s: float | None = None) -> overview.Overview:
        """The cluster at a glance: nodes answering a ping within ``ping_timeout_s``, workers
        by status and health, the deepest queues, dead letters per topic, breakers and
        recovery. A part whose service does not answer is None, and named in
        ``unavailable``; an unreachable database raises :class:`~wm.errors.DatabaseError`."""
        from wm.dataplane import overview

        timeout_s = overview.PING_TIMEOUT_S if ping_timeout_s is None else ping_timeout_s
        return overview.overview(self.settings, self.bus, timeout_s)

    def get_worker_history(self, worker_id: uuid.UUID | str) -> list[VersionInfo]:
        """Every code version, oldest first."""
        wid = self._resolve(worker_id)
        self._stored(wid)
        with store.session_scope(self.settings) as session:
            rows = session.scalars(
                select(WorkerVersion)
                .where(WorkerVersion.worker_id == wid)
                .order_by(WorkerVersion.version)
            ).all()
            return [records.version_info(v) for v in rows]

    def get_worker_transitions(self, worker_id: uuid.UUID | str) -> list[TransitionInfo]:
        """The audit trail of state changes and code changes, oldest first."""
        wid = self._resolve(worker_id)
        self._stored(wid)
        with store.session_scope(self.settings) as session:
            rows = session.scalars(
                select(WorkerTransition)
                .where(WorkerTransition.worker_id == wid)
                .order_by(WorkerTransition.id)
            ).all()
            return [records.transition_info(t) for t in rows]

    def get_code(self, worker_id: uuid.UUID | str, version: int | None = None) -> bytes:
        info = self._stored(worker_id)
        with store.session_scope(self.settings) as session:
            row = session.get(WorkerVersion, (info.id, version or info.current_version))
            if row is None:
                raise VersionNotFound(f"worker {info.id} has no version {version}")
            return bytes(row.code)

    # -- schedules -------------------------------------------------------------------------

    def add_schedule(
        self,
        worker_id: uuid.UUID | str,
        *,
        event_type: str,
        cron: str | None = None,
        every_s: float | None = None,
        timezone: str = "UTC",
        data: Any = None,
        missed: str = "skip",
        max_catch_up: int = DEFAULT_MAX_CATCH_UP,
        until: datetime | None = None,
    ) -> ScheduleInfo:
        """Send ``event_type`` (with ``data``) to the worker at every firing of a cron
        expression in ``timezone`` or every ``every_s`` seconds, until ``until``; firings no
        beat was running for are skipped or caught up (at most ``max_catch_up``)."""
        wid = self._resolve(worker_id)
        Timing(cron, timezone, every_s).check()
        check_name("event type", event_type)
        if missed not in MISSED:
            raise InvalidArgument(f"missed must be one of {', '.join(MISSED)}, not {missed!r}")
        if max_catch_up < 1:
            raise InvalidArgument("max_catch_up must be at least 1")
        if until is not None and until.tzinfo is None:
            raise InvalidArgument("until needs a time zone (e.g. 2026-12-31T00:00:00+00:00)")
        try:
            json.dumps(data, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"a schedule's data must be JSON: {exc}") from None
        schedule_id = str(uuid.uuid4())

        def add(session: Session) -> ScheduleInfo:
            records.lock_worker(session, wid, live=True)
            row = Schedule(
                id=schedule_id,
                worker_id=wid,
                cron=cron,
                timezone=timezone,
                every_s=every_s,
                event_type=event_type,
                data=data,
                missed=missed,
                max_catch_up=max_catch_up,
                until=until,
                created_at=datetime.now(UTC),
            )
            session.add(row)
            session.flush()
            return records.schedule_info(row)

        return records.transaction(self.settings, add)

    def list_schedules(self, worker_id: uuid.UUID | str | None = None) -> list[ScheduleInfo]:
        """Schedules of live workers (of one worker), oldest first."""
        query = (
            select(Schedule)
            .join(Worker, Worker.id == Schedule.worker_id)
            .where(Worker.status != Status.DELETED.value)
            .order_by(Schedule.created_at, Schedule.id)
        )
        if worker_id is not None:
            query = query.where(Schedule.worker_id == self._stored(worker_id).id)
        with store.session_scope(self.settings) as session:
            return [records.schedule_info(row) for row in session.scalars(query).all()]

    def remove_schedule(self, schedule_id: str) -> None:
        """Remove a schedule; firings already sent stay in the worker's queue."""

        def remove(session: Session) -> None:
            found = session.get(Schedule, schedule_id)
            if found is None:
                full = records.by_prefix(session, Schedule.id, schedule_id, "schedule")
                found = None if full is None else session.get(Schedule, full)
            if found is None:
                raise ScheduleNotFound(f"no schedule with id or short id {schedule_id!r}")
            session.delete(found)

        records.transaction(self.settings, remove)

    def worker_id_of(self, reference: str, *, deleted_names: bool = False) -> str:
        """A worker's id from its id or short id (a deleted worker's too: its dead letters
        stay reachable) or from a live worker's name -- with ``deleted_names``, from a deleted
        worker's name as well, unless several deleted workers had it."""
        try:
            return str(self._resolve(reference, deleted=True))
        except WorkerNotFound:
            if not deleted_names:
                raise
        with store.session_scope(self.settings) as session:
            gone = session.scalars(
                select(Worker.id).where(
                    Worker.name == reference, Worker.status == Status.DELETED.value
                )
            ).all()
        if len(gone) == 1:
            return str(gone[0])
        if gone:
            raise AmbiguousReference(
                f"{len(gone)} deleted workers were named {reference!r} "
                f"({', '.join(map(str, gone))}); give the worker's id"
            )
        raise WorkerNotFound(f"no worker with id, short id or name {reference!r}")

    # -- plain subscriptions ---------------------------------------------------------------

    def subscribe(self, topic: str, name: str) -> str:
        """A named durable queue fed by ``topic`` that any kombu client can read; idempotent.

        Returns the queue name. Messages are structured-mode CloudEvent JSON.
        """
        from wm.dataplane import bus as bus_module
        from wm.dataplane import queues

        queue = queues.plain_queue_name(
            check_name("topic", topic), check_name("subscription name", name)
        )

        def add(session: Session) -> None:
            found = session.scalar(select(Subscription).where(Subscription.queue == queue))
            if found is None:
                session.add(Subscription(topic=topic, queue=queue, worker_id=None))

        records.transaction(self.settings, add)
        self.bus.add_route(topic, bus_module.Route(queue, None))
        return queue

    def unsubscribe(self, topic: str, name: str, *, delete_queue: bool = True) -> None:
        """Remove a plain subscription and (by default) its queue with what it holds."""
        from wm.dataplane import queues

        queue = queues.plain_queue_name(topic, name)

        def remove(session: Session) -> None:
            result = session.execute(
                sa_delete(Subscription).where(
                    Subscription.queue == queue, Subscription.worker_id.is_(None)
                )
            )
            if not getattr(result, "rowcount", 0):
                raise SubscriptionNotFound(f"topic {topic!r} has no subscription named {name!r}")

        records.transaction(self.settings, remove)
        self.bus.remove_route(topic, queue, delete_queue=delete_queue)

    def list_subscriptions(self, topic: str | None = None) -> list[dict[str, Any]]:
        """Every subscription (worker and plain) with its queue depth."""
        query = select(Subscription).order_by(Subscription.topic, Subscription.queue)
        if topic is not None:
            query = query.where(Subscription.topic == topic)
        with store.session_scope(self.settings) as session:
            rows = [(s.topic, s.queue, s.worker_id) for s in session.scalars(query).all()]
        return [
            {
                "topic": t,
                "queue": q,
                "worker_id": str(w) if w else None,
                "depth": self.bus.queue_depth(q),
            }
            for t, q, w in rows
        ]

    # -- events ----------------------------------------------------------------------------

    def publish(self, event: CloudEvent, topic: str | None = None) -> int:
        """Publish ``event`` to ``topic`` (default: its type); returns subscriptions reached."""
        return self.bus.publish(event, topic)

    def flush_outbox(self) -> int:
        """Publish lifecycle events written by committed changes; returns how many were sent."""
        from wm.dataplane import outbox

        return outbox.flush(self.settings, self.bus)

    # -- internals -------------------------------------------------------------------------

    def _fetch(
        self, code: bytes | str | None, url: str | None, sha256: str | None
    ) -> codesource.FetchedCode:
        if (code is None) == (url is None):
            raise InvalidArgument("give exactly one of code= or url=")
        if url is not None:
            return codesource.from_url(url, settings=self.settings, sha256=sha256)
        assert code is not None
        return codesource.from_content(code, settings=self.settings, sha256=sha256)

    def _validate_code(self, mime_type: str, code: bytes, spec: WorkerSpec) -> None:
        engine = engine_class(mime_type)(self.settings)
        engine.validate(code, spec)

    def _update_code(
        self, worker_id: uuid.UUID | str, fetched: codesource.FetchedCode, note: str | None
    ) -> WorkerInfo:
        from wm.dataplane import outbox

        info = self._stored(worker_id)
        spec = WorkerSpec(
            str(info.id),
            info.topic,
            info.group,
            info.current_version + 1,
            fetched.sha256,
            info.name,
            info.settings,
        )
        self._validate_code(info.mime_type, fetched.code, spec)

        def add_version(session: Session) -> None:
            worker = records.lock_worker(session, info.id, live=True)
            latest = (
                session.scalar(
                    select(func.max(WorkerVersion.version)).where(
                        WorkerVersion.worker_id == info.id
                    )
                )
                or 0
            )
            version = latest + 1
            session.add(_version_row(info.id, version, fetched, note=note))
            worker.current_version = version
            records.record_transition(
                session,
                worker,
                worker.status,
                worker.status,
                f"code updated to version {version}",
                version=version,
                event="code_updated",
                actor=self.actor,
            )

        records.transaction(self.settings, add_version)
        outbox.changed(self.settings, self.bus, info.id)
        return self.get_worker(info.id)

    def _start(self, session: Session, wid: uuid.UUID) -> str | None:
        from wm.dataplane import queues

        worker = records.lock_worker(session, wid)
        if worker.status in ALREADY_STARTED:
            return None
        if worker.status == Status.SUSPENDED:
            records.move(session, worker, Status.RUNNING, "resumed", actor=self.actor)
            return queues.worker_queue_name(worker.topic, str(wid))
        records.move(session, worker, Status.STARTING, "start requested", actor=self.actor)
        try:
            engine_class(worker.mime_type)
        except WorkManagerError as exc:
            records.move(session, worker, Status.FAILED, str(exc), actor=self.actor)
            return None
        records.move(session, worker, Status.RUNNING, "started", actor=self.actor)
        return queues.worker_queue_name(worker.topic, str(wid))

    def _suspend(self, session: Session, wid: uuid.UUID) -> str | None:
        from wm.dataplane import queues

        worker = records.lock_worker(session, wid)
        if worker.status == Status.SUSPENDED:
            return None
        records.move(session, worker, Status.SUSPENDED, "suspended", actor=self.actor)
        return queues.worker_queue_name(worker.topic, str(wid))

    def _stop(self, session: Session, wid: uuid.UUID) -> tuple[str, dict[str, Any]] | None:
        """Move to ``stopping`` (a worker left there by a stopper that died stays); returns
        the queue to stop consuming and the worker's settings, or None if already stopped."""
        from wm.dataplane import queues

        worker = records.lock_worker(session, wid)
        if worker.status in ALREADY_STOPPED:
            return None
        if worker.status != Status.STOPPING:
            records.move(session, worker, Status.STOPPING, "stop requested", actor=self.actor)
        return queues.worker_queue_name(worker.topic, str(wid)), dict(worker.settings or {})

    def _stopped(self, session: Session, wid: uuid.UUID, target: Status, reason: str) -> None:
        worker = records.lock_worker(session, wid)
        if worker.status == Status.STOPPING:  # unless deleted (or stopped) meanwhile
            records.move(session, worker, target, reason, actor=self.actor)

    def _delete(self, session: Session, wid: uuid.UUID) -> list[tuple[str, str]]:
        worker = records.lock_worker(session, wid)
        if worker.status == Status.DELETED:
            return []
        records.move(session, worker, Status.DELETED, "deleted", actor=self.actor)
        subs = session.scalars(select(Subscription).where(Subscription.worker_id == wid)).all()
        removed = [(s.topic, s.queue) for s in subs]
        for sub in subs:
            session.delete(sub)
        return removed

    def _resolve(self, worker_id: uuid.UUID | str, *, deleted: bool = False) -> uuid.UUID:
        """Accept a UUID, its text, a live worker's name, or a unique short id (a prefix of
        at least 6 characters) of a live worker (of any worker with ``deleted``)."""
        if isinstance(worker_id, uuid.UUID):
            return worker_id
        try:
            return uuid.UUID(worker_id)
        except ValueError:
            pass
        live = Worker.status != Status.DELETED.value
        with store.session_scope(self.settings) as session:
            found = session.scalar(select(Worker.id).where(Worker.name == worker_id, live))
            if found is None:
                found = records.by_prefix(
                    session, Worker.id, worker_id, "worker", *(() if deleted else (live,))
                )
        if found is None:
            raise WorkerNotFound(f"no worker with id, short id or name {worker_id!r}")
        return uuid.UUID(str(found))


def _version_row(
    wid: uuid.UUID, version: int, fetched: codesource.FetchedCode, *, note: str | None
) -> WorkerVersion:
    return WorkerVersion(
        worker_id=wid,
        version=version,
        source_kind=fetched.source_kind,
        url=fetched.url,
        sha256=fetched.sha256,
        size=fetched.size,
        code=fetched.code,
        note=note,
    )


def _status(value: str) -> Status:
    try:
        return Status(value)
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise InvalidArgument(f"unknown status {value!r}; known: {known}") from None
