"""One look at the whole cluster (``wm status``, ``GET /v1/status``): the nodes that answer,
workers by status and health, the deepest queues, dead letters per topic, circuit breakers
and recovery. ``wm.control.workerdetails`` looks at one worker the same way.

Each fact is read where it lives: workers and dead letters from the database, the source of
truth (an unreachable database fails the whole look, which means nothing without it);
health, breaker counts and the recovery lease from Redis; nodes and queue depths from the
broker. A part whose service does not answer is left out (None) and named in
``unavailable`` with the reason, and every broker call is bounded (:data:`BROKER_TIMEOUT_S`,
the ping's timeout), so one broken service never hangs the look at the others.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from celery import Celery
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.dataplane.app import broker_errors
from wm.dataplane.bus import Bus, queue_depths
from wm.dataplane.liveness import live_hostnames
from wm.dataplane.routes import worker_route
from wm.errors import BrokerUnavailable
from wm.lifecycle import Status
from wm.names import split_route_topic
from wm.state.breaker import failures_key, trips_key
from wm.state.connection import redis_errors, redis_for
from wm.state.health import HEALTHS, UNHEALTHY, WorkerHealth
from wm.state.ledger import Ledger
from wm.state.tenantlimits import TenantGate
from wm.store import deadletters as dead_letters
from wm.store import tenants as tenant_rows
from wm.store import workers as rows
from wm.views import (
    BreakerInfo,
    Overview,
    QueueDepth,
    Recovery,
    TenantInfo,
    TenantUse,
    aware,
)
from wm.workersettings import STRATEGIES, WorkerSettings

T = TypeVar("T")

#: Seconds the nodes have to answer the ping.
PING_TIMEOUT_S = 1.0
#: Seconds to reach the broker before it counts as unavailable.
BROKER_TIMEOUT_S = 2.0
#: Queues the overview lists, deepest first (its total counts every queue).
DEEPEST_QUEUES = 10
#: The services a part of the look may miss (keys of ``unavailable``).
BROKER, REDIS = "broker", "redis"
#: A worker's circuit breaker: paused for its back-off (``open``), running again one failure
#: from reopening (``half-open``), past its threshold under a strategy that does not pause
#: (``tripped``: degrade, replace, stop), ``closed``, or ``off`` (``failure_threshold`` 0).
OPEN, HALF_OPEN, TRIPPED, CLOSED, OFF = "open", "half-open", "tripped", "closed", "off"


def tenant_uses(settings: Settings, tenants: list[TenantInfo]) -> list[TenantUse]:
    limited = [t.name for t in tenants if t.limits.delivery()]
    use = TenantGate(settings).in_use(limited) if limited else {}
    return [TenantUse(t.name, t.workers, t.limits, *use.get(t.name, (None, None))) for t in tenants]


@dataclass(frozen=True)
class LiveWorker:
    """What a look needs of one worker."""

    id: str
    name: str | None
    topic: str
    status: str
    settings: Mapping[str, Any]
    status_since: datetime | None
    group: str | None = None

    @property
    def queue(self) -> str:
        """Its queue: its own, or its shared group's (``wm.store.shares``)."""
        return worker_route(self.id, self.topic, self.group, dict(self.settings)).queue


# -- the cluster -------------------------------------------------------------------------------


