"""``wm publish``, ``wm subscribe``/``unsubscribe``/``subscriptions`` and ``wm tail``."""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from wm.cli.arguments import (
    UsageError,
    add_command,
    key_value,
    parse_json,
    positive_float,
    positive_int,
    read_bytes,
    read_json,
)
from wm.cli.output import Context
from wm.dataplane.app import broker_errors
from wm.dataplane.queues import subscription_queue
from wm.errors import EventDecodeError
from wm.events import CloudEvent, decode, encode, event_to_dict, make_event

if TYPE_CHECKING:
    from wm.cli.arguments import Commands

logger = logging.getLogger(__name__)
#: How long one wait for a message lasts while tailing, in seconds (bounds Ctrl-C latency).
TAIL_POLL_S = 1.0
#: Flags that build an event, which ``--event-file`` replaces.
_EVENT_FLAGS = ("type", "source", "subject", "data", "data_file", "id", "correlation_id")
#: Attributes of the one-line human form of ``wm tail``.
_TAIL_COLUMNS = ("time", "type", "id", "subject", "correlationid")


def register(commands: Commands, common: argparse.ArgumentParser) -> None:
    _publish_parser(commands, common)
    subscribe = add_command(
        commands,
        "subscribe",
        subscribe_topic,
        common,
        "feed a topic into a named durable queue any kombu client can read",
    )
    subscribe.add_argument("topic")
    subscribe.add_argument("name")
    unsubscribe = add_command(
        commands,
        "unsubscribe",
        unsubscribe_topic,
        common,
        "remove a plain subscription and its queue",
    )
    unsubscribe.add_argument("topic")
    unsubscribe.add_argument("name")
    unsubscribe.add_argument(
        "--keep-queue", action="store_true", help="keep the queue and what it holds"
    )
    listing = add_command(
        commands,
        "subscriptions",
        list_subscriptions,
        common,
        "list subscriptions (workers and plain) with their queue depth",
    )
    listing.add_argument("--topic")
    tail = add_command(
        commands, "tail", tail_topic, common, "print a topic's events as they arrive (Ctrl-C stops)"
    )
    tail.add_argument("topic")
    tail.add_argument("--count", type=positive_int, help="stop after this many events")
    tail.add_argument(
        "--timeout-s", type=positive_float, help="stop when no event arrived for this long"
    )


def _publish_parser(commands: Commands, common: argparse.ArgumentParser) -> None:
    publish = add_command(
        commands, "publish", publish_event, common, "publish a CloudEvent to a topic"
    )
    publish.add_argument(
        "--event-file",
        metavar="PATH",
        help="a structured-mode CloudEvent JSON file; - reads standard input",
    )
    publish.add_argument("--type", help="event type (also the default topic)")
    publish.add_argument("--source", help="event source, e.g. /my/app")
    publish.add_argument("--subject")
    data = publish.add_mutually_exclusive_group()
    data.add_argument("--data", metavar="JSON", help="event data as JSON text")
    data.add_argument("--data-file", metavar="PATH", help="event data from a JSON file")
    publish.add_argument("--topic", help="default: the event type")
    publish.add_argument("--id", help="default: a new UUID")
    publish.add_argument("--correlation-id", help="sets the correlationid extension")
    publish.add_argument(
        "--extension",
        action="append",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="an extension attribute",
    )


def publish_event(ctx: Context, args: argparse.Namespace) -> int:
    event = _event_from_file(args) if args.event_file else _event_from_flags(args)
    topic = args.topic or event.get_type()
    reached = ctx.manager.publish(event, topic)
    if ctx.as_json:
        ctx.json({"id": event.get_id(), "topic": topic, "reached": reached})
    elif reached:
        ctx.line(f"published {event.get_id()} to {topic}: reached {reached} subscription(s)")
    else:
        ctx.line(
            f"published {event.get_id()} to {topic}: reached 0 subscriptions "
            "(dropped: topic has no subscriber)"
        )
    return 0


