"""Every failed attempt is told as a ``worker.error`` lifecycle event (seed 001), with the
error's type (a worker's own, for a ``WorkerExecutionError``) and message, once: a timeout
the watchdog told at the limit while the call ran on (``Delivery.tell_limit``) is not told
again when the call ends."""

from __future__ import annotations

from wm.dataplane.delivery import Delivery, reported_type
from wm.dataplane.pipeline import Feature
from wm.dataplane.verdicts import Verdict
from wm.errors import WorkerTimeout


class ErrorEvents(Feature):
    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        if not (isinstance(error, WorkerTimeout) and delivery.limit_told):
            delivery.emit_error(reported_type(error), str(error))
        return None
