"""``wm schedule …``: events sent to a worker on a cron expression or an interval."""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from wm.cli.arguments import (
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Group,
    UsageError,
    iso_time,
    pass_output,
)
from wm.cli.output import Output, cell, labelled

if TYPE_CHECKING:
    from wm.views import ScheduleInfo

#: ``wm.schedules.MISSED`` and ``wm.control.schedules.DEFAULT_MAX_CATCH_UP``, repeated here
#: because importing them would load croniter and the database layer for every ``wm`` command
#: and for completion; tests/test_cli_admin.py checks that they agree.
MISSED = ("skip", "catch_up")
DEFAULT_MAX_CATCH_UP = 10


@click.group(cls=Group)
def schedule() -> None:
    """Send events to a worker on a schedule (celery beat).

    WORKER: a worker's id, a unique prefix of it (6+ characters), or a live worker's name.
    """


@schedule.command("add")
@click.argument("worker_ref", metavar="WORKER")
@click.option("--cron", metavar="EXPR", help="Five cron fields, e.g. '0 9 * * 1-5'.")
@click.option("--every", type=POSITIVE_FLOAT, metavar="SECONDS", help="Fire every SECONDS.")
@click.option("--tz", default="UTC", metavar="ZONE", help="IANA time zone of --cron.")
@click.option(
    "--type",
    "event_type",
    required=True,
    metavar="TYPE",
    help="Type of the event each firing sends.",
)
@click.option("--data", metavar="JSON", help="The event's data, as JSON.")
@click.option(
    "--missed",
    type=click.Choice(MISSED),
    default="skip",
    help="Firings missed while no beat ran: send only the latest (skip) or the latest "
    "--max-catch-up of them (catch_up).",
)
@click.option(
    "--max-catch-up",
    type=POSITIVE_INT,
    default=DEFAULT_MAX_CATCH_UP,
    metavar="N",
    help="With --missed catch_up: most missed firings sent.",
)
@click.option(
    "--until", metavar="TIME", callback=iso_time, help="Last firing time, ISO 8601 with a zone."
)
@pass_output
def add_schedule(
    out: Output,
    worker_ref: str,
    cron: str | None,
    every: float | None,
    tz: str,
    event_type: str,
    data: str | None,
    missed: str,
    max_catch_up: int,
    until: datetime | None,
) -> int:
    """Add a cron or an interval schedule (exactly one of --cron, --every) to a worker."""
    if (cron is None) == (every is None):
        raise UsageError("give exactly one of --cron, --every")
    info = out.manager.add_schedule(
        worker_ref,
        event_type=event_type,
        cron=cron,
        every_s=every,
        timezone=tz,
        data=_data(data),
        missed=missed,
        max_catch_up=max_catch_up,
        until=until,
    )
    if out.as_json:
        out.json(info.to_json())
        return 0
    names = out.manager.worker_names([info.worker_id])
    worker = labelled(info.worker_id, names.get(str(info.worker_id)))
    out.line(f"schedule {info.id} for worker {worker}: next firing {_time(info.next_fire_at)}")
    return 0


def _data(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--data is not JSON: {exc}") from None


def _time(at: datetime | None) -> str:
    return "none (--until has passed)" if at is None else cell(at)


@schedule.command("list")
@click.option("--worker", "worker_ref", metavar="WORKER", help="Only this worker's schedules.")
@pass_output
def list_schedules(out: Output, worker_ref: str | None) -> int:
    """List the schedules of live workers, oldest first."""
    found = out.reader.list_schedules(worker_ref)
    if out.as_json:
        out.json([s.to_json() for s in found])
        return 0
    names = out.reader.worker_names([s.worker_id for s in found])
    out.table(
        ["ID", "WORKER", "WHEN", "TYPE", "MISSED", "LAST", "NEXT"],
        (_row(s, names) for s in found),
        empty="no schedules",
        wrap=("WORKER", "WHEN"),
    )
    return 0


def _row(s: ScheduleInfo, names: dict[str, str | None]) -> list[Any]:
    return [
        s.id,
        labelled(s.worker_id, names.get(str(s.worker_id))),
        f"cron {s.cron} ({s.timezone})" if s.cron else f"every {s.every_s:g} s",
        s.event_type,
        s.missed,
        s.last_fired_at,
        s.next_fire_at,
    ]


@schedule.command("remove")
@click.argument("schedule_id", metavar="SCHEDULE")
@pass_output
def remove_schedule(out: Output, schedule_id: str) -> int:
    """Remove a schedule (by id or a unique prefix); firings already sent stay queued."""
    out.manager.remove_schedule(schedule_id)
    if out.as_json:
        out.json({"removed": schedule_id})
    else:
        out.line(f"removed schedule {schedule_id}")
    return 0