def _event_from_file(args: argparse.Namespace) -> CloudEvent:
    given = [
        f"--{name.replace('_', '-')}" for name in _EVENT_FLAGS if getattr(args, name) is not None
    ]
    if args.extension:
        given.append("--extension")
    if given:
        raise UsageError(f"--event-file holds the whole event; drop {', '.join(given)}")
    return decode(read_bytes(args.event_file))


def _event_from_flags(args: argparse.Namespace) -> CloudEvent:
    if not args.type or not args.source:
        raise UsageError("give --type and --source, or --event-file")
    data: Any = None
    if args.data is not None:
        data = parse_json(args.data, "--data")
    elif args.data_file is not None:
        data = read_json(args.data_file, "--data-file")
    extensions = dict(args.extension)
    if args.correlation_id:
        extensions["correlationid"] = args.correlation_id
    return make_event(
        args.type, args.source, data, id=args.id, subject=args.subject, extensions=extensions
    )


def subscribe_topic(ctx: Context, args: argparse.Namespace) -> int:
    queue = ctx.manager.subscribe(args.topic, args.name)
    if ctx.as_json:
        ctx.json({"topic": args.topic, "name": args.name, "queue": queue})
    else:
        ctx.line(f"subscribed: topic {args.topic} feeds queue {queue}")
    return 0


def unsubscribe_topic(ctx: Context, args: argparse.Namespace) -> int:
    ctx.manager.unsubscribe(args.topic, args.name, delete_queue=not args.keep_queue)
    if ctx.as_json:
        ctx.json({"topic": args.topic, "name": args.name, "queue_deleted": not args.keep_queue})
    else:
        ctx.line(f"unsubscribed {args.name} from topic {args.topic}")
    return 0


def list_subscriptions(ctx: Context, args: argparse.Namespace) -> int:
    found = ctx.manager.list_subscriptions(args.topic)
    if ctx.as_json:
        ctx.json(found)
        return 0
    ctx.table(
        ["TOPIC", "QUEUE", "WORKER", "DEPTH"],
        ([s["topic"], s["queue"], s["worker_id"], s["depth"]] for s in found),
        empty="no subscriptions",
    )
    return 0


def tail_topic(ctx: Context, args: argparse.Namespace) -> int:
    """Read a topic through a temporary subscription, removed again however tail ends."""
    name = f"tail-{secrets.token_hex(4)}"
    queue = ctx.manager.subscribe(args.topic, name)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _consume(ctx, queue, args.count, args.timeout_s)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        ctx.manager.unsubscribe(args.topic, name)
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _consume(ctx: Context, queue: str, count: int | None, timeout_s: float | None) -> None:
    seen = 0
    # A kombu Connection to WM_BROKER_URL with the transport options publishers use.
    with broker_errors(ctx.settings), ctx.manager.bus.app.connection_for_read() as conn:
        simple = conn.SimpleQueue(subscription_queue(queue))
        try:
            while count is None or seen < count:
                message = _next_message(simple, timeout_s)
                if message is None:
                    return
                _print_event(ctx, message.body)
                message.ack()
                seen += 1
        finally:
            simple.close()


def _next_message(simple: Any, timeout_s: float | None) -> Any:
    """The next message, or None once ``timeout_s`` passed without one (None: wait forever)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        wait = TAIL_POLL_S if deadline is None else min(TAIL_POLL_S, deadline - time.monotonic())
        if wait <= 0:
            return None
        try:
            return simple.get(block=True, timeout=wait)
        except simple.Empty:
            continue


def _print_event(ctx: Context, body: str | bytes) -> None:
    try:
        event = decode(body)
    except EventDecodeError as exc:
        logger.warning("skipped a message that is not a CloudEvent: %s", exc)
        return
    if ctx.as_json:
        ctx.line(encode(event))
        return
    wire = event_to_dict(event)
    ctx.line("  ".join(str(wire.get(key) or "-") for key in _TAIL_COLUMNS))
