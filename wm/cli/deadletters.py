"""``wm dlq …``: inspect, replay and purge dead letters."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from wm.cli.arguments import UsageError, add_command, add_group, positive_float, positive_int
from wm.cli.output import Context

if TYPE_CHECKING:
    from wm.cli.arguments import Commands

#: Dead letters ``wm dlq list`` shows, and a filtered ``replay`` sends, unless told otherwise.
DEFAULT_LIST_LIMIT = 100
DEFAULT_REPLAY_LIMIT = 1000
#: Replays per second unless ``--rate`` says otherwise.
DEFAULT_REPLAY_RATE = 50.0


def register(commands: Commands, common: argparse.ArgumentParser) -> None:
    dlq = add_group(commands, "dlq", common, "inspect, replay and purge dead letters")
    listing = add_command(
        dlq,
        "list",
        list_letters,
        common,
        "list dead letters not yet replayed, oldest failure first",
    )
    _filters(listing)
    listing.add_argument("--all", action="store_true", help="include replayed ones")
    listing.add_argument("--limit", type=positive_int, default=DEFAULT_LIST_LIMIT)
    show = add_command(dlq, "show", show_letter, common, "show one dead letter and its event")
    show.add_argument("id")
    replay = add_command(
        dlq,
        "replay",
        replay_letters,
        common,
        "send dead letters back to their worker (by id, or all that match)",
    )
    replay.add_argument("ids", nargs="*", metavar="ID")
    _filters(replay)
    replay.add_argument(
        "--to-version",
        choices=["current", "same"],
        default="current",
        help="run the worker's current code, or the version that failed",
    )
    replay.add_argument(
        "--rate",
        type=positive_float,
        default=DEFAULT_REPLAY_RATE,
        metavar="N",
        help="at most N replays per second",
    )
    replay.add_argument(
        "--limit",
        type=positive_int,
        default=DEFAULT_REPLAY_LIMIT,
        help="at most this many when selecting by filter",
    )
    purge = add_command(
        dlq, "purge", purge_letters, common, "delete dead letters (by id, or all that match)"
    )
    purge.add_argument("ids", nargs="*", metavar="ID")
    _filters(purge)
    purge.add_argument("--yes", action="store_true", help="confirm a purge by filter")


def _filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topic")
    parser.add_argument("--worker", help="worker id, or the name of a live worker")
    parser.add_argument("--error-type", help="e.g. WorkerTimeout")


def _worker_id(ctx: Context, reference: str | None) -> str | None:
    """The id of ``--worker``; a deleted worker's letters stay reachable by its id."""
    return None if reference is None else ctx.manager.worker_id_of(reference)


def _has_filter(args: argparse.Namespace) -> bool:
    return any(value is not None for value in (args.topic, args.worker, args.error_type))


def _check_selection(args: argparse.Namespace) -> None:
    if args.ids and _has_filter(args):
        raise UsageError("give dead-letter ids or filters, not both")
    if not args.ids and not _has_filter(args):
        raise UsageError("give dead-letter ids, or select with --topic, --worker, --error-type")


def list_letters(ctx: Context, args: argparse.Namespace) -> int:
    letters = ctx.dead_letters.list(
        topic=args.topic,
        worker_id=_worker_id(ctx, args.worker),
        error_type=args.error_type,
        include_replayed=args.all,
        limit=args.limit,
    )
    if ctx.as_json:
        ctx.json([letter.to_json(envelope=False) for letter in letters])
        return 0
    ctx.table(
        ["ID", "TOPIC", "WORKER", "ERROR TYPE", "ATTEMPTS", "LAST FAILURE", "REPLAYS", "ERROR"],
        (
            [
                d.id,
                d.topic,
                d.worker_id,
                d.error_type,
                d.attempts,
                d.last_failure_at,
                d.replay_count,
                d.error_message,
            ]
            for d in letters
        ),
        empty="no dead letters",
    )
    return 0


def show_letter(ctx: Context, args: argparse.Namespace) -> int:
    letter = ctx.dead_letters.get(args.id)
    if ctx.as_json:
        ctx.json(letter.to_json())
        return 0
    ctx.fields(
        [(key.replace("_", " "), value) for key, value in letter.to_json(envelope=False).items()]
    )
    ctx.line("event:")
    try:
        ctx.line(json.dumps(json.loads(letter.envelope), indent=2))
    except ValueError:
        ctx.line(letter.envelope)
    return 0


def replay_letters(ctx: Context, args: argparse.Namespace) -> int:
    _check_selection(args)
    ids = list(args.ids) or [
        letter.id
        for letter in ctx.dead_letters.list(
            topic=args.topic,
            worker_id=_worker_id(ctx, args.worker),
            error_type=args.error_type,
            limit=args.limit,
        )
    ]
    sent = ctx.dead_letters.replay(ids, to_version=args.to_version, rate_per_s=args.rate)
    if ctx.as_json:
        ctx.json({"replayed": sent, "ids": ids})
    else:
        ctx.line(f"replayed {sent} dead letter(s)")
    return 0


def purge_letters(ctx: Context, args: argparse.Namespace) -> int:
    _check_selection(args)
    if _has_filter(args) and not args.yes:
        raise UsageError("a purge by filter deletes every matching dead letter; add --yes")
    purged = ctx.dead_letters.purge(
        list(args.ids) or None,
        topic=args.topic,
        worker_id=_worker_id(ctx, args.worker),
        error_type=args.error_type,
    )
    if ctx.as_json:
        ctx.json({"purged": purged})
    else:
        ctx.line(f"purged {purged} dead letter(s)")
    return 0
