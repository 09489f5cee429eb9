"""Schedules: firing times (cron in a time zone, intervals), the beat's firing policy, and
real beats: two running, one leads, each period fires once, a standby takes over."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from tests.conftest import env_of
from tests.helpers import STUB, drain, eventually, stub
from wm import InvalidArgument, ScheduleNotFound, Settings, WorkManager, store
from wm.dataplane.beat import LEADER_KEY, LEASE_S, finish_ended, fire_due
from wm.events import derive_id, event_key
from wm.schedules import Timing, event_id
from wm.state.connection import redis_for
from wm.store.models import Schedule


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


def test_cron_fires_at_local_times_across_a_daylight_saving_change() -> None:
    weekdays_at_nine = Timing("0 9 * * 1-5", "Europe/Zurich")
    # Friday 2026-03-27 to Tuesday 2026-03-31: Zurich moves to summer time on Sunday the 29th
    fired = list(
        weekdays_at_nine.times(
            _utc("2026-03-27T00:00:00+00:00"), _utc("2026-03-31T23:00:00+00:00"), datetime.now(UTC)
        )
    )
    assert fired == [
        _utc("2026-03-27T08:00:00+00:00"),  # 09:00 CET
        _utc("2026-03-30T07:00:00+00:00"),  # 09:00 CEST
        _utc("2026-03-31T07:00:00+00:00"),
    ]


def test_an_interval_counts_from_its_anchor_not_from_the_last_look() -> None:
    anchor = _utc("2026-01-01T00:00:00+00:00")
    every = Timing(every_s=2.5)
    fired = list(every.times(anchor + timedelta(seconds=3), anchor + timedelta(seconds=10), anchor))
    assert [(t - anchor).total_seconds() for t in fired] == [5.0, 7.5, 10.0]
    assert every.next_after(anchor + timedelta(seconds=10), anchor) == anchor + timedelta(
        seconds=12.5
    )


@pytest.mark.parametrize(
    ("timing", "message"),
    [
        (Timing(), "exactly one of"),
        (Timing("* * * * *", every_s=5), "exactly one of"),
        (Timing("61 * * * *"), "cron expression '61 \\* \\* \\* \\*' is invalid"),
        (Timing("* * * * *", "Mars/Olympus"), "time zone 'Mars/Olympus' is unknown"),
        (Timing("0 0 31 2 *"), "never fires"),
        (Timing(every_s=0.0), "every_s must be from 0.1 to"),
        (Timing(every_s=1e308), "every_s must be from 0.1 to"),
        (Timing(every_s=float("nan")), "every_s must be from 0.1 to"),
    ],
)
def test_invalid_timings_are_refused_naming_the_problem(timing: Timing, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        timing.check()


def test_a_firings_event_id_depends_on_schedule_and_time_only() -> None:
    at = _utc("2026-01-01T00:00:05+00:00")
    assert event_id("s1", at) == event_id("s1", at.astimezone(Timing(timezone="Asia/Tokyo").zone()))
    assert event_id("s1", at) != event_id("s2", at)
    assert event_id("s1", at) != event_id("s1", at + timedelta(seconds=1))


def test_schedules_are_added_listed_and_removed(manager: WorkManager) -> None:
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t", name="w")
    every = manager.add_schedule("w", event_type="tick", every_s=60, data={"a": 1})
    cron = manager.add_schedule(worker.id, event_type="daily", cron="0 6 * * *", timezone="UTC")
    assert [s.id for s in manager.list_schedules("w")] == [every.id, cron.id]
    assert every.next_fire_at == every.created_at + timedelta(seconds=60)
    assert cron.next_fire_at is not None and cron.next_fire_at.hour == 6
    with pytest.raises(InvalidArgument, match="missed must be one of skip, catch_up"):
        manager.add_schedule("w", event_type="x", every_s=1, missed="later")
    with pytest.raises(InvalidArgument, match="until needs a time zone"):
        manager.add_schedule("w", event_type="x", every_s=1, until=datetime(2030, 1, 1))
    manager.remove_schedule(every.id)
    with pytest.raises(ScheduleNotFound):
        manager.remove_schedule(every.id)
    assert [s.id for s in manager.list_schedules()] == [cron.id]


@pytest.mark.parametrize(("missed", "sent"), [("skip", [5]), ("catch_up", [3, 4, 5])])
def test_missed_firings_are_skipped_or_caught_up_and_never_sent_twice(
    pg_settings: Settings, missed: str, sent: list[int]
) -> None:
    manager = WorkManager(pg_settings)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t", start=False)
    schedule = manager.add_schedule(
        worker.id, event_type="tick", every_s=1, missed=missed, max_catch_up=3
    )
    anchor = schedule.created_at
    assert fire_due(pg_settings, manager.bus, anchor + timedelta(seconds=5.5)) == len(sent)
    # the same moment again, and a moment before the next firing: nothing more
    assert fire_due(pg_settings, manager.bus, anchor + timedelta(seconds=5.9)) == 0
    assert manager.list_schedules()[0].last_fired_at == anchor + timedelta(seconds=5)
    assert fire_due(pg_settings, manager.bus, anchor + timedelta(seconds=6)) == 1
    depth = {s["queue"]: s["depth"] for s in manager.list_subscriptions("t")}
    assert depth[f"t::{worker.id}"] == len(sent) + 1


def _output_ids(schedule: Any, worker_id: Any, seconds: range) -> set[str]:
    """The ids of the outputs the worker answers the firings at these seconds with."""
    source = f"/workmanager/schedules/{schedule.id}"
    return {
        derive_id(
            event_key(source, event_id(schedule.id, schedule.created_at + timedelta(seconds=k))),
            str(worker_id),
            0,
        )
        for k in seconds
    }


def _received(settings: Settings, queue: str, expected: int) -> collections.Counter[str]:
    """Output ids a plain subscription received (waiting for ``expected``, then a little)."""
    found = drain(settings, queue, expected, timeout_s=30)
    found += drain(settings, queue, 100, timeout_s=2)  # anything sent twice arrives by now
    return collections.Counter(e["id"] for e in found)


def _beat(settings: Settings, log: Path, *options: str) -> subprocess.Popen[bytes]:
    """``celery beat`` as an operator runs it, in ``log``'s directory (a module there can
    be its ``--scheduler``)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "wm.celeryapp",
                "beat",
                "--loglevel=INFO",
                *options,
            ],
            env=env_of(settings),
            cwd=log.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.mark.slow
