"""The WorkManager facade for admin scripts, the ``wm`` CLI and the HTTP API: each method hands
its call to a part of ``wm.control``. The parts that need the data plane (Celery, kombu) are
built on first use, so a command that only reads, as ``wm worker list``, loads none of it."""

from __future__ import annotations

import uuid
from collections.abc import Generator, Iterable, Iterator, Mapping
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from wm.config import Settings
from wm.control import tenants
from wm.control.access import Audit, Tokens
from wm.control.context import Context
from wm.control.schedules import DEFAULT_MAX_CATCH_UP, Schedules
from wm.control.versions import Versions
from wm.control.workers import Workers
from wm.events import CloudEvent
from wm.lifecycle import check_actor
from wm.views import (
    RecoveryReport,
    ScheduleInfo,
    SessionInfo,
    TenantInfo,
    TransitionInfo,
    VersionInfo,
    WorkerInfo,
)
from wm.workersettings import with_group_mode

if TYPE_CHECKING:
    from wm.control.deadletters import DeadLetters
    from wm.control.lifecycle import Lifecycle
    from wm.control.subscriptions import Subscriptions
    from wm.dataplane.bus import Bus
    from wm.views import Overview, WorkerDetails


class WorkManager:
    """Create, start, stop, update, roll back and delete workers; publish events; schedules,
    subscriptions, dead letters, API tokens and the audit log.

    Every change is one database transaction that also records the transition and writes the
    lifecycle event to an outbox; the event is published after commit, so no event is ever
    published for a change that did not happen, and none is lost if the broker is down.
    A worker is named by its id, a unique short id (6+ characters) or a live worker's name.

    Every call works in one tenant, ``tenant`` (WM_TENANT unless given, by default the
    default tenant; any other must exist, see :meth:`create_tenant`): it sees, names and
    publishes to that tenant's workers, topics, subscriptions, schedules and dead letters
    only, and another tenant's are not found, exactly as missing ones. API tokens (created
    in this tenant unless told otherwise) and the audit log are deployment-wide;
    :meth:`status` and :meth:`recover` are too unless told ``own_tenant``.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        bus: Bus | None = None,
        actor: str = "api",
        tenant: str | None = None,
    ) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        #: Who the transitions this object makes are recorded as asked by (``cli`` for ``wm``).
        self.actor = check_actor(actor)
        #: The tenant every call works in (:class:`TenantNotFound` if it was never created).
        given = self.settings.tenant if tenant is None else tenant
        self.tenant = tenants.checked(self.settings, given)
        self._context = Context(self.settings, self.actor, bus, self.tenant)
        self._workers = Workers(self._context)
        self._versions = Versions(self._context, self._workers)
        self._schedules = Schedules(self._workers)
        #: API tokens (``wm token``) and the audit log of the HTTP API's changes (``wm audit``).
        self.tokens = Tokens(self.settings, self.tenant)
        self.audit = Audit(self.settings)

    @property
    def bus(self) -> Bus:
        return self._context.bus

    @cached_property
    def dead_letters(self) -> DeadLetters:
        """Dead letters: ``list``, ``count``, ``get``, ``replay``, ``purge``."""
        from wm.control.deadletters import DeadLetters

        return DeadLetters(self.settings, tenant=self.tenant, make_bus=lambda: self.bus)

    @cached_property
    def _lifecycle(self) -> Lifecycle:
        from wm.control.lifecycle import Lifecycle

        return Lifecycle(self._context, self._workers, self._versions)

    @cached_property
    def _subscriptions(self) -> Subscriptions:
        from wm.control.subscriptions import Subscriptions

        return Subscriptions(self._context)

    # -- the lifecycle (wm.control.lifecycle) and code versions (wm.control.versions) -------

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
        group_mode: str | None = None,
    ) -> WorkerInfo:
        """Validate everything, persist the worker (status ``created``), optionally start it.

        ``group_mode`` (the worker setting of that name): ``exclusive`` (default), every
        member of ``group`` runs every event, one at a time; ``shared``, each event runs on
        one member. Every member of a group gives the same."""
        settings = with_group_mode(settings, group_mode)
        create = self._lifecycle.create
        return create(code, url, mime_type, topic, group, name, start, sha256, settings)

    def load_code_from_content(
        self,
        worker_id: uuid.UUID | str,
        code: bytes | str,
        *,
        sha256: str | None = None,
        note: str | None = None,
    ) -> WorkerInfo:
        """Add a new code version from inline bytes and make it current (hot reload)."""
        return self._versions.update(worker_id, self._versions.fetch(code, None, sha256), note)

    def load_code_from_url(
        self,
        worker_id: uuid.UUID | str,
        url: str,
        *,
        sha256: str | None = None,
        note: str | None = None,
    ) -> WorkerInfo:
        """Fetch code from ``url`` (SSRF-guarded), add it as a version, make it current."""
        return self._versions.update(worker_id, self._versions.fetch(None, url, sha256), note)

    def rollback_worker(self, worker_id: uuid.UUID | str, version: int) -> WorkerInfo:
        """Make an earlier version current again; recorded as a transition and an event."""
        return self._versions.rollback(worker_id, version)

    def start_worker(
        self, worker_id: uuid.UUID | str, *, delay_s: float | None = None
    ) -> WorkerInfo:
        """Start consuming the worker's queue (after ``delay_s`` seconds); idempotent."""
        return self._lifecycle.start(worker_id, delay_s=delay_s)

    def suspend_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """Stop consuming but keep the queue and the loaded engines; idempotent."""
        return self._lifecycle.suspend(worker_id)

    def resume_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """A suspended worker consumes again (a running one is left as it is)."""
        return self._lifecycle.start(worker_id)

    def stop_worker(
        self, worker_id: uuid.UUID | str, *, grace_s: float | None = None
    ) -> WorkerInfo:
        """Stop consuming, wait up to ``grace_s`` for deliveries in flight, unload the engines."""
        return self._lifecycle.stop(worker_id, grace_s=grace_s)

    def delete_worker(self, worker_id: uuid.UUID | str) -> WorkerInfo:
        """Delete from any state; the queue goes, versions and transitions stay for audit."""
        return self._lifecycle.delete(worker_id)

    def record_failure(
        self, worker_id: uuid.UUID | str, error_type: str, error_message: str, *, fail: bool = False
    ) -> None:
        """Publish ``worker.error``; with ``fail`` also move the worker to ``failed``."""
        self._lifecycle.record_failure(worker_id, error_type, error_message, fail=fail)

    # -- queries (wm.control.workers, the status read models) and schedules --------------

    def get_worker(self, worker_id: uuid.UUID | str, *, health: bool = True) -> WorkerInfo:
        """The worker; with ``health=False`` as the database has it, Redis not asked (its
        ``health`` left unknown)."""
        return self._workers.get(worker_id) if health else self._workers.stored(worker_id)

    def list_workers(
        self, *, topic: str | None = None, group: str | None = None, status: str | None = None
    ) -> list[WorkerInfo]:
        """Workers matching every given filter, oldest first; deleted ones only if asked."""
        return self._workers.list(topic=topic, group=group, status=status)

    def worker_names(
        self, worker_ids: Iterable[uuid.UUID | str | None], *, all_tenants: bool = False
    ) -> dict[str, str | None]:
        """Each worker's name by its id as text, deleted workers too, in one query; another
        tenant's worker is left out, as a missing one, unless ``all_tenants`` (a deployment
        view, such as the command line's audit log)."""
        return self._workers.names(worker_ids, all_tenants=all_tenants)

    def worker_id_of(self, reference: str, *, deleted_names: bool = False) -> str:
        """A worker's id from its id or short id (a deleted one's too) or a live worker's
        name; with ``deleted_names``, from a deleted worker's name as well."""
        return self._workers.id_of(reference, deleted_names=deleted_names)

    def get_worker_history(self, worker_id: uuid.UUID | str) -> list[VersionInfo]:
        """Every code version, oldest first."""
        return self._versions.history(worker_id)

    def get_worker_transitions(self, worker_id: uuid.UUID | str) -> list[TransitionInfo]:
        """The audit trail of state changes and code changes, oldest first."""
        return self._workers.transitions(worker_id)

    def session(self, worker_id: uuid.UUID | str, session: str) -> SessionInfo:
        """The engine instance a session of the worker is bound to (``session_key``), and
        for how long; ``instance`` None when it is unbound."""
        return self._workers.session(worker_id, session)

    def unbind_session(self, worker_id: uuid.UUID | str, session: str) -> bool:
        """End a session's binding: its next event binds anew. False when it had none."""
        return self._workers.unbind_session(worker_id, session)

    def get_code(self, worker_id: uuid.UUID | str, version: int | None = None) -> bytes:
        return self._versions.code(worker_id, version)

    def worker_details(self, worker_id: uuid.UUID | str) -> WorkerDetails:
        """The worker with its queue, dead letters, last error, deliveries and breaker."""
        from wm.control import workerdetails

        return workerdetails.worker_details(self.settings, self.bus, self.get_worker(worker_id))

    def status(self, *, ping_timeout_s: float | None = None, own_tenant: bool = False) -> Overview:
        """The cluster at a glance (with ``own_tenant``, this tenant's part: its workers,
        queues, dead letters and breakers); a part whose service does not answer is None."""
        from wm.control import overview

        tenant = self.tenant if own_tenant else None
        return overview.overview(self.settings, self.bus, ping_timeout_s, tenant)

    def recover(self, *, own_tenant: bool = False) -> RecoveryReport:
        """Run recovery now, as a starting node does: repair the routing table, declare every
        subscription's queue, check running workers' code, publish the outbox. Each worker it
        could not bring back is in ``failures``. Raises :class:`wm.errors.RecoveryRunning`
        while another recovery holds the lease. With ``own_tenant`` the whole recovery runs
        (the routing table and the broker are shared) but the report counts and names this
        tenant's routes, queues, workers and events only."""
        from wm.control import recovery

        return recovery.recover(self._context, own_tenant=own_tenant)

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
        """Send ``event_type`` to the worker on a cron expression or every ``every_s`` s."""
        add = self._schedules.add
        return add(
            worker_id, event_type, cron, every_s, timezone, data, missed, max_catch_up, until
        )

    def list_schedules(self, worker_id: uuid.UUID | str | None = None) -> list[ScheduleInfo]:
        """Schedules of live workers (of one worker), oldest first."""
        return self._schedules.list(worker_id)

    def remove_schedule(self, schedule_id: str) -> None:
        """Remove a schedule; firings already sent stay in the worker's queue."""
        self._schedules.remove(schedule_id)

    # -- events and subscriptions (wm.control.subscriptions) ------------------------------

    def publish(self, event: CloudEvent, topic: str | None = None) -> int:
        """Publish ``event`` to ``topic`` (default: its type) of this tenant; returns
        subscriptions reached."""
        return self.bus.publish(event, self._context.route(topic or event.get_type()))

    def publish_many(self, events: Iterable[CloudEvent], topic: str | None = None) -> list[int]:
        """Publish ``events`` in order to ``topic`` (default: each event's type), in batches
        of one round trip each for the routes and the ledger and for the broker; returns the
        subscriptions each reached (0: dropped and counted).

        Every event and topic is checked first: a bad one raises :class:`InvalidArgument`
        naming its index, and nothing is sent. A batch the broker refuses raises
        :class:`PublishInterrupted`, whose ``sent`` says how many events (the first ones)
        were published."""
        from wm.control.publishing import checked

        return self.bus.publish_many(checked(events, topic, self.tenant))

    # -- tenants (wm.control.tenants) ---------------------------------------------------------

    def create_tenant(
        self,
        name: str,
        *,
        max_concurrency: int | None = None,
        rate_limit: float | None = None,
        max_workers: int | None = None,
    ) -> TenantInfo:
        """Create a tenant (a name of 1-63 characters: a-z, 0-9 and ``-``) with its limits
        (None: unlimited; docs/guides/tenants.md); one that exists is refused."""
        limits = {
            "max_concurrency": max_concurrency,
            "rate_limit": rate_limit,
            "max_workers": max_workers,
        }
        return tenants.create(self.settings, name, limits)

    def set_tenant_limits(self, name: str, **limits: int | float | None) -> TenantInfo:
        """Change the limits named (``max_concurrency``, ``rate_limit``, ``max_workers``;
        None: unlimited) of tenant ``name``, keeping the others; nodes apply them at their
        next delivery."""
        return tenants.set_limits(self.settings, name, limits)

    def list_tenants(self) -> list[TenantInfo]:
        """Every tenant, by name, with its count of live workers and its limits."""
        return tenants.listing(self.settings)

    def flush_outbox(self) -> int:
        """Publish lifecycle events written by committed changes; returns how many were sent."""
        return self._context.flush_outbox()

    def subscribe(self, topic: str, name: str) -> str:
        """A named durable queue fed by ``topic`` (idempotent); returns the queue's name."""
        return self._subscriptions.subscribe(topic, name)

    def unsubscribe(self, topic: str, name: str, *, delete_queue: bool = True) -> None:
        """Remove a plain subscription and (by default) its queue with what it holds."""
        self._subscriptions.unsubscribe(topic, name, delete_queue=delete_queue)

    def list_subscriptions(self, topic: str | None = None) -> list[dict[str, Any]]:
        """Every subscription (worker and plain) with its queue depth."""
        return self._subscriptions.list(topic)

    def consume(
        self,
        topic: str,
        name: str,
        *,
        count: int | None = None,
        idle_s: float | None = None,
        peek: bool = False,
    ) -> Iterator[str | bytes]:
        """The plain subscription ``name``'s messages, oldest first: taken and acknowledged
        (until ``count``, or none came for ``idle_s``), or with ``peek`` shown and left."""
        return self._subscriptions.consume(topic, name, count=count, idle_s=idle_s, peek=peek)

    def receive(
        self, queue: str, *, count: int | None = None, idle_s: float | None = None
    ) -> Generator[str | bytes, None, None]:
        """A subscription queue's messages as they arrive, until ``count`` or ``idle_s``."""
        return self._subscriptions.receive(queue, count=count, idle_s=idle_s)
