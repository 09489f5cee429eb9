"""Pool processes replaced on purpose: code that keeps running in one after its delivery
ended (a .NET task still spinning after its time limit), and ``max_memory_mb``.

``max_memory_mb`` is checked after each delivery of the worker: the resident memory of the
processes its engine keeps (a sandbox, a helper), which are unloaded past it (the next delivery
starts afresh), or else, for code that runs inside the pool process, that process's own, which
is replaced once the delivery is settled (``Runtime.replace``). A process that ends on purpose
marks the message it settled (``wm.state.settled``): handed out again as lost with its
process, the message is only acknowledged."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

from wm.dataplane import enginecontrol
from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import NOTHING, Feature
from wm.dataplane.verdicts import Settled, Verdict
from wm.engine import resident_bytes, tree_resident_bytes
from wm.errors import WorkerTimeout
from wm.state import settled

logger = logging.getLogger(__name__)
MIB = 1024 * 1024


class Replacement(Feature):
    owns = ("max_memory_mb",)

    def admit(self, delivery: Delivery) -> AbstractContextManager[object]:
        if delivery.redelivered and settled.marked(delivery.rt.settings, delivery.message_key):
            reason = (
                f"event {delivery.event.get_id()} was settled for worker {delivery.meta.id} "
                "before its pool process was replaced: acknowledged only"
            )
            logger.info("%s", reason)
            raise Settled(reason)
        return NOTHING

    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        if isinstance(error, WorkerTimeout) and error.stray:
            delivery.rt.replace(f"worker {delivery.meta.id}'s code still runs past its limit")
        return None

    def ended(self, delivery: Delivery, verdict: Verdict) -> None:
        limit_mb = delivery.worker_settings.max_memory_mb
        rt, worker_id = delivery.rt, delivery.meta.id
        if not limit_mb or isinstance(verdict, Settled):
            return
        engine = rt.engines.loaded(worker_id)
        if engine is None:
            return
        apart = engine.stops_calls()  # its code runs in processes of its own
        used = sum(map(tree_resident_bytes, engine.processes())) if apart else resident_bytes()
        if used <= limit_mb * MIB:
            return
        where = "its processes use" if apart else "its pool process uses"
        reason = f"worker {worker_id}: {where} {used / MIB:.0f} MiB, over max_memory_mb"
        reason += f" ({limit_mb})"
        if apart:
            logger.warning("%s: unloading it (the next delivery starts afresh)", reason)
            rt.command(enginecontrol.UNLOAD, worker_id)
        else:
            rt.replace(reason)
