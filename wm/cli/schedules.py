"""``wm schedule …``: events sent to a worker on a cron expression or an interval."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import TYPE_CHECKING

from wm.cli.arguments import UsageError, add_command, add_group, positive_float, positive_int
from wm.cli.output import Context
from wm.manager import DEFAULT_MAX_CATCH_UP
from wm.schedules import MISSED

if TYPE_CHECKING:
    from wm.cli.arguments import Commands


def register(commands: Commands, common: argparse.ArgumentParser) -> None:
    schedules = add_group(
        commands, "schedule", common, "send events to a worker on a schedule (celery beat)"
    )
    add = add_command(
        schedules, "add", add_schedule, common, "add a cron or interval schedule to a worker"
    )
    add.add_argument("worker", help="worker id, or the name of a live worker")
    when = add.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", metavar="EXPR", help="e.g. '0 9 * * 1-5' (five fields)")
    when.add_argument(
        "--every", type=positive_float, metavar="SECONDS", help="fire every SECONDS seconds"
    )
    add.add_argument("--tz", default="UTC", help="IANA time zone of --cron (default UTC)")
    add.add_argument("--type", required=True, help="type of the event each firing sends")
    add.add_argument("--data", metavar="JSON", help="the event's data, as JSON")
    add.add_argument(
        "--missed",
        choices=MISSED,
        default="skip",
        help="firings missed while no beat ran: send only the latest (skip, default) or "
        "the latest --max-catch-up of them (catch_up)",
    )
    add.add_argument("--max-catch-up", type=positive_int, default=DEFAULT_MAX_CATCH_UP)
    add.add_argument(
        "--until", type=datetime.fromisoformat, metavar="TIME", help="ISO 8601 with a zone"
    )
    listing = add_command(schedules, "list", list_schedules, common, "list schedules")
    listing.add_argument("--worker", help="only this worker's")
    remove = add_command(schedules, "remove", remove_schedule, common, "remove a schedule")
    remove.add_argument("id")


def add_schedule(ctx: Context, args: argparse.Namespace) -> int:
    try:
        data = json.loads(args.data) if args.data is not None else None
    except ValueError as exc:
        raise UsageError(f"--data is not JSON: {exc}") from None
    info = ctx.manager.add_schedule(
        args.worker,
        event_type=args.type,
        cron=args.cron,
        every_s=args.every,
        timezone=args.tz,
        data=data,
        missed=args.missed,
        max_catch_up=args.max_catch_up,
        until=args.until,
    )
    if ctx.as_json:
        ctx.json(info.to_json())
    else:
        ctx.line(f"schedule {info.id}: next firing {info.next_fire_at}")
    return 0


def list_schedules(ctx: Context, args: argparse.Namespace) -> int:
    found = ctx.manager.list_schedules(args.worker)
    if ctx.as_json:
        ctx.json([s.to_json() for s in found])
        return 0
    ctx.table(
        ["ID", "WORKER", "WHEN", "TYPE", "MISSED", "LAST", "NEXT"],
        (
            [
                s.id,
                s.worker_id,
                f"cron {s.cron} ({s.timezone})" if s.cron else f"every {s.every_s:g} s",
                s.event_type,
                s.missed,
                s.last_fired_at,
                s.next_fire_at,
            ]
            for s in found
        ),
        empty="no schedules",
    )
    return 0


def remove_schedule(ctx: Context, args: argparse.Namespace) -> int:
    ctx.manager.remove_schedule(args.id)
    if ctx.as_json:
        ctx.json({"removed": args.id})
    else:
        ctx.line(f"removed schedule {args.id}")
    return 0
