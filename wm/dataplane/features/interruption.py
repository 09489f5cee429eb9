"""A stop that outlived its grace period kills the engine of deliveries in flight
(``wm.dataplane.runtime``): what it cut short is no failure of the worker's. The message goes
back to the queue and runs on the worker's next start."""

from __future__ import annotations

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import Feature
from wm.dataplane.verdicts import Requeue, Verdict


class Interruption(Feature):
    owns = ("stop_grace_s",)

    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        if delivery.began and delivery.rt.interrupted(delivery.meta.id, delivery.began):
            return Requeue(f"worker {delivery.meta.id} was stopped during this delivery")
        return None
