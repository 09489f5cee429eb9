"""Every failed attempt is told as a ``worker.error`` lifecycle event (seed 001), with the
error's type (a worker's own, for a ``WorkerExecutionError``) and message."""

from __future__ import annotations

from wm.dataplane.delivery import Delivery, reported_type
from wm.dataplane.pipeline import Feature
from wm.dataplane.verdicts import Verdict


class ErrorEvents(Feature):
    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        delivery.emit_error(reported_type(error), str(error))
        return None
