"""Judging every live worker's health, once per reconcile period on the maintaining node
(``wm.state.health``); a change is published as the lifecycle event ``health_changed``, with
the delivery counts and, when the worker's code has a probe, the last probe's facts."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.dataplane import outbox
from wm.dataplane.bus import Bus
from wm.lifecycle import Status
from wm.state.health import Verdict, WorkerHealth
from wm.store import records
from wm.store.models import Worker


def judge_all(settings: Settings, bus: Bus) -> int:
    """Judge every live worker; returns how many changed health."""
    with store.session_scope(settings) as session:
        rows = session.execute(
            select(Worker.id, Worker.settings).where(Worker.status != Status.DELETED.value)
        ).all()
    verdicts = WorkerHealth(settings).judge_all({str(w): dict(s or {}) for w, s in rows})
    changed = [(w, v, old) for w, (v, old) in verdicts.items() if v.health != old]
    for worker_id, verdict, old in changed:
        records.transaction(settings, _event(uuid.UUID(worker_id), verdict, old))
    if changed:
        outbox.flush(settings, bus)
    return len(changed)


def _event(wid: uuid.UUID, verdict: Verdict, old: str) -> Any:
    def write(session: Session) -> None:
        worker = records.lock_worker(session, wid)
        data = {
            "from_health": old,
            "to_health": verdict.health,
            "error_rate": verdict.error_rate,
            "deliveries": verdict.deliveries,
            "consecutive_failures": verdict.consecutive_failures,
            **(verdict.probe.to_json() if verdict.probe is not None else {}),
        }
        records.add_outbox(session, "health_changed", worker, data, reason=verdict.reason)

    return write
