"""Waiting is no failure: a delivery that cannot get its group lock (beyond the short
hand-off window of ``GroupLocks.take``), a concurrency slot or its turn is sent again after
a back-off (a new message, then ack), so its pool process moves on. Such waits are counted
apart (``DeliveryState.lock_waits``): they never use up the worker's retries and never
dead-letter it. A delivery that has waited longer than any one holder may keep the lock is
logged as a warning (the group is saturated, or a holder misbehaves)."""

from __future__ import annotations

import logging
import random
import time

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import Feature
from wm.dataplane.verdicts import Resend, Verdict
from wm.errors import LockContention
from wm.state import ordering
from wm.state.locks import retry_delay_ms
from wm.state.ordering import NotYourTurn

logger = logging.getLogger(__name__)


class Contention(Feature):
    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        if not isinstance(error, LockContention):
            return None
        now, state = time.time(), delivery.state
        waited_s = now - (state.waiting_since or now)
        if waited_s > delivery.longest_hold_s:
            logger.warning(
                "event %s for worker %s has waited %.1f s (%d times): %s",
                delivery.event.get_id(),
                delivery.meta.id,
                waited_s,
                state.lock_waits,
                error,
            )
        ceiling_ms = retry_delay_ms(delivery.rt.settings, state.lock_waits)
        delay_s = random.uniform(ceiling_ms / 2, ceiling_ms) / 1000  # spreads the waiters
        if isinstance(error, NotYourTurn):  # its turn comes with a success elsewhere: look soon
            delay_s = min(delay_s, random.uniform(ordering.WAIT_MAX_S / 2, ordering.WAIT_MAX_S))
        return Resend(delay_s, state.waited(now), error, counts=False)
