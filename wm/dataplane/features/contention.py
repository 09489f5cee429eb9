"""Waiting is no failure: a delivery that cannot get its group lock (beyond the short
hand-off window of ``GroupLocks.take``), a concurrency slot or its turn is sent again after
a back-off (a new message, then ack), so its pool process moves on. Such waits are counted
apart (``DeliveryState.lock_waits``): they never use up the worker's retries. A delivery
that has waited longer than any one holder may keep the lock is logged as a warning (the
group is saturated, or a holder misbehaves); one still without its lock or slot after
``GROUP_LOCK_MAX_RETRIES`` waits is dead-lettered as :class:`~wm.errors.LockContention`, so
persistent contention shows in ``<topic>-dead`` (seeds 000 and 001). A wait for a turn
never is: the turn ends with its predecessor's success or dead letter, or its gap."""

from __future__ import annotations

import logging
import random
import time

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import Feature
from wm.dataplane.verdicts import Park, Resend, Verdict
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
        if _gives_up(delivery, error):
            return Park(delivery.failure(_persistent(delivery, error, waited_s)))
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


def _gives_up(delivery: Delivery, error: LockContention) -> bool:
    """The delivery waited ``GROUP_LOCK_MAX_RETRIES`` times (0: never gives up)."""
    limit = delivery.rt.settings.group_lock_max_retries
    return 0 < limit <= delivery.state.lock_waits and not isinstance(error, NotYourTurn)


def _persistent(delivery: Delivery, error: LockContention, waited_s: float) -> LockContention:
    limit = delivery.rt.settings.group_lock_max_retries
    return LockContention(
        f"lock contention: gave up after {delivery.state.lock_waits} waits over "
        f"{waited_s:.1f} s (GROUP_LOCK_MAX_RETRIES={limit}; 0 waits for ever): {error}"
    )
