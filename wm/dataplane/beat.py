"""Celery beat for WorkManager's schedules: ``celery -A wm.celeryapp beat`` (``wm up`` runs
one in its node).

:class:`DatabaseScheduler` is a Celery beat scheduler that reads the schedules from the
database (the ``schedules`` table, the source of truth, like every worker's config) instead of
beat's shelve file. Why not an existing one: django-celery-beat needs Django, the
SQLAlchemy ports of it are unmaintained, and RedBeat keeps schedules in Redis (a second
source of truth beside PostgreSQL); what each needs from us (a lease, nominal firing times,
events to a worker's queue) is this module's few lines either way.

- **One active beat** across the cluster: a beat fires only while it holds the Redis lease
  ``wm:beat:leader`` (renewed every tick, :data:`LEASE_S` long). Any number of beats may run;
  the others wait and take over within a lease when the holder stops or dies.
- **Each firing has a nominal time** (``wm.schedules``). The beat sends every firing due since
  the schedule's ``last_fired_at``, then moves it on, in one transaction per schedule. Missed
  firings (no beat ran): ``skip`` sends only the latest, ``catch_up`` the latest
  ``max_catch_up`` in order.
- **A double fire yields one delivery**: the event's id is derived from (schedule, nominal
  time), so a beat that dies between sending and committing, or two beats in a lease race,
  send the same event, which the data plane delivers once (its outcome record).
- The event (type and data from the schedule, ``source`` ``/workmanager/schedules/<id>``,
  ``time`` the nominal time) goes to the worker's own queue, whatever its state: a stopped or
  suspended worker gets its firings when it runs again. ``until`` ends a schedule.
- **A worker whose schedules have all ended finishes**: once every schedule of a running
  worker has an ``until`` that passed, its last firing was sent and nothing is pending for it
  (every event delivered or dead-lettered), it goes ``running → finished`` (actor
  ``schedule``), checked every :data:`FINISH_CHECK_S` by the leading beat.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from celery import beat, signals
from sqlalchemy import select

from wm import store
from wm.config import Settings
from wm.dataplane import outbox
from wm.dataplane.bus import Bus
from wm.dataplane.routes import route_of
from wm.events import encode, in_tenant, make_event
from wm.lifecycle import Status
from wm.schedules import Timing, event_id
from wm.state.connection import own_client, redis_errors, redis_for
from wm.state.ledger import Ledger
from wm.store.models import Schedule, Worker
from wm.views import aware

logger = logging.getLogger(__name__)
LEADER_KEY = "wm:beat:leader"
#: Seconds a beat's lease lasts without renewal; a standby takes over within this.
LEASE_S = 5.0
#: Seconds a stopping beat's release of its lease may wait for Redis (past that, the lease
#: ends by itself).
RELEASE_TIMEOUT_S = 2.0
#: Seconds between ticks: how late a firing may be sent.
TICK_S = 0.5
#: Seconds between the leading beat's looks for workers whose schedules all ended.
FINISH_CHECK_S = 2.0
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end"


def fire_due(settings: Settings, bus: Bus, now: datetime) -> int:
    """Send every schedule's due firings; returns how many events were sent. One read of
    every schedule per tick; only a schedule with a firing due is locked and written."""
    with store.session_scope(settings) as session:
        rows = session.scalars(
            select(Schedule)
            .join(Worker, Worker.id == Schedule.worker_id)
            .where(Worker.status != Status.DELETED.value)
        ).all()
        due = [row.id for row in rows if (at := _next_firing(row)) is not None and at <= now]
    return sum(_fire_one(settings, bus, schedule_id, now) for schedule_id in due)


def finish_ended(settings: Settings, bus: Bus, now: datetime) -> int:
    """Finish the running workers whose schedules have all ended (module docstring);
    returns how many finished."""
    with store.session_scope(settings) as session:
        rows = session.scalars(
            select(Schedule)
            .join(Worker, Worker.id == Schedule.worker_id)
            .where(Worker.status == Status.RUNNING.value)
        ).all()
        ends: dict[str, list[datetime | None]] = {}  # per worker, None: not ended
        for row in rows:
            until = aware(row.until)
            over = until is not None and until <= now and _next_firing(row) is None
            ends.setdefault(str(row.worker_id), []).append(until if over else None)
    ended = {w: max(u for u in us if u) for w, us in ends.items() if all(us)}
    if not ended:
        return 0
    pending, finished = Ledger(settings).pending_of(list(ended)), 0
    for worker, until in ended.items():
        if pending[worker]:
            continue  # its last firings are still being delivered
        reason = f"finished: its schedules ended (until {until.isoformat()})"
        wid = uuid.UUID(worker)
        finished += outbox.leave_running(
            settings, bus, wid, Status.FINISHED, reason, actor="schedule"
        )
    return finished


def _next_firing(row: Schedule) -> datetime | None:
    """The schedule's next firing, None once its ``until`` has passed."""
    timing, created, last, until = _window(row)
    return timing.next_until(last, created, until)


