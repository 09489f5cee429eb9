"""How each attempt ended, told to the observers (``wm.dataplane.observe``): the node's
Prometheus metrics count them. Steps inside the core (engine time, lock waits, latency,
duplicates) are told by the core itself."""

from __future__ import annotations

from wm.dataplane.delivery import Delivery
from wm.dataplane.observe import notify
from wm.dataplane.pipeline import Feature
from wm.dataplane.verdicts import Done, Park, Resend, Verdict
from wm.errors import FenceRejected


class Metrics(Feature):
    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        notify("delivered", delivery.meta)
        notify("failed", delivery.meta)
        if isinstance(error, FenceRejected):
            notify("fence_refused", delivery.meta)
        return None

    def ended(self, delivery: Delivery, verdict: Verdict) -> None:
        if isinstance(verdict, Done):
            notify("delivered", delivery.meta)
            notify("succeeded", delivery.meta)
        elif isinstance(verdict, Park):
            notify("dead_lettered", delivery.meta)
        elif isinstance(verdict, Resend) and verdict.counts:
            notify("retried", delivery.meta)
