"""The cluster's metrics that every node reads at a scrape, not per delivery (issue 27).

- ``wm_queue_depth{worker_id, worker, tenant}``: messages ready in each live worker's queue, as
  ``wm status`` counts them (a shared group's one queue once, under its oldest member). One
  database read and one broker connection with a passive declare per queue, at most every
  :data:`TTL_S`; one series per live worker queue. An autoscaler (KEDA's Prometheus scaler)
  reads it.
- ``wm_worker_transitions_total{from_state, to_state}`` and the histogram
  ``wm_worker_state_seconds{state}`` (time a worker spent in the state it left), from the
  audit trail (``worker_transitions``): the first scrape adds up the whole trail in one
  aggregate query, later ones only the rows recorded since; one series per lifecycle edge.
  A transition shows :data:`SETTLE_S` after it was recorded.

The same on every node: aggregate with ``max``. The database or broker down: these are left
out of the scrape and the node's own metrics stay.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from wm import store
from wm.config import Settings
from wm.control.overview import worker_queue_depths
from wm.dataplane.app import make_app
from wm.errors import WorkManagerError
from wm.names import split_route_topic
from wm.store import workers as rows
from wm.views import QueueDepth

#: Seconds a scrape reuses the queue depths it read.
TTL_S = 5.0
#: Seconds a transition is left out after it was recorded: the time its transaction has to
#: commit (ids are taken in order, commits need not be), so that none is skipped for good.
SETTLE_S = 2.0
#: The ``wm_worker_state_seconds`` buckets: a second to a week.
STATE_BUCKETS_S = (1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 21600.0, 86400.0, 604800.0)


class QueueDepthCollector:
    """``wm_queue_depth`` (the module's docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._app: Any = None
        self._cached: tuple[float, list[QueueDepth]] | None = None

    def depths(self) -> list[QueueDepth]:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > TTL_S:
            if self._app is None:
                self._app = make_app(self.settings)
            self._cached = (now, worker_queue_depths(self.settings, self._app))
        return self._cached[1]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            depths = self.depths()
        except WorkManagerError:
            return
        gauge = GaugeMetricFamily(
            "wm_queue_depth",
            "Messages ready in the worker's queue (a shared group's, under its oldest member).",
            labels=["worker_id", "worker", "tenant"],  # a worker's tenant adds no series
        )
        for depth in depths:
            tenant = split_route_topic(depth.topic)[0]
            gauge.add_metric([depth.worker_id, depth.name or "", tenant], depth.depth)
        yield gauge


class TransitionsCollector:
    """``wm_worker_transitions_total`` and ``wm_worker_state_seconds`` (the module's
    docstring), kept up to date from the rows added since the last scrape."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.last_id = 0
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        #: State left → count per bucket (the last past the bounds), and the sum in seconds.
        self.buckets: dict[str, list[int]] = {}
        self.sums: dict[str, float] = defaultdict(float)

    def update(self) -> None:
        bounds_ms = [bound * 1000 for bound in STATE_BUCKETS_S]
        before = datetime.now(UTC) - timedelta(seconds=SETTLE_S)
        with store.session_scope(self.settings) as session:
            last, found = rows.tally_transitions(session, self.last_id, bounds_ms, before)
        for tally in found:
            source = tally.source or ""
            self.counts[(source, tally.target)] += tally.moves
            if tally.bucket >= 0 and tally.source:
                spread = self.buckets.setdefault(source, [0] * (len(bounds_ms) + 1))
                spread[tally.bucket] += tally.moves
                self.sums[source] += tally.total_ms / 1000
        self.last_id = last

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        try:
            self.update()
        except WorkManagerError:
            return
        moves = CounterMetricFamily(
            "wm_worker_transitions",
            "Lifecycle transitions of the cluster's workers ('' from: created).",
            labels=["from_state", "to_state"],
        )
        for (source, target), count in sorted(self.counts.items()):
            moves.add_metric([source, target], count)
        yield moves
        spent = HistogramMetricFamily(
            "wm_worker_state_seconds",
            "Time a worker spent in the state it left, per state left.",
            labels=["state"],
        )
        for state, spread in sorted(self.buckets.items()):
            spent.add_metric([state], _cumulative(spread), self.sums[state])
        yield spent


def _cumulative(spread: list[int]) -> list[tuple[str, float]]:
    bounds = [*(f"{bound:g}" for bound in STATE_BUCKETS_S), "+Inf"]
    total, out = 0, []
    for bound, count in zip(bounds, spread, strict=True):
        total += count
        out.append((bound, float(total)))
    return out
