"""A node's Prometheus metrics, ``GET /metrics`` on the health port (issue 13, point 2).

Deliveries run in a prefork node's pool processes, which come and go, so the metrics use
prometheus-client's multiprocess mode, as a Prometheus user running gunicorn would: each
process writes its samples to files in ``PROMETHEUS_MULTIPROC_DIR``, and the main process
adds them up at each scrape. :func:`prepare` runs in the main process before any metric
exists and before the pool forks (``wm.celeryapp``, on ``celeryd_init``, which only a
node's main process sends, when ``WM_HEALTH_PORT`` is set): it points that variable at a
fresh directory (or empties the one an operator set), and registers the observer of
deliveries (``wm.dataplane.observe``). A pool process that exits is marked dead
(:func:`on_process_exit`), and one killed outright (a hard time limit, the OOM killer) at the
next scrape, so its gauges drop out while its counters stay counted.

Per WorkManager worker, labelled ``worker_id``, ``worker`` (its name, or empty) and
``tenant`` (its tenant, ``default`` in a deployment that names none):
``wm_delivered_total``, ``wm_succeeded_total``, ``wm_failed_total`` (failed attempts),
``wm_retried_total``, ``wm_dead_lettered_total``, ``wm_fence_refusals_total``,
``wm_duplicates_skipped_total`` (a recorded outcome republished instead of a second run),
``wm_breaker_opened_total`` (times its circuit breaker paused it), ``wm_probe_passed_total``
and ``wm_probe_failed_total`` (its health probes run on this node),
``wm_replacements_total`` (times recovery ``replace`` unloaded its engine), and the
histograms ``wm_lock_wait_seconds``, ``wm_engine_seconds``,
``wm_publish_to_output_seconds`` and ``wm_probe_seconds``. Per node: ``wm_node_consumers``
(worker queues consumed),
``wm_node_recovery`` (1 for the current state), ``wm_node_engines`` (engines loaded in its
pool processes) and ``wm_node_sandbox_processes``. Cardinality: 11 counters and 4 histograms
of 13 series each per worker the node served since it started, so about 63 series per worker.
Per tenant, labelled ``tenant``: ``wm_tenant_refusals_total`` (messages the tenant guard
refused in its queues, ``wm.dataplane.guard``), ``wm_tenant_throttled_total`` (deliveries
sent back to wait by the tenant's ``max_concurrency`` or ``rate_limit``) and
``wm_tenant_in_flight``
(deliveries of the tenant running on the node); and of the cluster
``wm_tenant_limit{tenant,limit}``, each limit set. Tenants are created by an admin only
(``wm tenant create``), never by traffic, so the ``tenant`` label's values are bounded by
that list: about 5 series per tenant.

Of the whole cluster, the same on every node (read from the database and Redis at most every
:data:`WORKERS_TTL_S`; aggregate with ``max``): ``wm_workers{status}``, the live workers in
each status, and ``wm_workers_health{health}``, in each health; and those of
``wm.ops.clustermetrics``: ``wm_queue_depth`` per worker queue, the lifecycle transitions
and the time spent in each state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import select

from wm import store
from wm.config import Settings
from wm.dataplane import observe
from wm.dataplane.node import STATE
from wm.errors import WorkManagerError
from wm.lifecycle import Status
from wm.ops import clustermetrics
from wm.state.directory import WorkerMeta
from wm.state.health import HEALTHS, WorkerHealth
from wm.store import tenants as tenant_rows
from wm.store.models import Worker
from wm.views import TenantInfo

ENV = "PROMETHEUS_MULTIPROC_DIR"
COUNTERS = {
    "delivered": "Delivery attempts that reached the worker.",
    "succeeded": "Deliveries whose outcome was recorded and published.",
    "failed": "Failed delivery attempts (each retry counts).",
    "retried": "Failed attempts sent again after a back-off.",
    "dead_lettered": "Deliveries parked in the dead-letter queue.",
    "fence_refused": "Writes refused because the group lock's lease was lost.",
    "duplicate": "Deliveries whose recorded outcome was republished instead of run again.",
    "breaker_opened": "Times the circuit breaker paused the worker (running to pending).",
    "probe_passed": "Health probes of the worker's code that passed.",
    "probe_failed": "Health probes of the worker's code that failed (false, raised, timed out).",
    "replaced": "Times recovery 'replace' unloaded the worker's engine to load it afresh.",
    "session_hit": "Session events run on the instance their session was bound to.",
    "session_miss": "Session events that bound their session anew (none, expired, gone).",
}
NAMES = {
    "fence_refused": "fence_refusals",
    "duplicate": "duplicates_skipped",
    "replaced": "replacements",
    "session_hit": "session_affinity_hits",
    "session_miss": "session_affinity_misses",
}
HISTOGRAMS = {
    "lock_wait": ("lock_wait_seconds", "Time taking the group lock."),
    "engine": ("engine_seconds", "Time the worker's code ran."),
    "latency": ("publish_to_output_seconds", "From the input's publish to its outputs'."),
    "probe": ("probe_seconds", "Time a health probe of the worker's code took."),
}
GAUGES = {
    "engines": ("node_engines", "Engines loaded in the node's pool processes."),
    "sandboxes": ("node_sandbox_processes", "Processes the loaded engines keep."),
}
#: Labels of the per-worker metrics. ``tenant`` adds no series: a worker belongs to one
#: tenant, so it only groups the worker's. Its values stay few: tenants are created one by
#: one by an admin (``wm tenant create``), never by a publisher, a message or worker code.
WORKER_LABELS = ("worker_id", "worker", "tenant")
#: Per tenant, labelled ``tenant`` alone (the queue's, never one a message claims): counters,
#: and gauges summed over live processes.
TENANT_COUNTERS = {
    "tenant_refused": (
        "tenant_refusals",
        "Messages the tenant guard refused in the tenant's queues (another tenant's event).",
    ),
    "tenant_throttled": (
        "tenant_throttled",
        "Deliveries sent back to wait by their tenant's max_concurrency or rate_limit.",
    ),
}
TENANT_GAUGES = {
    "tenant_running": ("tenant_in_flight", "Deliveries of the tenant running on the node."),
}
RECOVERY_STATES = ("pending", "running", "retrying", "done", "elsewhere", "disabled", "failed")

_metrics: dict[str, Any] = {}
#: The samples' directory when this process made it (removed when the node stops).
_made: list[str] = []
#: The cluster's collectors, read at each scrape (made by :func:`prepare`).
_workers: list[Any] = []


def prepare(settings: Settings) -> None:
    """In the node's main process, before the pool forks: the samples' directory and the
    observer. Nothing when the health port is off."""
    if not settings.health_port or _metrics:
        return
    chosen = os.environ.get(ENV)
    if chosen:  # an operator's directory: emptied, it may hold a previous node's files
        shutil.rmtree(chosen, ignore_errors=True)
        Path(chosen).mkdir(parents=True, exist_ok=True)
    else:
        os.environ[ENV] = tempfile.mkdtemp(prefix="wm-metrics-")
        _made.append(os.environ[ENV])
    _define()
    _workers.extend(
        (
            _WorkersCollector(settings),
            clustermetrics.QueueDepthCollector(settings),
            clustermetrics.TransitionsCollector(settings),
        )
    )
    observe.register(_observe)


def _define() -> None:
    from prometheus_client import Counter, Gauge, Histogram, values

    # The client picks its value class (in memory, or files for multiprocess mode) when
    # first imported, and ``celery`` may have imported it before the variable was set (a
    # command plugin's entry point, such as Flower's): pick again now.
    values.ValueClass = values.get_value_class()

    for kind, text in COUNTERS.items():
        _metrics[kind] = Counter(f"wm_{NAMES.get(kind, kind)}", text, WORKER_LABELS)
    for kind, (name, text) in HISTOGRAMS.items():
        _metrics[kind] = Histogram(f"wm_{name}", text, WORKER_LABELS)
    for kind, (name, text) in TENANT_COUNTERS.items():
        _metrics[kind] = Counter(f"wm_{name}", text, ("tenant",))
    for kind, (name, text) in GAUGES.items():
        _metrics[kind] = Gauge(f"wm_{name}", text, multiprocess_mode="livesum")
    for kind, (name, text) in TENANT_GAUGES.items():
        _metrics[kind] = Gauge(f"wm_{name}", text, ("tenant",), multiprocess_mode="livesum")


def _observe(kind: str, meta: WorkerMeta, value: float) -> None:
    metric = _metrics.get(kind)
    if metric is None:
        return
    if kind in GAUGES:
        metric.set(value)
    elif kind in TENANT_COUNTERS or kind in TENANT_GAUGES:
        metric.labels(meta.tenant).inc(value)
    elif kind in HISTOGRAMS:
        metric.labels(meta.id, meta.name or "", meta.tenant).observe(value)
    else:
        metric.labels(meta.id, meta.name or "", meta.tenant).inc(value)


def close() -> None:
    """When the node stops: the samples' directory it made goes."""
    for directory in _made:
        shutil.rmtree(directory, ignore_errors=True)
    _made.clear()


