"""``wm dlq …``: inspect, replay and purge dead letters.

A letter outlives its worker, so tables label every letter's worker by name, a deleted
worker's too, and ``--worker`` takes a deleted worker's id or name. A replay is rate limited and a
large purge goes in batches: both show a progress bar at a terminal and end with a summary
line. A purge by filter deletes nothing without ``--yes``: it says how many letters it would
delete and exits 1 (``wm: error: …``), so a forgotten flag never deletes and never passes for
success in a script.
"""

from __future__ import annotations

import contextlib
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import click

from wm.cli.arguments import POSITIVE_FLOAT, POSITIVE_INT, Group, UsageError, pass_output
from wm.cli.output import Output, labelled
from wm.errors import InvalidArgument

if TYPE_CHECKING:
    from wm.cli.remote import Reader
    from wm.views import DeadLetterInfo

#: Dead letters ``wm dlq list`` shows, and a filtered ``replay`` sends, unless told otherwise.
DEFAULT_LIST_LIMIT = 100
DEFAULT_REPLAY_LIMIT = 1000
#: Replays per second unless ``--rate`` says otherwise.
DEFAULT_REPLAY_RATE = 50.0
#: Dead letters a purge deletes at least before it shows a progress bar (at a terminal): a
#: smaller one is over in a blink.
PURGE_PROGRESS_FROM = 1000
#: Characters of the short ids a narrow terminal's table shows: a letter's, its worker's.
SHORT_LETTER_ID_CHARS = 12
SHORT_WORKER_ID_CHARS = 8


@click.group(cls=Group)
def dlq() -> None:
    """Inspect, replay and purge dead letters.

    ID: a dead letter's id or a unique prefix of it (6+ characters). WORKER: a worker's id,
    a unique prefix of it, or its name (a deleted worker's too: its letters outlive it).
    """


@dataclass(frozen=True)
class Filters:
    """``--topic``, ``--worker``, ``--error-type``: which dead letters a command means."""

    topic: str | None = None
    #: As given (id, short id or name) until :meth:`resolved`, a worker id after.
    worker: str | None = None
    error_type: str | None = None

    @property
    def given(self) -> bool:
        return any(value is not None for value in (self.topic, self.worker, self.error_type))

    def flags(self) -> str:
        """The filters as typed: how a message tells which letters it means."""
        pairs = (
            ("--topic", self.topic),
            ("--worker", self.worker),
            ("--error-type", self.error_type),
        )
        return " ".join(
            f"{flag} {shlex.quote(value)}" for flag, value in pairs if value is not None
        )

    def resolved(self, reader: Reader) -> Filters:
        """The same filters with the worker's id (its name or short id looked up once) -- a
        deleted worker's name too, since the tables show it and its letters outlive it."""
        if self.worker is None:
            return self
        return replace(self, worker=reader.worker_id_of(self.worker, deleted_names=True))


def _filter_options(function: Any) -> Any:
    for option in reversed(
        (
            click.option("--topic", help="Only letters of this topic."),
            click.option(
                "--worker",
                "worker_ref",
                metavar="WORKER",
                help="Only letters of this worker (a deleted worker's id or name works too).",
            ),
            click.option(
                "--error-type", help="Only letters that failed with this error, e.g. WorkerTimeout."
            ),
        )
    ):
        function = option(function)
    return function


def _selection(ids: tuple[str, ...], filters: Filters) -> None:
    """A replay or purge names its letters one way: by id, or by filter."""
    if ids and filters.given:
        raise UsageError("give dead-letter ids or filters, not both")
    if not ids and not filters.given:
        raise UsageError("give dead-letter ids, or select with --topic, --worker, --error-type")


@dlq.command("list")
@_filter_options
@click.option("--all", "include_replayed", is_flag=True, help="Include letters already replayed.")
@click.option(
    "--limit", type=POSITIVE_INT, default=DEFAULT_LIST_LIMIT, help="Show at most this many."
)
@pass_output
def list_letters(
    out: Output,
    topic: str | None,
    worker_ref: str | None,
    error_type: str | None,
    include_replayed: bool,
    limit: int,
) -> int:
    """List dead letters not yet replayed, oldest failure first."""
    filters = Filters(topic, worker_ref, error_type).resolved(out.reader)
    letters = out.reader.dead_letters.list(
        topic=filters.topic,
        worker_id=filters.worker,
        error_type=filters.error_type,
        include_replayed=include_replayed,
        limit=limit,
    )
    names = out.reader.worker_names(letter.worker_id for letter in letters)
    if out.as_json:
        out.json([_with_name(d.to_json(envelope=False), _name(names, d)) for d in letters])
        return 0
    layout = next(each for each in LAYOUTS if out.console.width >= each.min_width)
    out.table(
        layout.headers,
        (layout.row(d, _name(names, d)) for d in letters),
        empty="no dead letters",
        wrap=("WORKER", "ERROR"),
    )
    if len(letters) == limit:
        out.note(f"showing the oldest {limit}; --limit shows more")
    return 0


