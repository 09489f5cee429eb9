"""Code that cannot load on this node (``EngineLoadError``: a missing runtime, a library
for another platform) is no failure of one event: the worker is marked ``failed`` with the
reason, the node remembers it for its health, and the message goes back to the queue."""

from __future__ import annotations

import contextlib
import logging
import uuid

from wm.dataplane import outbox
from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import Feature
from wm.dataplane.verdicts import Requeue, Verdict
from wm.errors import BrokerUnavailable, EngineLoadError
from wm.state.nodehealth import EngineFailures

logger = logging.getLogger(__name__)


class EngineLoad(Feature):
    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        if not isinstance(error, EngineLoadError):
            return None
        rt, meta = delivery.rt, delivery.meta
        logger.error("worker %s cannot run here, marking it failed: %s", meta.id, error)
        reason = f"{type(error).__name__}: {error}"
        with contextlib.suppress(BrokerUnavailable):  # a health detail: the failure goes on
            EngineFailures(rt.settings).record(delivery.node or rt.node, meta.id, reason)
        wid = uuid.UUID(meta.id)
        outbox.record_failure(rt.settings, rt.bus, wid, type(error).__name__, str(error), fail=True)
        return Requeue(f"worker {meta.id} failed: {error}")