def on_process_exit() -> None:
    """In a pool process that ends: its live gauges no longer count."""
    if _metrics:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())


def _reap(path: str) -> None:
    """The live gauges of pool processes that died without :func:`on_process_exit`."""
    from prometheus_client import multiprocess

    for sample in Path(path).glob("gauge_live*_*.db"):
        pid = sample.stem.rpartition("_")[2]
        if pid.isdigit() and not _alive(int(pid)):
            multiprocess.mark_process_dead(int(pid), path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


#: Seconds a scrape reuses the cluster's worker counts.
WORKERS_TTL_S = 5.0


class _WorkersCollector:
    """``wm_workers{status}`` and ``wm_workers_health{health}`` (the module's docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._cached: tuple[float, dict[str, int], dict[str, int]] | None = None
        self._limits: list[TenantInfo] = []

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > WORKERS_TTL_S:
            with store.session_scope(self.settings) as session:
                rows = session.execute(
                    select(Worker.id, Worker.status).where(Worker.status != Status.DELETED.value)
                ).all()
                self._limits = tenant_rows.listing(session)
            statuses = {str(status): 0 for status in Status if status != Status.DELETED}
            for _, status in rows:
                statuses[status] = statuses.get(status, 0) + 1
            healths = {health: 0 for health in HEALTHS}
            for health in WorkerHealth(self.settings).known([str(w) for w, _ in rows]).values():
                healths[health] = healths.get(health, 0) + 1
            self._cached = (now, statuses, healths)
        return self._cached[1], self._cached[2]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            statuses, healths = self.counts()
        except WorkManagerError:  # the database or Redis is down: the node's own metrics stay
            return
        by_status = GaugeMetricFamily(
            "wm_workers", "Live workers of the cluster in each status.", labels=["status"]
        )
        for status, count in statuses.items():
            by_status.add_metric([status], count)
        yield by_status
        by_health = GaugeMetricFamily(
            "wm_workers_health", "Live workers of the cluster in each health.", labels=["health"]
        )
        for health, count in healths.items():
            by_health.add_metric([health], count)
        yield by_health
        yield self._tenant_limits()

    def _tenant_limits(self) -> Any:
        """``wm_tenant_limit{tenant,limit}``: each limit a tenant has (unlimited: none)."""
        from prometheus_client.core import GaugeMetricFamily

        limits = GaugeMetricFamily(
            "wm_tenant_limit",
            "Each tenant's limits (max_concurrency, rate_limit, max_workers) that are set.",
            labels=["tenant", "limit"],
        )
        for tenant in self._limits:
            for name, value in tenant.limits.to_json().items():
                if value is not None:
                    limits.add_metric([tenant.name, name], float(value))
        return limits


class _NodeCollector:
    """The main process's own facts, read at each scrape."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily(
            "wm_node_consumers", "Worker queues the node consumes.", value=STATE.queues
        )
        recovery = GaugeMetricFamily(
            "wm_node_recovery", "The node's start-up recovery: 1 for its state.", labels=["state"]
        )
        for state in RECOVERY_STATES:
            recovery.add_metric([state], 1.0 if STATE.recovery == state else 0.0)
        yield recovery


def exposition() -> tuple[bytes, str] | None:
    """The scrape's body and content type, or None when metrics are off."""
    if not _metrics:
        return None
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    path = os.environ[ENV]
    _reap(path)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    registry.register(_NodeCollector())
    for collector in _workers:
        registry.register(collector)
    return generate_latest(registry), CONTENT_TYPE_LATEST
