"""Schedules: send an event to a worker at every firing of a cron expression or an interval
(the beat, ``wm.dataplane.beat``, fires them). Reads and writes the store only."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from wm import store
from wm.control.workers import Reference, Workers
from wm.errors import InvalidArgument, ScheduleNotFound
from wm.names import check_name
from wm.store import records
from wm.store import schedules as rows
from wm.views import ScheduleInfo

#: Missed firings a ``catch_up`` schedule sends at most, unless told otherwise.
DEFAULT_MAX_CATCH_UP = 10


class Schedules:
    def __init__(self, workers: Workers) -> None:
        self.settings = workers.settings
        self.workers = workers

    def add(
        self,
        reference: Reference,
        event_type: str,
        cron: str | None = None,
        every_s: float | None = None,
        timezone: str = "UTC",
        data: Any = None,
        missed: str = "skip",
        max_catch_up: int = DEFAULT_MAX_CATCH_UP,
        until: datetime | None = None,
    ) -> ScheduleInfo:
        """Send ``event_type`` (with ``data``) to the worker at every firing of a cron
        expression in ``timezone`` or every ``every_s`` seconds, until ``until``; firings no
        beat was running for are skipped or caught up (at most ``max_catch_up``)."""
        from wm.schedules import Timing  # croniter: only adding a schedule parses one

        wid = self.workers.resolve(reference)
        Timing(cron, timezone, every_s).check()
        check_name("event type", event_type)
        _check_policy(missed, max_catch_up, until, data)

        def add(session: Session) -> ScheduleInfo:
            records.lock_worker(session, wid, live=True)
            return rows.insert(
                session,
                wid,
                event_type=event_type,
                cron=cron,
                every_s=every_s,
                timezone=timezone,
                data=data,
                missed=missed,
                max_catch_up=max_catch_up,
                until=until,
            )

        return records.transaction(self.settings, add)

    def list(self, reference: Reference | None = None) -> list[ScheduleInfo]:
        """Schedules of live workers (of one worker), oldest first."""
        wid = None if reference is None else self.workers.stored(reference).id
        with store.session_scope(self.settings) as session:
            return rows.of_live_workers(session, self.workers.tenant, wid)

    def remove(self, schedule_id: str) -> None:
        """Remove a schedule; firings already sent stay in the worker's queue."""

        def remove(session: Session) -> None:
            if not rows.remove(session, self.workers.tenant, schedule_id):
                raise ScheduleNotFound(f"no schedule with id or short id {schedule_id!r}")

        records.transaction(self.settings, remove)


def _check_policy(missed: str, max_catch_up: int, until: datetime | None, data: Any) -> None:
    from wm.schedules import MISSED

    if missed not in MISSED:
        raise InvalidArgument(f"missed must be one of {', '.join(MISSED)}, not {missed!r}")
    if max_catch_up < 1:
        raise InvalidArgument("max_catch_up must be at least 1")
    if until is not None and until.tzinfo is None:
        raise InvalidArgument("until needs a time zone (e.g. 2026-12-31T00:00:00+00:00)")
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"a schedule's data must be JSON: {exc}") from None
