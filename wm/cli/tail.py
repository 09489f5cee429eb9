"""``wm tail``: a topic's events as they arrive, one line each for people, JSON for scripts."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import uuid
from datetime import UTC, datetime
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from wm import stopsignals
from wm.cli.arguments import POSITIVE_FLOAT, POSITIVE_INT, Command, pass_output
from wm.cli.output import TIME_FORMAT, Output, labelled
from wm.views import aware

if TYPE_CHECKING:
    from rich.text import Text

logger = logging.getLogger(__name__)
#: Characters of a UUID-shaped event or correlation id that ``wm tail`` shows (``--full``:
#: all), like a short git hash.
SHORT_ID_CHARS = 8
#: What ``wm tail`` shows of a lifecycle event's type: ``lifecycle.error``, not the full
#: ``com.virtufin.workmanager.lifecycle.error`` (``--json`` keeps it whole).
_LIFECYCLE_SHORT = "lifecycle."
#: Lifecycle events whose reason ``wm tail`` shows on a line of its own, and in which colour.
_PROBLEMS = {
    "error": "bold red",
    "failed": "bold red",
    "killed": "bold red",
    "recovery": "bold yellow",
    "pending": "bold yellow",
    "health_changed": "bold yellow",
}


@click.command(cls=Command)
@click.argument("topic")
@click.option("--count", type=POSITIVE_INT, help="Stop after this many events.")
@click.option(
    "--timeout-s", type=POSITIVE_FLOAT, help="Stop when no event arrived for this long (seconds)."
)
@click.option(
    "--full", is_flag=True, help="Whole ids, and the data whole as indented JSON below the line."
)
@pass_output
def tail(out: Output, topic: str, count: int | None, timeout_s: float | None, full: bool) -> int:
    """Print a topic's events as they arrive (Ctrl-C stops).

    One line per event: time (UTC), type, id, subject, correlation id and the data as compact
    JSON, cut to the terminal's width (--full: whole). A lifecycle event about a problem (an
    error, a failed or killed worker, the circuit breaker, a recovery) shows its error or
    reason on a line of its own. --json prints each CloudEvent as one JSON line.

    Reads through a temporary subscription, removed again however tail ends.
    """
    from wm.errors import SubscriptionNotFound

    name = f"tail-{secrets.token_hex(4)}"
    # Before subscribing: a kill, or the terminal closing, must not leave the queue behind.
    global _cleaning, _ignored
    _cleaning = _ignored = False
    subscribed = False
    with stopsignals.handled(_interrupt):  # restored once the subscription is removed
        try:
            try:
                queue = out.manager.subscribe(topic, name)
            except KeyboardInterrupt:
                subscribed = True  # stopped halfway: what it made is removed below
                raise
            subscribed = True
            out.note(f"listening on {topic} (Ctrl-C stops)")
            _consume(out, queue, count, timeout_s, full)
        except KeyboardInterrupt:
            pass
        finally:
            _cleaning = True  # a second stop signal no longer cuts the removal short
            if subscribed:
                with contextlib.suppress(SubscriptionNotFound):
                    out.manager.unsubscribe(topic, name)
    return 0


#: Whether ``wm tail`` is removing its subscription, and whether a stop signal came
#: meanwhile (:func:`_interrupt`).
_cleaning = _ignored = False


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """Stop as Ctrl-C does. While the subscription is being removed, the first stop signal
    is let be (it would leave the queue, collecting the topic's events, behind); a second
    one gives the removal up, for a Redis that no longer answers."""
    global _ignored
    if _cleaning and not _ignored:
        _ignored = True
        return
    raise KeyboardInterrupt


def _consume(
    out: Output, queue: str, count: int | None, timeout_s: float | None, full: bool
) -> None:
    with contextlib.closing(out.manager.receive(queue, count=count, idle_s=timeout_s)) as bodies:
        for body in bodies:
            print_event(out, body, full)


def print_event(out: Output, body: str | bytes, full: bool) -> None:
    """One event as ``wm tail`` shows it (``wm consume`` too): a line, or JSON with --json."""
    from wm.errors import EventDecodeError
    from wm.events import decode, encode, event_to_dict

    try:
        event = decode(body)
    except EventDecodeError as exc:
        logger.warning("skipped a message that is not a CloudEvent: %s", exc)
        return
    if out.as_json:
        out.line(encode(event))
        return
    wire = event_to_dict(event)
    _print_line(out, _headline(wire, full), None if full else _compact_data(wire), cut=not full)
    problem = _problem(wire)
    if problem is not None:
        _print_problem(out, *problem)
    if full:
        _print_full_data(out, wire)


def _print_line(out: Output, headline: Text, data: str | None, *, cut: bool) -> None:
    """The event's line; on a terminal cut to its width with ``…`` (or wrapped when not
    ``cut``), elsewhere whole."""
    from rich.text import Text

    line = Text.assemble(headline, ("  " + data) if data else "")
    if not out.console.is_terminal:
        out.line(line.plain)
    elif cut:
        out.console.print(line, no_wrap=True, overflow="ellipsis", crop=True)
    else:
        out.console.print(line, overflow="fold")


def _print_problem(out: Output, text: str, style: str) -> None:
    from rich.padding import Padding
    from rich.text import Text

    if out.console.is_terminal:
        out.console.print(Padding(Text(text, style=style), (0, 0, 0, 2), expand=False))
    else:
        out.line(f"  {text}")


def _print_full_data(out: Output, wire: dict[str, Any]) -> None:
    if "data_base64" in wire:
        out.line(f"  base64: {wire['data_base64']}")
    elif wire.get("data") is not None:
        pretty = json.dumps(wire["data"], indent=2, ensure_ascii=False)
        out.line("\n".join("  " + line for line in pretty.splitlines()))


def _headline(wire: dict[str, Any], full: bool) -> Text:
    """Time, type, id, subject and correlation id, ``-`` where the event has none."""
    from rich.text import Text

    from wm.events import LIFECYCLE_TYPE_PREFIX

    kind = str(wire.get("type", ""))
    lifecycle = kind.startswith(LIFECYCLE_TYPE_PREFIX)
    if lifecycle:
        kind = _LIFECYCLE_SHORT + kind.removeprefix(LIFECYCLE_TYPE_PREFIX)
    subject = _short(wire.get("subject"), full)
    if lifecycle and isinstance(wire.get("data"), dict):
        subject = labelled(subject, wire["data"].get("name"))
    parts = [
        (_when(wire.get("time")), "dim"),
        (kind, "bold cyan"),
        (_short(wire.get("id"), full), ""),
        (subject, ""),
        (_short(wire.get("correlationid"), full), "dim"),
    ]
    return Text("  ").join(Text(text or "-", style=style) for text, style in parts)


def _compact_data(wire: dict[str, Any]) -> str | None:
    if "data_base64" in wire:
        return f"base64:{wire['data_base64']}"
    if wire.get("data") is None:
        return None
    return json.dumps(wire["data"], separators=(",", ":"), ensure_ascii=False)


def _problem(wire: dict[str, Any]) -> tuple[str, str] | None:
    """A lifecycle event's error or reason and its colour, when it reports a problem."""
    from wm.events import LIFECYCLE_TYPE_PREFIX

    kind = str(wire.get("type", ""))
    data = wire.get("data")
    if not kind.startswith(LIFECYCLE_TYPE_PREFIX) or not isinstance(data, dict):
        return None
    kind = kind.removeprefix(LIFECYCLE_TYPE_PREFIX)
    if kind not in _PROBLEMS:
        return None
    if data.get("error_message"):
        text = f"{data.get('error_type') or 'error'}: {data['error_message']}"
    elif data.get("reason"):
        text = str(data["reason"])
    else:
        return None
    return f"{kind}: {text}", _PROBLEMS[kind]


def _when(value: Any) -> str | None:
    """The event's time in UTC: ``12:34:56Z`` today, with the date on other days."""
    if not isinstance(value, str):
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        return value
    at = aware(at).astimezone(UTC)
    if at.date() == datetime.now(UTC).date():
        return at.strftime("%H:%M:%SZ")
    return at.strftime(TIME_FORMAT)


def _short(value: Any, full: bool) -> str | None:
    """A UUID-shaped id cut to :data:`SHORT_ID_CHARS` (unless ``full``); other ids whole."""
    if value is None:
        return None
    text = str(value)
    if full:
        return text
    try:
        canonical = str(uuid.UUID(text)) == text.lower()
    except ValueError:
        return text
    return text[:SHORT_ID_CHARS] if canonical else text