@dataclass(frozen=True)
class Layout:
    """The columns ``dlq list`` shows on a terminal at least ``min_width`` columns wide.

    A narrower one gets fewer columns and short ids (unique prefixes, which every command
    accepts), so that the worker's name and the error keep room to wrap instead of being
    squeezed out. Without an ERROR TYPE column the error reads ``Type: message``.
    """

    min_width: int
    headers: tuple[str, ...]
    short_ids: bool

    def row(self, letter: DeadLetterInfo, name: str | None) -> list[Any]:
        letter_id, worker_id = letter.id, letter.worker_id
        if self.short_ids:
            letter_id = letter_id[:SHORT_LETTER_ID_CHARS]
            worker_id = worker_id and worker_id[:SHORT_WORKER_ID_CHARS]
        error = letter.error_message
        if "ERROR TYPE" not in self.headers:
            error = f"{letter.error_type}: {error}"
        cells = {
            "ID": letter_id,
            "TOPIC": letter.topic,
            "WORKER": labelled(worker_id, name),
            "ERROR TYPE": letter.error_type,
            "ATTEMPTS": letter.attempts,
            "LAST FAILURE": letter.last_failure_at,
            "REPLAYS": letter.replay_count,
            "ERROR": error,
        }
        return [cells[header] for header in self.headers]


#: Widest first; the first that the terminal (or a pipe, 1000 columns) is wide enough for.
LAYOUTS = (
    Layout(
        200,
        ("ID", "TOPIC", "WORKER", "ERROR TYPE", "ATTEMPTS", "LAST FAILURE", "REPLAYS", "ERROR"),
        short_ids=False,
    ),
    Layout(120, ("ID", "WORKER", "ERROR TYPE", "LAST FAILURE", "ERROR"), short_ids=True),
    Layout(0, ("ID", "WORKER", "ERROR"), short_ids=True),
)


def _name(names: dict[str, str | None], letter: DeadLetterInfo) -> str | None:
    return names.get(letter.worker_id) if letter.worker_id else None


