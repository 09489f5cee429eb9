"""A worker's life: create, start (now or later), suspend, resume, stop (with a grace period,
then a kill), delete, and a failure reported from outside.

Every change is one database transaction that also records the transition and writes the
lifecycle event to an outbox; the event is published after commit, so no event is ever
published for a change that did not happen, and none is lost if the broker is down. What
the nodes must do next (consume, cancel, unload, kill) is broadcast after the commit.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from wm.codesource import FetchedCode
from wm.control import tenants
from wm.control.context import Context
from wm.control.versions import Versions, add_version
from wm.control.workers import Reference, Workers
from wm.dataplane import enginecontrol, outbox, pending
from wm.dataplane.bus import Route
from wm.dataplane.queues import worker_queue_name
from wm.dataplane.routes import route_of, worker_route
from wm.dataplane.shares import leaving_queue
from wm.engine import WorkerSpec, engine_class
from wm.errors import ConcurrencyConflict, InvalidArgument, Unavailable, WorkManagerError
from wm.lifecycle import ALREADY_STARTED, ALREADY_STOPPED, Status
from wm.names import check_name, route_group, route_topic
from wm.state import quota
from wm.state.affinity import Affinity
from wm.state.breaker import Breaker
from wm.state.directory import Directory
from wm.state.health import WorkerHealth
from wm.state.ledger import Ledger
from wm.state.ordering import Ordering
from wm.store import records, shares
from wm.store import workers as rows
from wm.store.models import Worker
from wm.views import WorkerInfo
from wm.workersettings import WorkerSettings, validate_worker_settings

logger = logging.getLogger(__name__)

#: How many stops a start finishes (each raced by another stop) before it gives up.
_STOP_RACES = 3


class _Stopping(Exception):
    """Raised inside a start's transaction (which then writes nothing) when the worker is
    ``stopping``: the start finishes that stop first."""


@dataclass(frozen=True)
class _Removed:
    """A deleted worker's topic and route, whether nodes stop consuming its queue (no other
    member of its shared group runs) and whether the queue goes (no other is live)."""

    topic: str
    route: Route
    cancel: bool
    last: bool


class Lifecycle:
    def __init__(self, context: Context, workers: Workers, versions: Versions) -> None:
        self.context = context
        self.settings = context.settings
        self.workers = workers
        self.versions = versions

    # -- creation --------------------------------------------------------------------------

    def create(
        self,
        code: bytes | str | None,
        url: str | None,
        mime_type: str,
        topic: str,
        group: str | None,
        name: str | None,
        start: bool,
        sha256: str | None,
        settings: Mapping[str, Any] | None,
    ) -> WorkerInfo:
        """Validate everything, persist the worker (status ``created``), optionally start it."""
        route = self.context.route(topic)
        worker_settings = _checked_settings(mime_type, group, name, settings)
        stored_group = route_group(self.context.tenant, group)
        fetched = self.versions.fetch(code, url, sha256)
        tenant = self.context.tenant
        spec = WorkerSpec(
            str(uuid.uuid4()), topic, group, 1, fetched.sha256, name, worker_settings, tenant
        )
        self.versions.check(mime_type, fetched.code, spec)
        queue = worker_queue_name(route, spec.worker_id)
        wid = records.transaction(
            self.settings,
            lambda session: self._insert(session, spec, mime_type, fetched, queue),
            name_hint=name,
        )
        found = worker_route(spec.worker_id, route, stored_group, worker_settings, name)
        self.context.bus.add_route(route, found)
        self.context.changed(wid)
        self._share_changed(found)
        logger.info("created worker %s on topic %s", wid, route)
        return self.start(wid) if start else self.workers.get(wid)

    def _insert(
        self,
        session: Session,
        spec: WorkerSpec,
        mime_type: str,
        fetched: FetchedCode,
        queue: str,
    ) -> uuid.UUID:
        wid = uuid.UUID(spec.worker_id)
        tenants.check_room(session, spec.tenant)  # locks the tenant's row: no overshoot
        group = route_group(spec.tenant, spec.group)
        shares.check_mode(session, group, WorkerSettings.of(spec.settings).group_mode)
        worker = rows.insert_worker(
            session,
            wid,
            tenant=spec.tenant,
            name=spec.name,
            topic=route_topic(spec.tenant, spec.topic),
            group=group,
            mime_type=mime_type,
            settings=spec.settings,
            queue=queue,
        )
        add_version(session, wid, 1, fetched, note="created")
        records.record_transition(
            session,
            worker,
            None,
            Status.CREATED,
            "created",
            version=1,
            extra={"group": spec.group, "topic": spec.topic},
            actor=self.context.actor,
        )
        return wid

    # -- state changes ---------------------------------------------------------------------

    def start(self, reference: Reference, *, delay_s: float | None = None) -> WorkerInfo:
        """Start consuming the worker's queue; idempotent. A suspended worker resumes; a
        worker paused by its circuit breaker starts at once with the breaker closed; a
        finished one runs again with a fresh ``max_events``.

        With ``delay_s`` the start waits: the worker is ``pending`` now and starts by itself
        after ``delay_s`` seconds (``start`` or ``stop`` meanwhile replace the wait)."""
        wid = self.workers.resolve(reference)
        if delay_s is not None:
            return self._start_later(wid, delay_s)
        route = self._start_after_stop(wid)
        self.context.changed(wid)
        pending.forget_delayed_start(self.settings, str(wid))
        if route is not None:
            Ledger(self.settings).restart_clocks(str(route.worker_id))
            self._fresh_start(wid)
            self.context.bus.broadcast_consume(route.queue)
        return self.workers.get(wid)

    def _start_after_stop(self, wid: uuid.UUID) -> Route | None:
        """Move to ``running``; a stop in progress (another caller's, or one whose caller
        died) is finished first, joining its wait for the deliveries in flight, so that a
        start racing a stop starts the worker instead of failing."""
        for _ in range(_STOP_RACES):
            try:
                return records.transaction(self.settings, lambda s: self._start(s, wid))
            except _Stopping:
                self.stop(wid)
        raise ConcurrencyConflict(
            f"worker {wid} was stopped again each of the {_STOP_RACES} times this start "
            "finished a stop; start it again"
        )

    def _start_later(self, wid: uuid.UUID, delay_s: float) -> WorkerInfo:
        if not (math.isfinite(delay_s) and 0 < delay_s <= pending.MAX_START_DELAY_S):
            raise InvalidArgument(
                "start delay must be a positive number of seconds, at most "
                f"{pending.MAX_START_DELAY_S} (a year; a schedule starts later ones), "
                f"not {delay_s:g}"
            )
        bus = self.context.bus
        if pending.delay_start(self.settings, bus, bus.app, wid, delay_s, self.context.actor):
            self._fresh_start(wid)
        return self.workers.get(wid)

    def _fresh_start(self, wid: uuid.UUID) -> None:
        """Started by request: the breaker closed, and a fresh ``max_events``."""
        Breaker(self.settings).succeeded(str(wid))
        quota.reset(self.settings, str(wid))

    def suspend(self, reference: Reference) -> WorkerInfo:
        """Stop consuming on every node but keep the queue (messages accumulate) and the
        loaded engines; :meth:`start` delivers what accumulated. Idempotent."""
        wid = self.workers.resolve(reference)
        queue = records.transaction(self.settings, lambda session: self._suspend(session, wid))
        self.context.changed(wid)
        if queue:
            self.context.bus.broadcast_cancel(queue)
        return self.workers.get(wid)

    def stop(self, reference: Reference, *, grace_s: float | None = None) -> WorkerInfo:
        """Stop consuming, wait for the deliveries in flight, unload the engines; the queue is
        kept so the worker resumes where it left off. Idempotent.

        Deliveries still running after ``grace_s`` (default: the worker's ``stop_grace_s``,
        else 30 s) have their engine killed on their node and the worker ends ``killed``
        instead of ``stopped``; those deliveries go back to the queue and run again when the
        worker starts."""
        if grace_s is not None and not (math.isfinite(grace_s) and grace_s >= 0):
            raise InvalidArgument(
                f"grace period must be a non-negative number of seconds, not {grace_s}"
            )
        wid = self.workers.resolve(reference)
        stopping = records.transaction(self.settings, lambda session: self._stop(session, wid))
        self.context.changed(wid)
        pending.forget_delayed_start(self.settings, str(wid))
        if stopping is None:
            return self.workers.get(wid)
        queue, settings = stopping
        if queue is not None:  # None: other members of its shared group still consume
            self.context.bus.broadcast_cancel(queue)
        if grace_s is None:
            grace_s = WorkerSettings.of(settings).stop_grace_s
        target, reason = self._drain(wid, grace_s)
        records.transaction(self.settings, lambda s: self._stopped(s, wid, target, reason))
        self.context.changed(wid)
        enginecontrol.send(self.settings, enginecontrol.UNLOAD, str(wid))
        return self.workers.get(wid)

    def _drain(self, wid: uuid.UUID, grace_s: float) -> tuple[Status, str]:
        """Wait up to ``grace_s`` for the deliveries in flight, then kill their engine;
        returns the state the worker ends in and why."""
        running = enginecontrol.wait_idle(self.settings, str(wid), grace_s)
        if not running:
            return Status.STOPPED, "stopped"
        enginecontrol.send(self.settings, enginecontrol.KILL, str(wid))
        return (
            Status.KILLED,
            f"{running} deliveries still ran after the grace period of {grace_s:g} s: "
            "their engine was killed; they are delivered again when the worker starts",
        )

    def delete(self, reference: Reference) -> WorkerInfo:
        """Delete from any state; the queue goes, versions and transitions stay for audit."""
        wid = self.workers.resolve(reference)
        removed = records.transaction(self.settings, lambda s: self._delete(s, wid))
        self.context.changed(wid)
        if removed is not None:
            self._removed(removed)
            for state in (Ordering, Affinity, WorkerHealth):
                state(self.settings).forget_worker(str(wid))
            quota.reset(self.settings, str(wid))  # its count of max_events
            enginecontrol.send(self.settings, enginecontrol.UNLOAD, str(wid))
        return self.workers.get(wid)

    def _removed(self, removed: _Removed) -> None:
        """After a delete: nodes stop consuming the worker's queue, which goes with its route
        and pending deliveries; a shared group's only with its last running or live member
        (what waits in it goes to the others, or waits for one to start)."""
        route, bus = removed.route, self.context.bus
        if removed.cancel:
            bus.broadcast_cancel(route.queue)
        if removed.last:
            bus.remove_route(removed.topic, route.queue)
            Ledger(self.settings).forget_worker(str(route.worker_id))
        self._share_changed(route)

    def _share_changed(self, route: Route) -> None:
        """A shared group gained or lost a member: nodes read its members again."""
        if route.share is None:
            return
        try:
            Directory(self.settings).invalidate(route.worker_id)
        except Unavailable as exc:
            logger.warning("nodes see shared group %s change within a minute: %s", route.share, exc)

    def record_failure(
        self, reference: Reference, error_type: str, error_message: str, *, fail: bool = False
    ) -> None:
        """Publish ``worker.error``; with ``fail`` also move the worker to ``failed``, which
        stops consumption (its queue keeps the messages until it is started again)."""
        wid = self.workers.resolve(reference)
        outbox.record_failure(
            self.settings, self.context.bus, wid, error_type, error_message, fail=fail
        )

    # -- the moves, each inside its transaction ---------------------------------------------

    def _start(self, session: Session, wid: uuid.UUID) -> Route | None:
        """Move to ``running`` (through ``starting``); returns the route whose queue to
        consume, or None if there is nothing to start."""
        worker = records.lock_worker(session, wid)
        if worker.status in ALREADY_STARTED:
            return None
        if worker.status == Status.STOPPING:
            raise _Stopping
        if worker.status == Status.SUSPENDED:
            self._move(session, worker, Status.RUNNING, "resumed")
            return route_of(worker)
        self._move(session, worker, Status.STARTING, "start requested")
        try:
            engine_class(worker.mime_type)
        except WorkManagerError as exc:
            self._move(session, worker, Status.FAILED, str(exc))
            return None
        self._move(session, worker, Status.RUNNING, "started")
        return route_of(worker)

    def _suspend(self, session: Session, wid: uuid.UUID) -> str | None:
        worker = records.lock_worker(session, wid)
        if worker.status == Status.SUSPENDED:
            return None
        self._move(session, worker, Status.SUSPENDED, "suspended")
        return leaving_queue(session, worker)

    def _stop(self, session: Session, wid: uuid.UUID) -> tuple[str | None, dict[str, Any]] | None:
        """Move to ``stopping`` (a worker left there by a stopper that died stays); returns
        the queue to stop consuming (None while other members of its shared group run) and
        the worker's settings, or None if already stopped."""
        worker = records.lock_worker(session, wid)
        if worker.status in ALREADY_STOPPED:
            return None
        if worker.status != Status.STOPPING:
            self._move(session, worker, Status.STOPPING, "stop requested")
        return leaving_queue(session, worker), dict(worker.settings or {})

    def _stopped(self, session: Session, wid: uuid.UUID, target: Status, reason: str) -> None:
        worker = records.lock_worker(session, wid)
        if worker.status == Status.STOPPING:  # unless deleted (or stopped) meanwhile
            self._move(session, worker, target, reason)

    def _delete(self, session: Session, wid: uuid.UUID) -> _Removed | None:
        worker = records.lock_worker(session, wid)
        if worker.status == Status.DELETED:
            return None
        shares.lock_group(session, worker.group)  # no member joins meanwhile
        removed = _Removed(
            worker.topic,
            route_of(worker),
            cancel=not shares.others(session, worker, running=True),
            last=not shares.others(session, worker, running=False),
        )
        self._move(session, worker, Status.DELETED, "deleted")
        rows.remove_subscriptions(session, wid)
        return removed

    def _move(self, session: Session, worker: Worker, target: Status, reason: str) -> None:
        records.move(session, worker, target, reason, actor=self.context.actor)


def _checked_settings(
    mime_type: str, group: str | None, name: str | None, settings: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A new worker's settings, checked against its engine's rules, with its group's and
    its own name and the group's mode (before anything is fetched or stored)."""
    if group is not None:
        check_name("group", group)
    if name is not None:
        check_name("worker name", name)
    checked = validate_worker_settings(settings or {}, engine_class(mime_type).worker_settings)
    shares.check_group(group, WorkerSettings.of(checked).group_mode)
    return checked
