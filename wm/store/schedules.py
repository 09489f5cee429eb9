"""The control plane's statements on the schedules table: add, list, remove. Firing them is
the beat's (``wm.dataplane.beat``)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from wm.lifecycle import Status
from wm.store import records
from wm.store.models import Schedule, Worker
from wm.views import ScheduleInfo


def insert(
    session: Session,
    worker_id: uuid.UUID,
    *,
    event_type: str,
    cron: str | None,
    every_s: float | None,
    timezone: str,
    data: Any,
    missed: str,
    max_catch_up: int,
    until: datetime | None,
) -> ScheduleInfo:
    """A new schedule, created now (its first interval counts from here), in its worker's
    tenant."""
    worker = session.get(Worker, worker_id)
    assert worker is not None
    row = Schedule(
        id=str(uuid.uuid4()),
        tenant=worker.tenant,
        worker_id=worker_id,
        cron=cron,
        timezone=timezone,
        every_s=every_s,
        event_type=event_type,
        data=data,
        missed=missed,
        max_catch_up=max_catch_up,
        until=until,
        created_at=datetime.now(UTC),
    )
    session.add(row)
    session.flush()
    return records.schedule_info(row)


def of_live_workers(
    session: Session, tenant: str, worker_id: uuid.UUID | None
) -> list[ScheduleInfo]:
    """Schedules of the tenant's live workers (of one worker), oldest first."""
    query = (
        select(Schedule)
        .join(Worker, Worker.id == Schedule.worker_id)
        .where(Worker.status != Status.DELETED.value, Schedule.tenant == tenant)
        .order_by(Schedule.created_at, Schedule.id)
    )
    if worker_id is not None:
        query = query.where(Schedule.worker_id == worker_id)
    return [records.schedule_info(row) for row in session.scalars(query).all()]


def remove(session: Session, tenant: str, reference: str) -> bool:
    """Delete the tenant's schedule with this id or short id; False if there is none (or
    it is another tenant's)."""
    found = session.get(Schedule, reference)
    if found is None:
        mine = Schedule.tenant == tenant
        full = records.by_prefix(session, Schedule.id, reference, "schedule", mine)
        found = None if full is None else session.get(Schedule, full)
    if found is None or found.tenant != tenant:
        return False
    session.delete(found)
    return True
