"""Recovery: rebuild what Redis and the broker derive from the database (DESIGN §9).

One recovery at a time in a cluster, under the lease ``workmanager/recovery/leader`` (TTL
WORKER_RECOVERY_LEASE_TTL_SECONDS, value ``<holder>/<epoch>/<nonce>``, the epoch counted up
in ``workmanager/recovery/epoch`` by each recovery that starts): it repairs the routing table,
forgets the worker cache, declares every subscription's queue, checks that each running
worker's pinned code is in the store, whole, with an engine installed here, and publishes the
lifecycle events left in the outbox. A recovery that completes writes its lease's value to
``workmanager/recovery/done``, then releases the lease.

A worker that cannot be brought back (its queue refused, its code missing or damaged, no
engine for its MIME type) is logged by name and id with the reason and listed in the report;
recovery goes on with the others. An outage of the broker, Redis or the database fails the
whole recovery, which its caller retries.

Nodes that did not lead keep a :class:`Takeover` watch: a lease that ends while ``done`` holds
an earlier epoch (its holder was killed, or failed) is taken over by one of them, so a
recovery is finished even when no node starts after the leader died."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import NamedTuple

from celery import Celery
from sqlalchemy import func, select

from wm import store
from wm.config import Settings
from wm.dataplane import outbox
from wm.dataplane.bus import Bus
from wm.dataplane.routes import route_of
from wm.engine import engine_class
from wm.errors import EngineLoadError, RecoveryRunning
from wm.lifecycle import Status
from wm.names import DEFAULT_TENANT, split_route_topic
from wm.state.connection import redis_errors, redis_for, text
from wm.state.directory import Directory
from wm.store.models import Subscription, Worker, WorkerVersion
from wm.views import RecoveryFailure, RecoveryReport

logger = logging.getLogger(__name__)
LEADER_KEY = "workmanager/recovery/leader"
#: The lease value of the last recovery that completed, and the count of those started.
DONE_KEY = "workmanager/recovery/done"
EPOCH_KEY = "workmanager/recovery/epoch"
#: Release the lease only if this holder still has it (it may have expired and moved on).
_RELEASE_IF_OURS = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)
#: Longest wait of a :class:`Takeover` between two looks at the lease, and after a failed
#: takeover (the wait doubles from one look up to this).
TAKEOVER_POLL_S = 1.0
TAKEOVER_BACKOFF_MAX_S = 30.0


class _Owner(NamedTuple):
    """A subscription queue's owner: a worker (its id, name, engine, pinned version, whether
    it runs) or, for a plain subscription, nobody (``worker_id`` None)."""

    queue: str
    worker_id: uuid.UUID | None = None
    name: str | None = None
    mime_type: str = ""
    version: int = 0
    running: bool = False
    tenant: str = DEFAULT_TENANT


def recover(
    settings: Settings, app: Celery, holder: str, tenant: str | None = None
) -> RecoveryReport:
    """Run recovery under the lease, as ``holder`` (a node's name, or who asked); raises
    :class:`RecoveryRunning` when another holds the lease. The whole deployment is recovered;
    with ``tenant``, the report counts and names that tenant's part only."""
    redis = redis_for(settings)
    ttl_s = settings.worker_recovery_lease_ttl_seconds
    with redis_errors(settings):
        if redis.exists(LEADER_KEY):
            raise _running(settings)
        token = f"{holder}/{int(redis.incr(EPOCH_KEY))}/{uuid.uuid4().hex[:12]}"
        if not redis.set(LEADER_KEY, token, nx=True, ex=ttl_s):
            raise _running(settings)
    logger.info("recovery: %s leads (lease %d s)", holder, ttl_s)
    try:
        report = _rebuild(settings, app, holder, tenant)
        with redis_errors(settings):
            redis.set(DONE_KEY, token)
    except Exception:
        logger.exception("recovery failed")
        raise
    finally:
        with redis_errors(settings):
            redis.eval(_RELEASE_IF_OURS, 1, LEADER_KEY, token)
    logger.info(
        "recovery done: %d queue(s) declared, %d route(s) repaired, %d worker(s) checked, "
        "%d event(s) published, %d failure(s), %.1f s",
        report.queues_declared,
        report.routes_repaired,
        report.workers_checked,
        report.events_published,
        len(report.failures),
        report.seconds,
    )
    return report


def _running(settings: Settings) -> RecoveryRunning:
    redis = redis_for(settings)
    with redis_errors(settings):
        value, left_ms = redis.get(LEADER_KEY), int(redis.pttl(LEADER_KEY))
    holder = _holder(text(value)) if value else "another node"
    left = f", lease {left_ms / 1000:.0f} s left" if left_ms > 0 else ""
    return RecoveryRunning(f"a recovery is running ({holder}{left}); ask again once it is done")


def _holder(token: str) -> str:
    return token.rsplit("/", 2)[0]


def _epoch(token: str) -> int:
    """A lease value's epoch (0 for none, or a value of another form)."""
    parts = token.rsplit("/", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0


def _rebuild(settings: Settings, app: Celery, holder: str, tenant: str | None) -> RecoveryReport:
    started = time.monotonic()
    bus = Bus(settings, app)
    routes: list[str] = []
    bus.rebuild_routes(repaired=routes)
    Directory(settings).invalidate()
    owners = _owners(settings)
    failures: list[RecoveryFailure] = []
    by_queue: dict[str, list[_Owner]] = defaultdict(list)
    for owner in owners:
        by_queue[owner.queue].append(owner)
    refused = bus.declare_queues(sorted(by_queue))  # the broker away: the whole recovery
    for queue, exc in refused.items():  # is retried (BrokerUnavailable)
        reason = f"its queue could not be declared: {type(exc).__name__}: {exc}"
        failures += [_failed(owner, reason) for owner in by_queue[queue]]
    declared = set(by_queue) - set(refused)
    running = {o.worker_id: o for o in owners if o.running}
    failures += _check_code(settings, list(running.values()))
    events: list[str] = []
    outbox.flush(settings, bus, events)

    def ours(topics: list[str]) -> int:
        return sum(tenant in (None, split_route_topic(t)[0]) for t in topics)

    queues = {o.queue for o in owners if tenant in (None, o.tenant)}
    return RecoveryReport(
        holder=holder,
        routes_repaired=ours(routes),
        queues_declared=len(declared & queues),
        workers_checked=sum(tenant in (None, o.tenant) for o in running.values()),
        events_published=ours(events),
        failures=[f for f in failures if f.queue in queues],
        seconds=round(time.monotonic() - started, 3),
    )


def _owners(settings: Settings) -> list[_Owner]:
    """Every subscription's queue and owner, from the database."""
    with store.session_scope(settings) as session:
        rows = session.execute(
            select(Subscription.queue, Subscription.tenant, Worker).outerjoin(
                Worker, Worker.id == Subscription.worker_id
            )
        ).all()
        return [
            _Owner(queue, tenant=tenant)
            if w is None
            else _Owner(
                route_of(w).queue,
                w.id,
                w.name,
                w.mime_type,
                w.current_version,
                w.status == Status.RUNNING.value,
                w.tenant,
            )
            for queue, tenant, w in rows
        ]


def _check_code(settings: Settings, running: list[_Owner]) -> list[RecoveryFailure]:
    """The running workers whose pinned code is missing or damaged in the store, or whose
    MIME type has no engine here. The code is not loaded into an engine: each node loads a
    worker's engine on its first delivery there, and one node loading every worker's would
    cost it the memory of all of them (seed 000's N×W problem)."""
    with store.session_scope(settings) as session:
        stored = {
            (wid, version): (size, length)
            for wid, version, size, length in session.execute(
                select(
                    WorkerVersion.worker_id,
                    WorkerVersion.version,
                    WorkerVersion.size,
                    func.length(WorkerVersion.code),
                )
                .join(Worker, Worker.id == WorkerVersion.worker_id)
                .where(
                    WorkerVersion.version == Worker.current_version,
                    Worker.status == Status.RUNNING.value,
                )
            )
        }
    engines: dict[str, str | None] = {}
    failures = []
    for owner in running:
        if owner.mime_type not in engines:
            engines[owner.mime_type] = _engine_missing(owner.mime_type)
        sizes = stored.get((owner.worker_id, owner.version))
        reason = engines[owner.mime_type] or _code_damaged(owner.version, sizes)
        if reason:
            failures.append(_failed(owner, reason))
    return failures


def _engine_missing(mime_type: str) -> str | None:
    try:
        engine_class(mime_type)
    except EngineLoadError as exc:
        return f"its code cannot be loaded: {exc}"
    return None


def _code_damaged(version: int, sizes: tuple[int, int] | None) -> str | None:
    if sizes is None:
        return f"its code cannot be loaded: version {version} is missing from the store"
    size, length = sizes
    if size != length:
        return (
            f"its code cannot be loaded: version {version} holds {length} byte(s) in the "
            f"store, {size} recorded"
        )
    return None


def _failed(owner: _Owner, reason: str) -> RecoveryFailure:
    """One worker's failure, logged on a line of its own."""
    if owner.worker_id is None:
        logger.error("recovery: subscription queue %s: %s", owner.queue, reason)
    else:
        shown = f"{owner.name!r} ({owner.worker_id})" if owner.name else str(owner.worker_id)
        logger.error(
            "recovery: worker %s: %s; recovery goes on with the others",
            shown,
            reason,
            extra={"worker_id": str(owner.worker_id)},
        )
    return RecoveryFailure(owner.worker_id, owner.name, owner.queue, reason)


class Takeover:
    """A node's watch on the lease, from a daemon thread: the lease's value is noted while
    it lives; a lease gone while ``done`` holds an earlier epoch than that value's was a
    recovery left unfinished, which this node then runs. ``report(state, error)`` hears of
    each takeover: ``running``, then ``done`` or ``retrying``."""

    def __init__(
        self,
        settings: Settings,
        app: Celery,
        holder: str,
        report: Callable[[str, str | None], None],
    ) -> None:
        self.settings, self.app, self.holder, self.report = settings, app, holder, report
        self.seen: str | None = None
        self.poll_s = min(TAKEOVER_POLL_S, settings.worker_recovery_lease_ttl_seconds / 3)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="wm-recovery-takeover", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        wait_s = self.poll_s
        while not self.stopped.wait(wait_s):
            try:
                self.turn()
                wait_s = self.poll_s
            except Exception as exc:  # an outage or a failed takeover: look again later
                logger.warning("recovery takeover: %s: %s", type(exc).__name__, exc)
                wait_s = min(wait_s * 2, TAKEOVER_BACKOFF_MAX_S)

    def turn(self) -> None:
        """One look at the lease; takes over an unfinished recovery."""
        redis = redis_for(self.settings)
        with redis_errors(self.settings):
            lease = redis.get(LEADER_KEY)
            if lease is not None:
                self.seen = text(lease)
                return
            done = text(redis.get(DONE_KEY) or b"")
            if self.seen is None or _epoch(done) >= _epoch(self.seen):
                self.seen = None
                return
        logger.warning(
            "recovery: the lease of %s ended before its recovery was done; %s takes over",
            _holder(self.seen),
            self.holder,
        )
        self._take_over()

    def _take_over(self) -> None:
        self.report("running", None)
        try:
            recover(self.settings, self.app, self.holder)
        except RecoveryRunning:
            self.seen = None  # another took it first: the next look watches that one
            self.report("elsewhere", None)
            return
        except Exception as exc:
            self.report("retrying", f"{type(exc).__name__}: {exc}")
            raise
        self.seen = None
        self.report("done", None)
