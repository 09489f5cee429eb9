"""``wm publish`` (one event or a file of them) and the plain subscriptions."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

from wm.cli.arguments import (
    KEY_VALUE,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    Command,
    UsageError,
    parse_json,
    pass_output,
    read_bytes,
    read_json,
)
from wm.cli.output import Output, labelled
from wm.errors import InvalidArgument, WorkManagerError

if TYPE_CHECKING:
    from wm.events import CloudEvent

#: Options that build one event, which ``--event-file`` and ``--events-file`` replace.
_EVENT_FLAGS = {
    "type": "--type",
    "source": "--source",
    "subject": "--subject",
    "data": "--data",
    "data_file": "--data-file",
    "id": "--id",
    "correlation_id": "--correlation-id",
    "extensions": "--extension",
}

# -- publish ----------------------------------------------------------------------------------


@click.command(cls=Command)
@click.option(
    "--event-file",
    metavar="PATH",
    help="One structured-mode CloudEvent JSON file; - reads standard input.",
)
@click.option(
    "--events-file",
    metavar="PATH",
    help="Many events: JSON Lines (one structured-mode CloudEvent per line) or one JSON array; "
    "- reads standard input. The whole file is checked first: one bad event and nothing is sent.",
)
@click.option("--type", help="Event type (also the default topic).")
@click.option("--source", help="Event source, e.g. /my/app.")
@click.option("--subject", help="Event subject.")
@click.option("--data", metavar="JSON", help="Event data as JSON text.")
@click.option(
    "--data-file", metavar="PATH", help="Event data from a JSON file; - reads standard input."
)
@click.option("--topic", help="Topic to publish to. Default: each event's type.")
@click.option("--id", help="Event id. Default: a new UUID.")
@click.option("--correlation-id", help="Sets the correlationid extension.")
@click.option(
    "--extension",
    "extensions",
    multiple=True,
    type=KEY_VALUE,
    help="An extension attribute (repeatable).",
)
@pass_output
def publish(
    out: Output, event_file: str | None, events_file: str | None, topic: str | None, **flags: Any
) -> int:
    """Publish a CloudEvent (or a file of them) to a topic.

    One event: build it with --type and --source (and the other event options) or read it
    with --event-file. Many: --events-file; every event goes to --topic, or else to its own
    type. A line that is not a valid CloudEvent is reported by its number before anything is
    published, so a file is never half sent.
    """
    if event_file is not None and events_file is not None:
        raise UsageError("give --event-file (one event) or --events-file (many), not both")
    if events_file is not None:
        _refuse_event_flags("--events-file", flags)
        return _publish_many(out, _read_events(events_file, topic))
    if event_file is not None:
        _refuse_event_flags("--event-file", flags)
        from wm.events import decode

        event = decode(read_bytes(event_file))
    else:
        event = _event_from_flags(**flags)
    _publish_one(out, event, topic or event.get_type())
    return 0


def _refuse_event_flags(file_option: str, flags: dict[str, Any]) -> None:
    given = [option for name, option in _EVENT_FLAGS.items() if flags[name] not in (None, ())]
    if given:
        raise UsageError(f"{file_option} holds the whole event; drop {', '.join(given)}")


def _event_from_flags(
    *,
    type: str | None,
    source: str | None,
    subject: str | None,
    data: str | None,
    data_file: str | None,
    id: str | None,
    correlation_id: str | None,
    extensions: tuple[tuple[str, str], ...],
) -> CloudEvent:
    from wm.events import make_event

    if not type or not source:
        raise UsageError("give --type and --source, or --event-file, or --events-file")
    if data is not None and data_file is not None:
        raise UsageError("give the data with --data or --data-file, not both")
    value: Any = None
    if data is not None:
        value = parse_json(data, "--data")
    elif data_file is not None:
        value = read_json(data_file, "--data-file")
    attributes = dict(extensions)
    if correlation_id:
        attributes["correlationid"] = correlation_id
    return make_event(type, source, value, id=id, subject=subject, extensions=attributes)


def _publish_one(out: Output, event: CloudEvent, topic: str) -> None:
    reached = out.manager.publish(event, topic)
    if out.as_json:
        out.json({"id": event.get_id(), "topic": topic, "reached": reached})
    elif reached:
        out.line(f"published {event.get_id()} to {topic}: reached {reached} subscription(s)")
    else:
        out.line(
            f"published {event.get_id()} to {topic}: reached 0 subscriptions "
            "(dropped: topic has no subscriber)"
        )


def _read_events(path: str, topic: str | None) -> list[tuple[CloudEvent, str]]:
    """Every event of the file with the topic it goes to, all checked before any is sent."""
    where = "standard input" if path == "-" else path
    try:
        text = read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{where} is not UTF-8 text: {exc}") from exc
    if text.lstrip().startswith("["):
        items = parse_json(text, where)
        if not isinstance(items, list):
            raise InvalidArgument(f"{where} is not one JSON array of CloudEvents")
        numbered = [(f"{where} item {n}", json.dumps(item)) for n, item in enumerate(items, 1)]
    else:
        lines = enumerate(text.splitlines(), 1)
        numbered = [(f"{where} line {n}", line) for n, line in lines if line.strip()]
    return [_checked(what, raw, topic) for what, raw in numbered]


def _checked(what: str, raw: str, topic: str | None) -> tuple[CloudEvent, str]:
    from wm.events import decode
    from wm.names import check_name

    try:
        event = decode(raw)
        return event, check_name("topic", topic or event.get_type())
    except WorkManagerError as exc:
        raise InvalidArgument(f"{what}: {exc}") from exc


@dataclass
class _Tally:
    """What a bulk publish did, for its summary."""

    published: int = 0
    reached: int = 0
    dropped: int = 0
    topics: Counter[str] = field(default_factory=Counter)
    elapsed_s: float = 0.0

    def add(self, topic: str, reached: int) -> None:
        self.published += 1
        self.reached += reached
        self.dropped += reached == 0
        self.topics[topic] += 1

    @property
    def per_s(self) -> float:
        return self.published / self.elapsed_s if self.elapsed_s > 0 else 0.0


#: Events per ``publish_many`` call of a bulk publish: the progress bar moves per chunk.
_CHUNK = 1000


def _publish_many(out: Output, events: list[tuple[CloudEvent, str]]) -> int:
    tally = _Tally()
    started = time.monotonic()
    with out.progress("publishing", len(events)) as advance:
        for start in range(0, len(events), _CHUNK):
            chunk = events[start : start + _CHUNK]
            try:
                reached = _publish_chunk(out, chunk, tally)
            except WorkManagerError as exc:
                exc.add_note(_sent(tally, events))
                raise
            except KeyboardInterrupt:
                out.note(f"interrupted: {_sent(tally, events)}")
                raise
            for (_, topic), count in zip(chunk, reached, strict=True):
                tally.add(topic, count)
            advance(len(chunk))
    tally.elapsed_s = time.monotonic() - started
    _print_tally(out, tally)
    return 0


def _publish_chunk(out: Output, chunk: list[tuple[CloudEvent, str]], tally: _Tally) -> list[int]:
    """One ``publish_many``; the events it published before a failure go into ``tally``."""
    from wm.errors import PublishInterrupted

    topics = {topic for _, topic in chunk}  # one: --topic (or one type); more: each its type
    try:
        return out.manager.publish_many(
            [event for event, _ in chunk], topics.pop() if len(topics) == 1 else None
        )
    except PublishInterrupted as exc:
        for (_, topic), count in zip(chunk, exc.reached, strict=False):
            tally.add(topic, count)
        raise


def _sent(tally: _Tally, events: list[Any]) -> str:
    return f"{tally.published} of {len(events)} events were published, the rest were not"


def _print_tally(out: Output, tally: _Tally) -> None:
    if out.as_json:
        out.json(
            {
                "published": tally.published,
                "reached": tally.reached,
                "dropped": tally.dropped,
                "topics": dict(tally.topics),
                "elapsed_s": round(tally.elapsed_s, 3),
                "events_per_s": round(tally.per_s, 1),
            }
        )
        return
    events = "event" if tally.published == 1 else "events"
    text = (
        f"published {tally.published} {events} to {len(tally.topics)} topic(s), reached "
        f"{tally.reached} subscription(s), in {tally.elapsed_s:.2f} s ({tally.per_s:.0f}/s)"
    )
    if tally.dropped:
        text += f"; {tally.dropped} dropped: their topic has no subscriber"
    out.line(text)


# -- subscriptions ----------------------------------------------------------------------------


@click.command(cls=Command)
@click.argument("topic")
@click.argument("name")
@pass_output
def subscribe(out: Output, topic: str, name: str) -> int:
    """Feed a topic into a named durable queue any kombu client can read."""
    queue = out.manager.subscribe(topic, name)
    if out.as_json:
        out.json({"topic": topic, "name": name, "queue": queue})
    else:
        out.line(f"subscribed: topic {topic} feeds queue {queue}")
    return 0


@click.command(cls=Command)
@click.argument("topic")
@click.argument("name")
@click.option("--keep-queue", is_flag=True, help="Keep the queue and what it holds.")
@pass_output
def unsubscribe(out: Output, topic: str, name: str, keep_queue: bool) -> int:
    """Remove a plain subscription and its queue."""
    out.manager.unsubscribe(topic, name, delete_queue=not keep_queue)
    if out.as_json:
        out.json({"topic": topic, "name": name, "queue_deleted": not keep_queue})
    else:
        out.line(f"unsubscribed {name} from topic {topic}")
    return 0


#: How long ``wm consume`` waits for a message when the queue is empty, in seconds.
CONSUME_WAIT_S = 1.0


@click.command(cls=Command)
@click.argument("topic")
@click.option("--name", required=True, help="The subscription's name (wm subscribe TOPIC NAME).")
@click.option("--count", type=POSITIVE_INT, help="At most this many messages. Default: all.")
@click.option(
    "--timeout-s",
    type=POSITIVE_FLOAT,
    default=CONSUME_WAIT_S,
    show_default=True,
    help="Stop when no message arrived for this long (seconds).",
)
@click.option("--peek", is_flag=True, help="Show the waiting messages and leave them queued.")
@pass_output
def consume(
    out: Output, topic: str, name: str, count: int | None, timeout_s: float, peek: bool
) -> int:
    """Read a plain subscription's messages, oldest first (--peek: leave them queued).

    Each message is taken and acknowledged: it leaves the queue. --peek shows the messages
    waiting now without taking any, in the order they would be taken. Lines as wm tail
    prints them; --json: one CloudEvent per line. An empty queue prints nothing on standard
    output and exits 0.
    """
    from wm.cli.tail import print_event

    read = 0
    source = out.reader if peek else out.manager  # taking them is on the broker itself
    for body in source.consume(topic, name, count=count, idle_s=timeout_s, peek=peek):
        print_event(out, body, False)
        read += 1
    if not read:
        out.note(f"no messages in subscription {name} of topic {topic}")
    return 0


@click.command(cls=Command)
@click.option("--topic", help="Only subscriptions of this topic.")
@pass_output
def subscriptions(out: Output, topic: str | None) -> int:
    """List subscriptions (workers' and plain) with their queue depth."""
    found = out.reader.list_subscriptions(topic)
    if out.as_json:
        out.json(found)
        return 0
    names = out.reader.worker_names(s["worker_id"] for s in found)
    out.table(
        ["TOPIC", "QUEUE", "WORKER", "DEPTH"],
        (
            [
                s["topic"],
                s["queue"],
                labelled(s["worker_id"], names.get(s["worker_id"])),
                s["depth"],
            ]
            for s in found
        ),
        empty="no subscriptions",
        wrap=("QUEUE",),
    )
    return 0