def _with_name(fields: dict[str, Any], name: str | None) -> dict[str, Any]:
    """The letter's fields with ``worker_name`` right after ``worker_id``."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        out[key] = value
        if key == "worker_id":
            out["worker_name"] = name
    return out


@dlq.command("show")
@click.argument("letter_id", metavar="ID")
@pass_output
def show_letter(out: Output, letter_id: str) -> int:
    """Show one dead letter and its event."""
    letter = out.reader.dead_letters.get(letter_id)
    name = _name(out.reader.worker_names([letter.worker_id]), letter)
    fields = _with_name(letter.to_json(), name)
    if out.as_json:
        out.json(fields)
        return 0
    out.fields(
        [
            ("id", letter.id),
            ("topic", letter.topic),
            ("worker", labelled(letter.worker_id, name)),
            ("event id", letter.event_id),
            ("error type", letter.error_type),
            ("attempts", letter.attempts),
            ("version", letter.version),
            ("sha256", letter.sha256),
            ("fence", letter.fence),
            ("first failure", letter.first_failure_at),
            ("last failure", letter.last_failure_at),
            ("replays", letter.replay_count),
            ("replayed", letter.replayed_at),
            ("error", letter.error_message),
        ]
    )
    out.line()
    _print_event(out, fields["envelope"])
    return 0


def _print_event(out: Output, event: Any) -> None:
    """The event pretty-printed (coloured at a terminal); one that is no JSON as its text."""
    if isinstance(event, str):
        out.line("event (not JSON, as it arrived):")
        out.line(event)
        return
    from rich.json import JSON

    out.line("event:")
    out.console.print(JSON.from_data(event, indent=2, ensure_ascii=False))


@dlq.command("replay")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@_filter_options
@click.option(
    "--to-version",
    type=click.Choice(["current", "same"]),
    default="current",
    help="Run the worker's current code, or the version that failed.",
)
@click.option(
    "--rate",
    type=POSITIVE_FLOAT,
    default=DEFAULT_REPLAY_RATE,
    metavar="N",
    help="Send at most N letters per second.",
)
@click.option(
    "--limit",
    type=POSITIVE_INT,
    default=DEFAULT_REPLAY_LIMIT,
    help="Send at most this many when selecting by filter.",
)
@pass_output
def replay_letters(
    out: Output,
    ids: tuple[str, ...],
    topic: str | None,
    worker_ref: str | None,
    error_type: str | None,
    to_version: str,
    rate: float,
    limit: int,
) -> int:
    """Send dead letters back to their worker (by id, or all that match).

    Replayed letters stay listed under --all with their replay count; a letter whose worker
    was deleted cannot be replayed (purge it instead).
    """
    filters = Filters(topic, worker_ref, error_type)
    _selection(ids, filters)
    chosen = list(ids) or _matching(out, filters, limit)
    started = time.monotonic()
    with _counted(out, "replaying", len(chosen), bar=True) as advance:
        sent = out.manager.dead_letters.replay(
            chosen, to_version=to_version, rate_per_s=rate, progress=advance
        )
    elapsed_s = time.monotonic() - started
    if out.as_json:
        out.json(
            {
                "replayed": sent,
                "selected": len(chosen),
                "ids": chosen,
                "elapsed_s": round(elapsed_s, 3),
            }
        )
    else:
        out.line(f"replayed {sent} of {len(chosen)} dead letter(s) in {elapsed_s:.1f} s")
    return 0


def _matching(out: Output, filters: Filters, limit: int) -> list[str]:
    """The ids of the letters not yet replayed that ``filters`` select, oldest first."""
    resolved = filters.resolved(out.manager)
    ids = [
        letter.id
        for letter in out.manager.dead_letters.list(
            topic=resolved.topic,
            worker_id=resolved.worker,
            error_type=resolved.error_type,
            limit=limit,
        )
    ]
    if not ids:
        out.note(f"nothing to replay: no dead letter waiting matches {filters.flags()}")
    elif len(ids) == limit:
        out.note(f"selected the oldest {limit} (--limit); run again for the rest")
    return ids


@contextlib.contextmanager
def _counted(out: Output, doing: str, total: int, *, bar: bool) -> Iterator[Callable[[int], None]]:
    """Yields the function the API reports progress to: it moves the bar (at a terminal,
    when ``bar``) and counts, so that an interrupted run (Ctrl-C) says how far it got."""
    done = 0
    shown = out.progress(doing, total) if bar else contextlib.nullcontext(_ignore)
    try:
        with shown as advance:

            def count(letters: int) -> None:
                nonlocal done
                done += letters
                advance(letters)

            yield count
    except KeyboardInterrupt:
        out.note(f"interrupted after {doing} {done} of {total} dead letter(s)")
        raise


def _ignore(letters: int) -> None:
    """No progress bar."""


@dlq.command("purge")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@_filter_options
@click.option(
    "--yes",
    is_flag=True,
    help="Delete every letter the filters match; without it a purge by filter only counts them.",
)
@pass_output
def purge_letters(
    out: Output,
    ids: tuple[str, ...],
    topic: str | None,
    worker_ref: str | None,
    error_type: str | None,
    yes: bool,
) -> int:
    """Delete dead letters (by id, or all that match, replayed ones too).

    By id, each letter must exist (a typo deletes nothing). By filter, --yes confirms:
    without it nothing is deleted, the command only says how many letters match (exit 1).
    """
    filters = Filters(topic, worker_ref, error_type)
    _selection(ids, filters)
    resolved = filters.resolved(out.manager)
    total = len(ids) or _count(out, resolved)
    if not ids and not yes:
        raise InvalidArgument(
            f"would purge {total} dead letter(s) matching {filters.flags()} (replayed ones "
            "included); nothing deleted: run again with --yes to delete them"
        )
    started = time.monotonic()
    with _counted(out, "purging", total, bar=total >= PURGE_PROGRESS_FROM) as advance:
        purged = out.manager.dead_letters.purge(
            list(ids) or None,
            topic=resolved.topic,
            worker_id=resolved.worker,
            error_type=resolved.error_type,
            progress=advance,
        )
    elapsed_s = time.monotonic() - started
    if out.as_json:
        out.json({"purged": purged, "elapsed_s": round(elapsed_s, 3)})
    else:
        out.line(f"purged {purged} dead letter(s) in {elapsed_s:.1f} s")
    return 0


def _count(out: Output, resolved: Filters) -> int:
    return out.manager.dead_letters.count(
        topic=resolved.topic,
        worker_id=resolved.worker,
        error_type=resolved.error_type,
        include_replayed=True,
    )