def test_two_beats_fire_every_period_once_and_a_standby_takes_over(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """Two beats and a node; the leading beat is killed at a moment of its own, the standby
    takes over and catches up: a subscriber gets one output per period, none missing, none
    twice (a firing the killed beat sent but did not record is sent again, and delivered
    once)."""
    manager = WorkManager(pg_settings)
    out = manager.subscribe("tick.done", "out")
    worker = manager.create_worker(code=stub(output_type="tick.done"), mime_type=STUB, topic="tick")
    schedule = manager.add_schedule(worker.id, event_type="tick", every_s=1, missed="catch_up")
    node = start_node(pg_settings)
    node.consuming(f"tick::{worker.id}")
    logs = [tmp_path / f"beat{i}.log" for i in range(2)]
    beats = [_beat(pg_settings, log) for log in logs]

    def leading() -> list[int]:
        return [i for i, log in enumerate(logs) if "leading" in log.read_text()]

    try:
        [leader] = eventually(leading, timeout_s=30)
        time.sleep(3)
        beats[leader].send_signal(signal.SIGKILL)  # its lease expires; the standby leads
        beats[leader].wait(timeout=30)
        standby = 1 - leader
        eventually(lambda: "leading" in logs[standby].read_text(), timeout_s=3 * LEASE_S)
        time.sleep(2)
    finally:
        for beat in beats:
            if beat.poll() is None:
                beat.terminate()
                beat.wait(timeout=30)
    last = manager.list_schedules()[0].last_fired_at
    assert last is not None
    periods = round((last - schedule.created_at).total_seconds())
    assert periods >= LEASE_S + 3  # the run covered the hand-over
    expected = _output_ids(schedule, worker.id, range(1, periods + 1))
    received = _received(pg_settings, out, len(expected))
    assert set(received) == expected  # every period fired, the standby caught up what it missed
    assert max(received.values()) == 1  # none delivered twice
    assert sum("leading" in log.read_text() for log in logs) == 2


#: A scheduler whose every leading tick ends in a slow finalizer, where a signal lands.
_FINALIZING_SCHEDULER = """
import time

from wm.dataplane.beat import DatabaseScheduler


class Slow:
    def __del__(self):
        print("in the finalizer", flush=True)  # not "finalizing": beat's banner names it
        time.sleep(30)  # until a signal lands here


class Finalizing(DatabaseScheduler):
    def tick(self, *args, **kwargs):
        interval = super().tick(*args, **kwargs)
        if self.leading:
            Slow()  # dropped at once: its finalizer runs here
        return interval
"""


def test_a_beat_stops_on_sigterm_that_lands_in_a_finalizer(
    pg_settings: Settings, tmp_path: Path
) -> None:
    """Celery beat's SIGTERM handler raises SystemExit where the signal lands; inside a
    finalizer Python reports it and goes on. The beat still stops (at its next tick) and
    gives up its lease, rather than ticking, and leading, for ever."""
    (tmp_path / "finalizing.py").write_text(_FINALIZING_SCHEDULER)
    log = tmp_path / "beat.log"
    beat = _beat(pg_settings, log, "--scheduler=finalizing:Finalizing")
    try:
        eventually(lambda: "in the finalizer" in log.read_text(), timeout_s=30)
        beat.send_signal(signal.SIGTERM)  # lands in the finalizer, which sleeps meanwhile
        assert beat.wait(timeout=15) == 0, log.read_text()
    finally:
        if beat.poll() is None:
            beat.kill()
            beat.wait()
    told = log.read_text()
    assert "Exception ignored" in told  # the exit was swallowed: what this test is about
    assert "swallowed; stopping" in told
    assert redis_for(pg_settings).get(LEADER_KEY) is None  # the lease was given up


@pytest.mark.slow
def test_a_node_s_beat_stops_on_sigterm_that_lands_in_a_finalizer(
    pg_settings: Settings, tmp_path: Path
) -> None:
    """A node's own beat (``celery worker -B``, as ``wm up`` runs it) is stopped with a
    SIGTERM from the node, whose handler (billiard's) raises SystemExit where it lands: in a
    finalizer, Python goes on. The beat stops at its next tick all the same, rather than lead
    on with no node (the node does not wait for it), and gives up the lease."""
    (tmp_path / "finalizing.py").write_text(_FINALIZING_SCHEDULER)
    log = tmp_path / "node.log"
    with log.open("ab") as out:
        node = subprocess.Popen(
            [
                *[sys.executable, "-m", "celery", "-A", "wm.celeryapp", "worker", "-B"],
                *["--scheduler=finalizing:Finalizing", "-c", "1", "--loglevel=INFO"],
                *["-n", f"beat-{uuid.uuid4().hex[:8]}@%h"],
            ],
            env=env_of(pg_settings),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        eventually(lambda: "in the finalizer" in log.read_text(), timeout_s=60)
        node.send_signal(signal.SIGTERM)  # a warm stop, which stops its beat with SIGTERM
        assert node.wait(timeout=30) == 0, log.read_text()
        eventually(lambda: not _group_alive(node.pid), timeout_s=10)  # the beat too
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()
    told = log.read_text()
    assert "Exception ignored" in told  # the beat's exit was swallowed
    assert "swallowed; stopping" in told
    assert redis_for(pg_settings).get(LEADER_KEY) is None


def _group_alive(group: int) -> bool:
    """Whether a process of the process group ``group`` still runs."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_firing_sent_twice_is_delivered_once(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """A beat that died after sending, before moving the schedule on, sends the same firings
    again: the same event ids, whose outputs a subscriber receives once each."""
    manager = WorkManager(pg_settings)
    out = manager.subscribe("t.done", "out")
    worker = manager.create_worker(code=stub(output_type="t.done"), mime_type=STUB, topic="t")
    schedule = manager.add_schedule(worker.id, event_type="tick", every_s=1, missed="catch_up")
    node = start_node(pg_settings)
    node.consuming(f"t::{worker.id}")
    now = schedule.created_at + timedelta(seconds=3.5)
    assert fire_due(pg_settings, manager.bus, now) == 3
    with store.session_scope(pg_settings) as session:
        session.execute(update(Schedule).values(last_fired_at=None))  # the commit "was lost"
    assert fire_due(pg_settings, manager.bus, now) == 3
    received = _received(pg_settings, out, 3)
    assert received == collections.Counter(_output_ids(schedule, worker.id, range(1, 4)))


def test_a_worker_finishes_once_its_schedules_ended_and_their_events_were_delivered(
    pg_settings: Settings, start_node: Any
) -> None:
    manager = WorkManager(pg_settings)
    out = manager.subscribe("end.done", "out")
    worker = manager.create_worker(code=stub(output_type="end.done"), mime_type=STUB, topic="end")
    endless = manager.create_worker(code=stub(), mime_type=STUB, topic="end2")
    created = datetime.now(UTC)
    until = created + timedelta(seconds=2.5)
    schedule = manager.add_schedule(
        worker.id, event_type="end", every_s=1, until=until, missed="catch_up"
    )
    manager.add_schedule(endless.id, event_type="end2", every_s=1)
    anchor = schedule.created_at
    later = anchor + timedelta(seconds=3)
    assert fire_due(pg_settings, manager.bus, later) == 2 + 1  # until 2.5 s: two firings
    assert finish_ended(pg_settings, manager.bus, later) == 0  # not delivered yet
    assert manager.get_worker(worker.id).status == "running"

    node = start_node(pg_settings)
    node.consuming(f"end::{worker.id}")
    assert len(drain(pg_settings, out, 2)) == 2
    eventually(lambda: finish_ended(pg_settings, manager.bus, later) == 1)
    assert manager.get_worker(worker.id).status == "finished"
    last = manager.get_worker_transitions(worker.id)[-1]
    assert (last.from_status, last.to_status, last.actor) == ("running", "finished", "schedule")
    assert "its schedules ended (until " in last.reason
    assert manager.get_worker(endless.id).status == "running"  # no until: it goes on
