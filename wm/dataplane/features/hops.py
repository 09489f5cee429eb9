"""``WM_MAX_HOPS``: an event that passed through too many workers is not run again — a chain
of workers that publish to each other's topics may loop. Each output carries one more hop."""

from __future__ import annotations

from contextlib import AbstractContextManager

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import NOTHING, Feature
from wm.errors import HopLimitExceeded


class HopLimit(Feature):
    def around_run(self, delivery: Delivery) -> AbstractContextManager[object]:
        limit = delivery.rt.settings.max_hops
        if delivery.hops >= limit:
            raise HopLimitExceeded(
                f"event {delivery.event.get_id()} already passed through {delivery.hops} "
                f"workers (WM_MAX_HOPS={limit}); a chain of workers may loop"
            )
        return NOTHING