def overview(
    settings: Settings, bus: Bus, ping_timeout_s: float | None = None, tenant: str | None = None
) -> Overview:
    """The cluster at a glance, asking the nodes to answer a ping within ``ping_timeout_s``
    (default :data:`PING_TIMEOUT_S`); see the module's docs for what a dead service leaves
    out. With ``tenant``, that tenant's part only: its workers, queues, dead letters and
    breakers, its topics as it names them; the nodes and the recovery lease are shared."""
    timeout_s = PING_TIMEOUT_S if ping_timeout_s is None else ping_timeout_s
    with store.session_scope(settings) as session:
        workers = _live_workers(session, tenant)
        letters = dead_letters.waiting_by_topic(session, tenant)
        if tenant is not None:
            letters = {split_route_topic(t)[1]: n for t, n in letters.items()}
        paused = rows.paused_by_breaker(
            session, [w.id for w in workers if w.status == Status.PENDING]
        )
        # with a tenant, its own line only: another tenant's name is not shown
        tenants = [t for t in tenant_rows.listing(session) if tenant in (None, t.name)]
    missing: dict[str, str] = {}
    uses = part(missing, REDIS, lambda: tenant_uses(settings, tenants))
    health = part(missing, REDIS, lambda: _health_counts(settings, workers))
    recovery = part(missing, REDIS, lambda: _recovery(settings, workers, paused))
    looked = part(missing, BROKER, lambda: _nodes_and_depths(settings, bus.app, workers, timeout_s))
    nodes, depths = looked if looked is not None else (None, None)
    if tenant is not None and depths is not None:
        depths = [replace(d, topic=split_route_topic(d.topic)[1]) for d in depths]
    return Overview(
        at=datetime.now(UTC),
        nodes=nodes,
        workers=len(workers),
        by_status=_ordered(Counter(w.status for w in workers), [str(s) for s in Status]),
        by_health=health,
        queued=None if depths is None else sum(d.depth for d in depths),
        deepest_queues=None if depths is None else _deepest(depths),
        dead_letters=letters,
        recovery=recovery,
        unavailable=missing,
        tenants=uses if uses is not None else tenant_uses_unknown(tenants),
    )


def tenant_uses_unknown(tenants: list[TenantInfo]) -> list[TenantUse]:
    return [TenantUse(t.name, t.workers, t.limits) for t in tenants]


def part(missing: dict[str, str], service: str, read: Callable[[], T]) -> T | None:
    """``read()``, or None when ``service`` does not answer (the reason goes in ``missing``;
    a service found missing once is not asked again)."""
    if service in missing:
        return None
    try:
        return read()
    except BrokerUnavailable as exc:
        missing[service] = str(exc)
        return None


def _live_workers(session: Session, tenant: str | None = None) -> list[LiveWorker]:
    """Live workers (of ``tenant`` unless None), their topics as routing knows them."""
    return [
        LiveWorker(
            str(row.id),
            row.name,
            row.topic,
            row.status,
            dict(row.settings or {}),
            aware(row.status_since),
            row.group,
        )
        for row in rows.live(session, tenant)
    ]


def _health_counts(settings: Settings, workers: list[LiveWorker]) -> dict[str, int]:
    """How many are in each health, and ``paused``: running ones paused while unhealthy."""
    known = WorkerHealth(settings).known([w.id for w in workers])
    counts = Counter(known.values())
    counts["paused"] = sum(
        known[w.id] == UNHEALTHY
        and w.status == Status.RUNNING
        and WorkerSettings.of(w.settings).pause_when_unhealthy
        for w in workers
    )
    return _ordered(counts, [*HEALTHS, "paused"])


def _ordered(counts: Counter[str], order: list[str]) -> dict[str, int]:
    """Non-zero counts in ``order``, then any others by name."""
    keys = [k for k in order if counts[k]] + sorted(set(counts) - set(order))
    return {key: counts[key] for key in keys}


def _recovery(settings: Settings, workers: list[LiveWorker], paused: set[str]) -> Recovery:
    from wm.dataplane.recovery import LEADER_KEY

    with redis_errors(settings):
        lease_ms = int(redis_for(settings).pttl(LEADER_KEY))
    return Recovery(
        leader_lease_s=lease_ms / 1000 if lease_ms > 0 else None,
        maintaining_node=Ledger(settings).maintainer(),
        breakers=_breakers(settings, workers, paused),
    )


def _breakers(settings: Settings, workers: list[LiveWorker], paused: set[str]) -> list[BreakerInfo]:
    """Breakers worth a look: failures counted in a row, or paused by the breaker."""
    if not workers:
        return []
    with redis_errors(settings):
        pipe = redis_for(settings).pipeline(transaction=False)  # keys in many slots
        for worker in workers:
            pipe.get(failures_key(worker.id))
            pipe.get(trips_key(worker.id))
        found = [int(value or 0) for value in pipe.execute()]
    return [
        breaker_info(worker, count, trips, worker.id in paused)
        for worker, count, trips in zip(workers, found[::2], found[1::2], strict=True)
        if count or worker.id in paused
    ]


