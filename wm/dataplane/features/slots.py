"""``max_concurrency``: at most this many deliveries of the worker run at once across the
cluster (expiring slots in Redis, ``wm.state.slots``); one that finds none free waits in the
broker (see ``contention``). A group member runs alone already and takes none."""

from __future__ import annotations

from contextlib import AbstractContextManager

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import NOTHING, Feature
from wm.engine import Engine


class ConcurrencySlots(Feature):
    owns = ("max_concurrency",)

    def around_call(self, delivery: Delivery, engine: Engine) -> AbstractContextManager[object]:
        limit = delivery.worker_settings.max_concurrency
        if not limit or delivery.meta.group:
            return NOTHING
        slots = delivery.rt.slots
        return slots.hold(delivery.meta.id, delivery.holder, limit, delivery.hold_limit_s)
