"""The delivery's OpenTelemetry span (``wm.dataplane.tracing``), around the whole attempt."""

from __future__ import annotations

from contextlib import AbstractContextManager

from wm.dataplane import tracing
from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import NOTHING, Feature


class Tracing(Feature):
    def admit(self, delivery: Delivery) -> AbstractContextManager[object]:
        if not tracing.enabled():
            return NOTHING
        meta = delivery.meta
        attributes = {
            "workmanager.worker_id": meta.id,
            "workmanager.worker": meta.name or "",
            "workmanager.attempt": delivery.attempt,
            "workmanager.tenant": meta.tenant,
        }
        return tracing.delivering(delivery.event, attributes)