def _window(row: Schedule) -> tuple[Timing, datetime, datetime, datetime | None]:
    """The schedule's timing, creation (an interval's anchor), last firing (or creation) and
    end, with their time zone."""
    created = aware(row.created_at)
    timing = Timing(row.cron, row.timezone, row.every_s)
    return timing, created, aware(row.last_fired_at) or created, aware(row.until)


def _fire_one(settings: Settings, bus: Bus, schedule_id: str, now: datetime) -> int:
    with store.session_scope(settings) as session:
        found = session.execute(
            select(Schedule, Worker)
            .join(Worker, Worker.id == Schedule.worker_id)
            .where(Schedule.id == schedule_id)
            .with_for_update(of=Schedule)
        ).one_or_none()
        if found is None:
            return 0
        row, worker = found
        timing, created, last, until = _window(row)
        due = list(timing.times(last, min(now, until) if until else now, created))
        if not due:
            return 0
        keep = 1 if row.missed == "skip" else max(1, row.max_catch_up)
        sent = due[-keep:]
        if len(due) > len(sent):
            logger.warning(
                "schedule %s missed %d firing(s) (%s): sending %d",
                row.id,
                len(due) - len(sent),
                row.missed,
                len(sent),
            )
        route = route_of(worker)  # a shared member's firings go to its group
        for at in sent:
            event = make_event(
                row.event_type,
                f"/workmanager/schedules/{row.id}",
                row.data,
                id=event_id(row.id, at),
                time=at,
            )
            bus.send(encode(in_tenant(event, worker.tenant)), [route])
        row.last_fired_at = due[-1]
        return len(sent)


class DatabaseScheduler(beat.Scheduler):
    """Celery beat's scheduler for WorkManager's schedules (the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.settings = Settings.from_env()
        self.token = uuid.uuid4().hex
        self.leading = False
        self._bus: Bus | None = None
        self._finish_checked = 0.0
        self._closed = False
        super().__init__(*args, **kwargs)

    def setup_schedule(self) -> None:
        """Schedules live in the database, not in beat's own entries."""

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            self._bus = Bus(self.settings, self.app)
        return self._bus

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self._closed:
            # Celery beat's SIGTERM/SIGINT handler closes the scheduler, then raises
            # SystemExit where the signal landed; landing inside a finalizer (``__del__``, a
            # weakref callback) Python reports it ("Exception ignored") and goes on, and beat
            # would tick on for ever, leading again. The exit is raised here instead.
            logger.warning("beat: closed by a signal whose exit was swallowed; stopping")
            raise SystemExit()
        try:
            if self._lead():
                fire_due(self.settings, self.bus, datetime.now(UTC))
                if time.monotonic() - self._finish_checked >= FINISH_CHECK_S:
                    self._finish_checked = time.monotonic()
                    finish_ended(self.settings, self.bus, datetime.now(UTC))
        except Exception:  # a database or broker outage: the next tick tries again
            logger.exception("beat: firing schedules failed; next try in %ss", TICK_S)
        return TICK_S

    def _lead(self) -> bool:
        with redis_errors(self.settings):
            held = bool(
                redis_for(self.settings).eval(
                    _RENEW, 1, LEADER_KEY, self.token, int(LEASE_S * 1000)
                )
            )
        if held != self.leading:
            logger.warning("beat: %s", "leading: firing schedules" if held else "standing by")
            self.leading = held
        return held

    def close(self) -> None:
        """Give the lease up, so a standby leads at its next tick. Celery beat calls this
        from its SIGTERM handler, which may have interrupted this process's own Redis calls:
        the release goes on a client of its own, within :data:`RELEASE_TIMEOUT_S`, so a
        silent Redis cannot keep the beat from stopping (the lease then ends by itself)."""
        self._closed = True
        if self.leading:
            self.leading = False  # closed twice (by the signal, then by beat's exit): one release
            try:
                client = own_client(self.settings, RELEASE_TIMEOUT_S)
                try:
                    with redis_errors(self.settings):
                        client.eval(_RELEASE, 1, LEADER_KEY, self.token)
                finally:
                    client.close()
            except Exception:
                logger.exception("beat: could not release the lease; it expires in %ss", LEASE_S)
        super().close()


@signals.beat_embedded_init.connect
def _closed_by_sigterm(sender: beat.Service, **_: Any) -> None:
    """A node's embedded beat (``celery worker -B``) in a process of its own is stopped with
    SIGTERM, whose handler (billiard's) raises SystemExit where the signal lands without
    closing the scheduler: the scheduler is marked closed first, so an exit a finalizer
    swallowed is raised again at its next tick (a beat in a thread is stopped by a flag)."""
    scheduler = sender.scheduler
    if not isinstance(scheduler, DatabaseScheduler):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(number: int, frame: Any) -> None:
        scheduler._closed = True
        if callable(previous):
            previous(number, frame)
        raise SystemExit()

    signal.signal(signal.SIGTERM, stop)
