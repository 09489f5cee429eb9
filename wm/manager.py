"""The worker lifecycle as a Python API for admin scripts (and the ``wm`` CLI)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sqlalchemy import delete as sa_delete
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError as SAIntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from engines import WorkerSpec, engine_class
from wm import codesource, store
from wm.bus import Bus, plain_queue_name, worker_queue_name
from wm.config import Settings
from wm.directory import Directory
from wm.errors import (
    BrokerUnavailable,
    ConcurrencyConflict,
    DatabaseError,
    IllegalTransition,
    InvalidArgument,
    SubscriptionNotFound,
    VersionNotFound,
    WorkerNotFound,
    WorkManagerError,
)
from wm.events import LIFECYCLE_TOPIC, CloudEvent, decode, encode, lifecycle_event
from wm.ledger import Ledger
from wm.lifecycle import ALREADY_STARTED, ALREADY_STOPPED, EVENT_ON_ENTER, Status, check_transition
from wm.models import OutboxEvent, Subscription, Worker, WorkerTransition, WorkerVersion
from wm.views import TransitionInfo, VersionInfo, WorkerInfo, validate_worker_settings

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: How often a change is retried when a concurrent writer got there first.
_CONFLICT_RETRIES = 8


class WorkManager:
    """Create, start, stop, update, roll back and delete workers.

    Every change is one database transaction that also records the transition and writes the
    lifecycle event to an outbox; the event is published after commit, so no event is ever
    published for a change that did not happen, and none is lost if the broker is down.
    """

    def __init__(self, settings: Settings | None = None, *, bus: Bus | None = None) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        self._bus = bus

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            self._bus = Bus(self.settings)
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
        _require_text("topic", topic)
        worker_settings = validate_worker_settings(settings or {})
        fetched = self._fetch(code, url, sha256)
        worker_id = uuid.uuid4()
        spec = WorkerSpec(str(worker_id), topic, group, 1, fetched.sha256, name, worker_settings)
        self._validate_code(mime_type, fetched.code, spec)
        queue = worker_queue_name(topic, str(worker_id))

        def insert(session: Session) -> None:
            session.add(
                Worker(
                    id=worker_id,
                    name=name,
                    topic=topic,
                    group=group,
                    mime_type=mime_type,
                    status=Status.CREATED,
                    current_version=1,
                    settings=dict(worker_settings),
                )
            )
            session.flush()
            session.add(_version_row(worker_id, 1, fetched, note="created"))
            session.add(Subscription(topic=topic, queue=queue, worker_id=worker_id))
            self._record(
                session,
                worker_id,
                None,
                Status.CREATED,
                "created",
                version=1,
                extra={"group": group, "topic": topic},
            )

        self._transaction(insert, name_hint=name)
        self.bus.add_route(topic, queue, str(worker_id))
        self._changed(worker_id)
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
        wid = self._resolve(worker_id)

        def rollback(session: Session) -> None:
            worker = self._lock(session, wid, live=True)
            exists = session.get(WorkerVersion, (wid, version))
            if exists is None:
                raise VersionNotFound(f"worker {wid} has no version {version}")
            previous = worker.current_version
            worker.current_version = version
            self._record(
                session,
                wid,
                worker.status,
                worker.status,
                f"rolled back from version {previous} to version {version}",
                version=version,
                event="code_updated",
                worker=worker,
            )

        self._transaction(rollback)
        self._changed(wid)
        return self.get_worker(wid)

    # -- state changes ---------------------------------------------------------------------

    def start_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """Start consuming the worker's queue; idempotent."""
        wid = self._resolve(worker_id)
        changed = self._transaction(lambda s: self._start(s, wid))
        self._changed(wid)
        if changed:
            Ledger(self.settings).restart_clocks(str(wid))
            self.bus.broadcast_consume(changed)
        return self.get_worker(wid)

    def stop_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """Stop consuming; the queue is kept so the worker resumes where it left off."""
        wid = self._resolve(worker_id)
        changed = self._transaction(lambda s: self._stop(s, wid))
        self._changed(wid)
        if changed:
            self.bus.broadcast_cancel(changed)
        return self.get_worker(wid)

    def delete_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """Delete from any state; the queue goes, versions and transitions stay for audit."""
        wid = self._resolve(worker_id)
        removed = self._transaction(lambda s: self._delete(s, wid))
        self._changed(wid)
        for topic, queue in removed:
            self.bus.broadcast_cancel(queue)
            self.bus.remove_route(topic, queue)
        if removed:
            Ledger(self.settings).forget_worker(str(wid))
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
        wid = self._resolve(worker_id)

        def record(session: Session) -> str | None:
            worker = self._lock(session, wid)
            data = {"error_type": error_type, "error_message": error_message}
            self._outbox(session, "error", worker, data, reason=error_message)
            if fail and worker.status in (Status.STARTING, Status.RUNNING):
                self._move(session, worker, Status.FAILED, f"{error_type}: {error_message}")
                return worker_queue_name(worker.topic, str(wid))
            return None

        failed_queue = self._transaction(record)
        self._changed(wid)
        if failed_queue:
            self.bus.broadcast_cancel(failed_queue)

    # -- queries ---------------------------------------------------------------------------

    def get_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        wid = self._resolve(worker_id)
        with store.session_scope(self.settings) as session:
            worker = session.get(Worker, wid)
            if worker is None:
                raise WorkerNotFound(f"no worker with id {wid}")
            version = session.get(WorkerVersion, (wid, worker.current_version))
            assert version is not None
            return WorkerInfo.of(worker, version)

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
            return [WorkerInfo.of(w, v) for w, v in rows]

    def get_worker_history(self, worker_id: uuid.UUID | str) -> list[VersionInfo]:
        """Every code version, oldest first."""
        wid = self._resolve(worker_id)
        self.get_worker(wid)
        with store.session_scope(self.settings) as session:
            rows = session.scalars(
                select(WorkerVersion)
                .where(WorkerVersion.worker_id == wid)
                .order_by(WorkerVersion.version)
            ).all()
            return [VersionInfo.of(v) for v in rows]

    def get_worker_transitions(self, worker_id: uuid.UUID | str) -> list[TransitionInfo]:
        """The audit trail of state changes and code changes, oldest first."""
        wid = self._resolve(worker_id)
        self.get_worker(wid)
        with store.session_scope(self.settings) as session:
            rows = session.scalars(
                select(WorkerTransition)
                .where(WorkerTransition.worker_id == wid)
                .order_by(WorkerTransition.id)
            ).all()
            return [TransitionInfo.of(t) for t in rows]

    def get_code(self, worker_id: uuid.UUID | str, version: int | None = None) -> bytes:
        info = self.get_worker(worker_id)
        with store.session_scope(self.settings) as session:
            row = session.get(WorkerVersion, (info.id, version or info.current_version))
            if row is None:
                raise VersionNotFound(f"worker {info.id} has no version {version}")
            return bytes(row.code)

    # -- plain subscriptions ---------------------------------------------------------------

    def subscribe(self, topic: str, name: str) -> str:
        """A named durable queue fed by ``topic`` that any kombu client can read; idempotent.

        Returns the queue name. Messages are structured-mode CloudEvent JSON.
        """
        _require_text("topic", topic)
        _require_text("name", name)
        queue = plain_queue_name(topic, name)

        def add(session: Session) -> None:
            found = session.scalar(select(Subscription).where(Subscription.queue == queue))
            if found is None:
                session.add(Subscription(topic=topic, queue=queue, worker_id=None))

        self._transaction(add)
        self.bus.add_route(topic, queue, None)
        return queue

    def unsubscribe(self, topic: str, name: str, *, delete_queue: bool = True) -> None:
        """Remove a plain subscription and (by default) its queue with what it holds."""
        queue = plain_queue_name(topic, name)

        def remove(session: Session) -> None:
            result = session.execute(
                sa_delete(Subscription).where(
                    Subscription.queue == queue, Subscription.worker_id.is_(None)
                )
            )
            if not getattr(result, "rowcount", 0):
                raise SubscriptionNotFound(f"topic {topic!r} has no subscription named {name!r}")

        self._transaction(remove)
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
        sent = 0
        try:
            with store.session_scope(self.settings) as session:
                rows = session.scalars(
                    select(OutboxEvent)
                    .order_by(OutboxEvent.id)
                    .limit(500)
                    .with_for_update(skip_locked=True)
                ).all()
                for row in rows:
                    self.bus.publish(decode(row.payload), row.topic)
                    session.delete(row)
                    sent += 1
        except (BrokerUnavailable, DatabaseError) as exc:
            logger.warning("lifecycle events stay in the outbox for the next try: %s", exc)
        return sent

    # -- internals -------------------------------------------------------------------------

    def _changed(self, wid: uuid.UUID) -> None:
        """After a commit: nodes re-read the worker, lifecycle events go out."""
        try:
            Directory(self.settings).invalidate(str(wid))
        except BrokerUnavailable as exc:
            logger.warning("nodes will see worker %s change after their reconcile: %s", wid, exc)
        self.flush_outbox()

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
        info = self.get_worker(worker_id)
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
            worker = self._lock(session, info.id, live=True)
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
            self._record(
                session,
                info.id,
                worker.status,
                worker.status,
                f"code updated to version {version}",
                version=version,
                event="code_updated",
                worker=worker,
            )

        self._transaction(add_version)
        self._changed(info.id)
        return self.get_worker(info.id)

    def _start(self, session: Session, wid: uuid.UUID) -> str | None:
        worker = self._lock(session, wid)
        if worker.status in ALREADY_STARTED:
            return None
        self._move(session, worker, Status.STARTING, "start requested")
        try:
            engine_class(worker.mime_type)
        except WorkManagerError as exc:
            self._move(session, worker, Status.FAILED, str(exc))
            return None
        self._move(session, worker, Status.RUNNING, "started")
        return worker_queue_name(worker.topic, str(wid))

    def _stop(self, session: Session, wid: uuid.UUID) -> str | None:
        worker = self._lock(session, wid)
        if worker.status in ALREADY_STOPPED:
            return None
        self._move(session, worker, Status.STOPPING, "stop requested")
        self._move(session, worker, Status.STOPPED, "stopped")
        return worker_queue_name(worker.topic, str(wid))

    def _delete(self, session: Session, wid: uuid.UUID) -> list[tuple[str, str]]:
        worker = self._lock(session, wid)
        if worker.status == Status.DELETED:
            return []
        self._move(session, worker, Status.DELETED, "deleted")
        subs = session.scalars(select(Subscription).where(Subscription.worker_id == wid)).all()
        removed = [(s.topic, s.queue) for s in subs]
        for sub in subs:
            session.delete(sub)
        return removed

    def _move(self, session: Session, worker: Worker, target: Status, reason: str) -> None:
        source = worker.status
        worker.status = check_transition(str(worker.id), source, target).value
        self._record(
            session,
            worker.id,
            source,
            target,
            reason,
            version=worker.current_version,
            worker=worker,
        )

    def _record(
        self,
        session: Session,
        wid: uuid.UUID,
        source: str | None,
        target: Status | str,
        reason: str,
        *,
        version: int | None = None,
        event: str | None = None,
        worker: Worker | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        session.add(
            WorkerTransition(
                worker_id=wid,
                from_status=source,
                to_status=str(target),
                reason=reason,
                version=version,
            )
        )
        kind = event or EVENT_ON_ENTER.get(Status(target))
        if kind is None:
            return
        worker = worker or session.get(Worker, wid)
        assert worker is not None
        data = {"from_state": source, "to_state": str(target), **(extra or {})}
        self._outbox(session, kind, worker, data, reason=reason, version=version)

    def _outbox(
        self,
        session: Session,
        kind: str,
        worker: Worker,
        data: Mapping[str, Any],
        *,
        reason: str,
        version: int | None = None,
    ) -> None:
        payload = {
            "group": worker.group,
            "topic": worker.topic,
            "name": worker.name,
            "version": version or worker.current_version,
            "reason": reason,
            **data,
        }
        event = lifecycle_event(kind, str(worker.id), payload)
        session.add(OutboxEvent(topic=LIFECYCLE_TOPIC, payload=encode(event)))

    def _lock(self, session: Session, wid: uuid.UUID, *, live: bool = False) -> Worker:
        """The worker row, locked for update (PostgreSQL); ``live`` refuses deleted workers."""
        worker = session.scalars(
            select(Worker).where(Worker.id == wid).with_for_update()
        ).one_or_none()
        if worker is None:
            raise WorkerNotFound(f"no worker with id {wid}")
        if live and worker.status == Status.DELETED:
            raise IllegalTransition(f"worker {wid} is deleted; its code can no longer change")
        return worker

    def _transaction(self, change: Callable[[Session], T], name_hint: str | None = None) -> T:
        """Run ``change`` in a transaction, retrying when a concurrent writer won a race."""
        last: Exception | None = None
        for _ in range(_CONFLICT_RETRIES):
            try:
                with store.session_scope(self.settings) as session:
                    return change(session)
            except StaleDataError as exc:
                last = exc
            except DatabaseError as exc:
                if not exc.transient:
                    raise
                last = exc
            except SAIntegrityError as exc:
                if name_hint is not None and "name" in str(exc.orig).lower():
                    raise InvalidArgument(f"a live worker is already named {name_hint!r}") from exc
                last = exc
        raise ConcurrencyConflict(
            f"the change was not applied: the worker kept changing under it ({last}); retry"
        ) from last

    def _resolve(self, worker_id: uuid.UUID | str) -> uuid.UUID:
        """Accept a UUID, its text, or a live worker's name."""
        if isinstance(worker_id, uuid.UUID):
            return worker_id
        try:
            return uuid.UUID(worker_id)
        except ValueError:
            pass
        with store.session_scope(self.settings) as session:
            found = session.scalar(
                select(Worker.id).where(
                    Worker.name == worker_id, Worker.status != Status.DELETED.value
                )
            )
        if found is None:
            raise WorkerNotFound(f"no worker with id or name {worker_id!r}")
        return found


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


def _require_text(field: str, value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{field} must be a non-empty string")
