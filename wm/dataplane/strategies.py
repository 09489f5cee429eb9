"""Recovery strategies (seed 004's ``execute_recovery``), run when a worker reaches the limit
of a kind of failure (:data:`~wm.workersettings.KIND_DEFAULTS`): its circuit breaker's
``failure_threshold`` failed deliveries (``crash``, ``timeout``, ``error``, by the failure
that tripped it; ``wm.dataplane.features.breaker``) or ``max_probe_failures`` failed probes
(``health``; ``wm.dataplane.probes``). The breaker's own ``retry`` (open, back off, try
half-open) stays with the breaker; the others are here:

- ``degrade``: nothing changes but the record: it goes on as it is (consuming and retrying;
  for ``health``, paused while unhealthy unless ``pause_when_unhealthy`` is off);
- ``replace``: every process unloads its engine, so the next delivery or probe loads the
  pinned version afresh (a new sandbox, helper or context), and it goes on;
- ``stop``: ``running → stopped``, as an operator's stop;
- ``remove``: taken out of service, ``running → failed`` with the reason: the status that
  says a fault needs attention. Its queue is kept (nothing is lost); ``wm worker start``
  puts it back. A WorkManager worker is deployed code, not a member of a pool that refills
  itself, so removing it cannot mean dropping it: fresh instances are ``replace``.

Each run publishes the lifecycle event ``recovery`` (data: strategy, kind, failures,
last_error); ``stop`` and ``remove`` publish their transition too.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from sqlalchemy.orm import Session

from wm.config import Settings
from wm.dataplane import enginecontrol, outbox
from wm.dataplane.bus import Bus
from wm.dataplane.observe import notify
from wm.lifecycle import Status
from wm.state.directory import WorkerMeta
from wm.store import records

logger = logging.getLogger(__name__)

#: What each strategy does, as its reason says.
_ACTIONS = {
    "degrade": "it goes on as it is, degraded",
    "replace": "its engine is loaded afresh from the pinned version on every node",
    "stop": "stopped; start it again once fixed",
    "remove": "taken out of service (failed), its queue kept; start it again once fixed",
}
_LEAVING = {"stop": Status.STOPPED, "remove": Status.FAILED}


def apply(
    settings: Settings,
    bus: Bus,
    meta: WorkerMeta,
    kind: str,
    failures: str,
    count: int,
    last_error: str,
    actor: str,
) -> bool:
    """Run ``meta``'s strategy for ``kind`` after ``failures`` (said in words; ``count`` of
    them): False when the worker no longer ran (``stop``, ``remove``), so nothing was done."""
    how = meta.worker_settings.strategy_for(kind)
    reason = f"recovery {how!r} after {failures} (last: {last_error}): {_ACTIONS[how]}"
    wid = uuid.UUID(meta.id)
    data = {"strategy": how, "kind": kind, "failures": count, "last_error": last_error}
    if how in _LEAVING:
        _record(settings, wid, data, reason)  # the reason first, then the transition
        if not outbox.leave_running(settings, bus, wid, _LEAVING[how], reason, actor=actor):
            return False
        enginecontrol.send(settings, enginecontrol.UNLOAD, meta.id)
        logger.warning("worker %s: %s", meta.id, reason)
        return True
    if how == "replace":
        enginecontrol.send(settings, enginecontrol.UNLOAD, meta.id)
        notify("replaced", meta)
    logger.warning("worker %s: %s", meta.id, reason)
    _record(settings, wid, data, reason)
    outbox.flush(settings, bus)
    return True


def _record(settings: Settings, wid: uuid.UUID, data: dict[str, Any], reason: str) -> None:
    def write(session: Session) -> None:
        worker = records.lock_worker(session, wid)
        records.add_outbox(session, "recovery", worker, data, reason=reason)

    records.transaction(settings, write)
