"""Retries (DESIGN.md §5.5): a failed attempt is sent again with exponential backoff and
jitter (between half and all of ``retry_base_delay_ms × 2^(n-1)``, capped by
``WM_RETRY_MAX_DELAY_MS``), up to ``max_retries``; then, or at once for an error that says
it is not retryable, the delivery is parked in ``<topic>-dead``."""

from __future__ import annotations

import logging
import random
import time

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import Feature
from wm.dataplane.verdicts import Park, Resend, Verdict
from wm.errors import WorkManagerError

logger = logging.getLogger(__name__)


class Retries(Feature):
    owns = ("max_retries", "retry_base_delay_ms", "timeout_s")

    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        retryable = not isinstance(error, WorkManagerError) or error.retryable
        if not retryable or delivery.attempt > delivery.max_retries:
            return Park(delivery.failure(error))
        delay_s = backoff_s(delivery)
        logger.warning(
            "retrying event %s for worker %s in %.2fs (attempt %d of %d): %s",
            delivery.event.get_id(),
            delivery.meta.id,
            delay_s,
            delivery.attempt,
            delivery.max_retries + 1,
            error,
        )
        return Resend(delay_s, delivery.state.failed_at(time.time()), error, counts=True)


def backoff_s(delivery: Delivery) -> float:
    """Exponential backoff with jitter (between half and all of base * 2^(n-1)), capped."""
    base_ms = delivery.worker_settings.retry_base_delay_ms_on(delivery.rt.settings)
    ceiling_ms = min(delivery.rt.settings.retry_max_delay_ms, base_ms * 2 ** (delivery.attempt - 1))
    return random.uniform(ceiling_ms / 2, ceiling_ms) / 1000