def breaker_info(worker: LiveWorker, failures: int, trips: int, paused: bool) -> BreakerInfo:
    """The state of ``worker``'s breaker (see :data:`OPEN` and the others) from its counts
    and whether the breaker itself paused it."""
    typed = WorkerSettings.of(worker.settings)
    limit, how = typed.failure_threshold, typed.strategy_for("error")
    retry_at = None
    if worker.status == Status.PENDING and paused:
        state = OPEN
        if worker.status_since is not None:
            pause = typed.breaker_delay_s(max(1, trips))
            retry_at = worker.status_since + timedelta(seconds=pause)
    elif not limit:
        state = OFF
    elif trips and how == STRATEGIES[0] and worker.status in (Status.STARTING, Status.RUNNING):
        state = HALF_OPEN
    else:
        state = TRIPPED if trips else CLOSED
    return BreakerInfo(
        worker.id, worker.name, worker.status, state, how, failures, limit, trips, retry_at
    )


def _nodes_and_depths(
    settings: Settings, app: Celery, workers: list[LiveWorker], ping_timeout_s: float
) -> tuple[list[str], list[QueueDepth]]:
    """The nodes that answer a ping, and every worker queue's depth: one connection, each
    wait bounded. A shared group's one queue is counted once, under its oldest member."""
    firsts = _queue_owners(workers)
    with broker_errors(settings), connect(app) as conn:
        replies = _ping(app, conn, ping_timeout_s)
        depths = queue_depths(conn, [w.queue for w in firsts])
    nodes = sorted(name for reply in replies for name in reply)
    return nodes, [QueueDepth(w.id, w.name, w.topic, w.queue, depths[w.queue]) for w in firsts]


def _ping(app: Celery, conn: Any, timeout_s: float) -> list[dict[str, Any]]:
    """The nodes' answers to a ping. On a Redis broker, where each node keeps a liveness
    record (``wm.dataplane.liveness``), the wait ends once every live node answered, and no
    live node means no wait; elsewhere (RabbitMQ) it ends ``timeout_s`` after the last
    answer."""
    live = live_hostnames(conn)
    if live is not None and not live:
        return []
    limit = None if live is None else len(live)
    replies: list[dict[str, Any]] = app.control.ping(
        timeout=timeout_s, connection=conn, limit=limit
    )
    return replies or []


def worker_queue_depths(settings: Settings, app: Celery) -> list[QueueDepth]:
    """Every live worker queue's depth, as ``wm status`` counts it (a shared group's one
    queue once, under its oldest member): one database read, one broker connection."""
    with store.session_scope(settings) as session:
        workers = _live_workers(session)
    firsts = _queue_owners(workers)
    with broker_errors(settings), connect(app) as conn:
        depths = queue_depths(conn, [w.queue for w in firsts])
    return [QueueDepth(w.id, w.name, w.topic, w.queue, depths[w.queue]) for w in firsts]


def _queue_owners(workers: list[LiveWorker]) -> list[LiveWorker]:
    """One worker per queue: a shared group's oldest member."""
    return list({w.queue: w for w in reversed(workers)}.values())[::-1]


def connect(app: Celery) -> Any:
    """A broker connection made now, or the broker's error after one quick attempt (kombu
    would otherwise retry for as long as Celery's settings allow)."""
    conn = app.connection_for_write(connect_timeout=BROKER_TIMEOUT_S)
    try:
        conn.ensure_connection(
            max_retries=1, interval_start=0, interval_step=0, timeout=BROKER_TIMEOUT_S
        )
    except BaseException:
        conn.release()
        raise
    return conn


def _deepest(depths: list[QueueDepth]) -> list[QueueDepth]:
    waiting = [d for d in depths if d.depth]
    return sorted(waiting, key=lambda d: (-d.depth, d.queue))[:DEEPEST_QUEUES]
