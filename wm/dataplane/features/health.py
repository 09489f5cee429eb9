"""The outcomes behind a worker's health (``wm.state.health``): each process tallies its
deliveries per worker and minute, and flushes the tally to Redis at most once a second —
with a success's outcome record, in the same round trip. A write refused under a lost lease
is no failure of the worker's."""

from __future__ import annotations

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import Feature
from wm.dataplane.verdicts import Verdict
from wm.errors import FenceRejected
from wm.state.connection import StatePipeline


class Health(Feature):
    owns = (
        "health_degraded_rate",
        "health_unhealthy_rate",
        "health_max_consecutive_failures",
        "health_min_deliveries",
        "probe_interval_s",
        "max_probe_failures",
        "recovery_on_health",
    )

    def recording(self, delivery: Delivery, pipe: StatePipeline) -> None:
        tally = delivery.rt.tally
        tally.add(delivery.meta.id, ok=True)
        tally.queue_if_due(pipe)

    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        if not isinstance(error, FenceRejected):
            delivery.rt.tally.add(delivery.meta.id, ok=False)
            delivery.rt.tally.flush_if_due(delivery.rt.settings)
        return None
