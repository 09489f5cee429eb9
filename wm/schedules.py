"""When a schedule fires (issue 14, seed 002's schedule-driven workers): a cron expression in
a time zone, or a fixed interval, and the id of the event each firing publishes.

Cron expressions are parsed and stepped by ``croniter`` (the de-facto cron library for
Python, used by Airflow and others; five fields, or six with seconds), in the schedule's IANA
time zone (``zoneinfo``), so ``0 9 * * 1-5`` in ``Europe/Zurich`` fires at 09:00 local time
through daylight-saving changes. An interval fires every ``every_s`` seconds counted from the
schedule's creation, so its firing times do not drift with the beat's ticks.

Every firing has a nominal time, and its event id is derived from (schedule id, nominal time):
two beats, or one beat restarted, that fire the same time publish the same event, which the
data plane delivers once.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterError, croniter

from wm.errors import InvalidArgument

#: What a beat does with firing times it missed (it was down, or no beat was running).
MISSED = ("skip", "catch_up")
#: Shortest and longest interval a schedule may have, in seconds.
MIN_EVERY_S = 0.1
MAX_EVERY_S = 366 * 24 * 3600.0
#: Longest cron expression kept.
MAX_CRON_CHARS = 200
_NAMESPACE = uuid.UUID("6b0e4e6c-3f2c-4d55-9a55-5e0b4d9a1c1e")


@dataclass(frozen=True)
class Timing:
    cron: str | None = None
    timezone: str = "UTC"
    every_s: float | None = None

    def check(self) -> Timing:
        """This timing if it is complete and valid, else :class:`InvalidArgument`."""
        if (self.cron is None) == (self.every_s is None):
            raise InvalidArgument("a schedule needs exactly one of a cron expression or every_s")
        self.zone()
        if self.every_s is not None:
            if not MIN_EVERY_S <= self.every_s <= MAX_EVERY_S:  # NaN fails both
                raise InvalidArgument(
                    f"every_s must be from {MIN_EVERY_S} to {MAX_EVERY_S:.0f} seconds, not "
                    f"{self.every_s!r}"
                )
            return self
        if len(self._cron) > MAX_CRON_CHARS:
            raise InvalidArgument(f"a cron expression has at most {MAX_CRON_CHARS} characters")
        try:
            croniter(self._cron, datetime.now(self.zone())).get_next(datetime)
        except (CroniterBadCronError, CroniterError, ValueError) as exc:
            raise InvalidArgument(
                f"cron expression {self.cron!r} is invalid or never fires: {exc}"
            ) from None
        return self

    def zone(self) -> ZoneInfo:
        try:
            return ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise InvalidArgument(
                f"time zone {self.timezone!r} is unknown: use an IANA name such as "
                f"Europe/Zurich ({exc})"
            ) from None

    def times(self, after: datetime, upto: datetime, anchor: datetime) -> Iterator[datetime]:
        """Firing times in ``(after, upto]``, oldest first, in UTC; an interval counts from
        ``anchor``."""
        if self.every_s is not None:
            step, k = self._interval_after(after, anchor)
            while (at := anchor + k * step) <= upto:
                yield at.astimezone(UTC)
                k += 1
            return
        steps = croniter(self._cron, after.astimezone(self.zone()))
        while (at := steps.get_next(datetime)) <= upto:
            yield at.astimezone(UTC)

    def next_after(self, after: datetime, anchor: datetime) -> datetime:
        """The first firing time after ``after``."""
        if self.every_s is not None:
            step, k = self._interval_after(after, anchor)
            return (anchor + k * step).astimezone(UTC)
        at: datetime = croniter(self._cron, after.astimezone(self.zone())).get_next(datetime)
        return at.astimezone(UTC)

    def next_until(
        self, after: datetime, anchor: datetime, until: datetime | None
    ) -> datetime | None:
        """:meth:`next_after`, or None when that is past ``until``."""
        at = self.next_after(after, anchor)
        return None if until is not None and at > until else at

    def _interval_after(self, after: datetime, anchor: datetime) -> tuple[timedelta, int]:
        """The interval, and the number of the first firing after ``after`` (counted from
        ``anchor``, the first being 1)."""
        assert self.every_s is not None
        step = timedelta(seconds=self.every_s)
        k = max(1, math.floor((after - anchor) / step) + 1)
        if anchor + k * step <= after:  # the float division rounded down past a firing
            k += 1
        return step, k

    @property
    def _cron(self) -> str:
        if self.cron is None:
            raise InvalidArgument("this schedule has an interval, not a cron expression")
        return self.cron


def event_id(schedule_id: str, fired_at: datetime) -> str:
    """The id of the event a firing publishes: the same for the same schedule and time."""
    return str(uuid.uuid5(_NAMESPACE, f"{schedule_id}/{fired_at.astimezone(UTC).isoformat()}"))
