"""The ``wm bench`` command: its options, the phases they ask for in order, a progress bar at a
terminal and a summary line (or one JSON object) at the end. Each phase is a module of its
own: the task-event phase (``wm.bench.taskevents``, on the embedded Redis), then, on the
broker ``--broker`` names, the drain (``wm.bench.drain``), round-trip
(``wm.bench.roundtrip``), scale (``wm.bench.scale``) and pool (``wm.bench.pools``) phases,
the start-up phase (``wm.bench.startup``), the read-command phase (``wm.bench.commands``)
and the engines' in-process round trips
(``wm.bench.enginetrips``). Every phase has names, a node and exchanges of its own
(``wm.bench.rig``) and deletes them when it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from kombu.connection import Connection

from wm import store
from wm.bench import (
    commands,
    drain,
    enginetrips,
    multinode,
    pools,
    publishing,
    roundtrip,
    scale,
    startup,
    taskevents,
)
from wm.bench.rig import (
    BROKERS,
    CSHARP,
    DEFAULT_AMQP_URL,
    DOTNET_DLL,
    NATIVE,
    PYTHON,
    PYTHON_ANSWER,
    Begin,
    EngineWorker,
)
from wm.config import Settings, masked
from wm.dataplane.app import BROKER_ERRORS
from wm.errors import BrokerUnavailable
from wm.local.up import embedded_redis

#: Nodes of the scale phase unless ``--scale-nodes`` gives counts (it runs on the largest).
SCALE_NODES = 3
#: What ``wm bench --help`` says: plain text (the module's docstring is for its readers).
DESCRIPTION = """\
Times WorkManager's delivery against a bare Celery task, in one run, on the
same broker and concurrency: events/s, p50/p99 publish-to-done latency and the
ratio to bare Celery, then the Python engine's round trip per message (host,
sandboxed child, host). --native-zip, --dotnet-package and --csharp-file add a
native, a .NET and a C# worker to the phases and time their engines' round
trips too.

The first phase times both sides from Celery's task events, on the embedded
Redis (or on WM_BROKER_URL and WM_REDIS_URL when set). The drain
(--drain-repeats), round-trip (--round-trips), multi-node (--scale-nodes),
scale (--scale-workers) and pool (--pools) phases run on the broker --broker
names, with task events off as on a node. The drain and multi-node phases
measure WorkManager's node against an independent plain Celery app in its own
process tree (acks_late, prefetch multiplier 4, JSON, prefork, log level
WARNING on both sides). Each phase makes names, a node and exchanges of its own and deletes them
when it ends.

The read-command phase (--commands-repeats) builds a store of realistic size
(on the PostgreSQL server --commands-database-url names, else SQLite) and times
every wm command that only reads, as new processes, against 0.5 s (wm --help
against 0.1 s).

A progress bar shows on standard error at a terminal, and a summary line ends
the run. With --json the tables go to standard error and standard output gets
one JSON object of the results.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the phases the command line asks for; prints a summary line (or, with --json,
    one JSON object) at the end."""
    args = _arguments(argv)
    started = time.monotonic()
    stdout = sys.stdout
    shown = not args.json and sys.stderr.isatty()
    with (
        contextlib.redirect_stdout(sys.stderr if args.json else stdout),
        _progress(sum(steps for _, steps in _phases(args)), shown) as begin,
    ):
        found = _bench(args, begin)
    found["phases"] = [name for name, _ in _phases(args)]
    found["seconds"] = round(time.monotonic() - started, 1)
    _summary(stdout, found, args.json)
    return 0


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed command line; a usage error (exit 2) for options that do not fit."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.broker == "amqp":
        args.broker_url = args.broker_url or DEFAULT_AMQP_URL
        if not args.broker_url.startswith(("amqp://", "amqps://")):
            parser.error(f"--broker-url {args.broker_url!r} is no amqp:// URL")
        _check_rabbitmq(args.broker_url)
    elif args.broker_url is not None:
        parser.error("--broker-url names RabbitMQ for --broker amqp")
    if (args.drain_repeats or _multi_node(args)) and args.drain_events < 1:
        parser.error("the drain and multi-node phases need --drain-events above 0")
    if args.scale_workers and not 1 <= args.scale_topics <= args.scale_workers:
        parser.error("--scale-topics must be between 1 and --scale-workers")
    if args.commands_repeats and args.commands_workers < 1:
        parser.error("--commands-workers must be 1 or more")
    url = args.commands_database_url
    if url is not None and not url.startswith(("postgresql://", "postgresql+psycopg://")):
        parser.error(f"--commands-database-url {url!r} is no postgresql:// URL")
    if args.pools and args.pool_repeats < 1:
        parser.error("--pool-repeats must be 1 or more")
    if args.scale_workers and min(args.scale_deliveries, args.scale_repeats) < 1:
        parser.error("--scale-deliveries and --scale-repeats must be 1 or more")
    return args


def _bench(args: argparse.Namespace, begin: Begin) -> dict[str, Any]:
    """Every phase asked for; what the JSON answer holds of them."""
    found: dict[str, Any] = {"task_events": None, "engine_round_trips": []}
    with tempfile.TemporaryDirectory(prefix="wm-bench-") as tmp:
        home = Path(tmp)
        with embedded_redis(home) as settings:
            settings = settings.replace(database_url=f"sqlite:///{home / 'bench.db'}")
            store.upgrade(settings)
            # both sides are timed from task events: on for the node and the publishers
            if args.events:
                found["task_events"] = _task_event_phase(
                    settings.replace(task_events=True), home, args, begin
                )
            found.update(_broker_phases(settings, home, args, begin))
            if _multi_node(args):
                found["multi_node"] = _multi_node_phase(settings, home, args, begin)
            _scale_phase(settings, home, args, begin)
            _pools_phase(settings, home, args, begin)
            if args.publish_events:
                begin("publish phase")
                broker = args.broker_url if args.broker == "amqp" else settings.broker_url
                found["publish"] = publishing.run(
                    settings.replace(broker_url=broker), args.publish_events, args.publish_repeats
                )
            if args.startup_repeats:
                begin("start-up phase")
                found["startup"] = startup.report(args.startup_repeats, settings.redis_url)
            if args.commands_repeats:
                begin("read-command phase")
                found["commands"] = commands.report(
                    settings, tmp, args.commands_database_url, args.commands_workers,
                    args.commands_repeats,
                )  # fmt: skip
    if args.engine_messages:
        found["engine_round_trips"] = enginetrips.run(
            args.engine_messages, args.native_zip, _dotnet_workers(args), begin
        )
    return found


def _phases(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The phases this command line runs, each with its steps on the progress bar: one per
    scenario or engine worker timed, one for a phase timed by another module."""
    engines = 1 + bool(args.native_zip) + len(_dotnet_workers(args))
    phases = [
        ("task events", 3 + engines if args.events else 0),
        ("drain", 1 if args.drain_repeats else 0),
        ("round trips", 1 if args.round_trips else 0),
        ("multi-node", 1 if _multi_node(args) else 0),
        ("scale", 1 if args.scale_workers else 0),
        ("pools", 1 if args.pools else 0),
        ("publish", 1 if args.publish_events else 0),
        ("start-up", 1 if args.startup_repeats else 0),
        ("read commands", 1 if args.commands_repeats else 0),
        (
            "engine round trips",
            len(enginetrips.ENGINE_WORKERS) + engines - 1 if args.engine_messages else 0,
        ),
    ]
    return [(name, steps) for name, steps in phases if steps]


@contextlib.contextmanager
def _progress(total: int, shown: bool) -> Iterator[Begin]:
    """A rich progress bar on standard error (when ``shown``) over ``total`` steps; yields the
    function that names the step beginning now and counts the one before it done. At a
    terminal the tables printed meanwhile appear above the bar."""
    if not shown or not total:
        yield lambda step: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        redirect_stdout=sys.stdout.isatty(),
    ) as bar:
        task = bar.add_task("wm bench", total=total)
        begun = [0]

        def begin(step: str) -> None:
            bar.update(task, description=step, completed=begun[0])
            begun[0] += 1

        yield begin
        bar.update(task, description="wm bench", completed=total)


def _summary(stream: TextIO, found: dict[str, Any], as_json: bool) -> None:
    """The last word: one JSON object, or one line for people."""
    if as_json:
        print(json.dumps(found, indent=2), file=stream, flush=True)
        return
    phases = ", ".join(found["phases"]) or "no phase"
    print(f"\nwm bench: {phases} in {found['seconds']:.0f} s", file=stream, flush=True)


def _parser() -> argparse.ArgumentParser:
    """The command line, its options in the order ``--help`` shows them."""
    parser = argparse.ArgumentParser(
        prog="wm bench", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    _add_task_event_phase(parser)
    _add_engines(parser)
    _add_broker_phases(parser)
    _add_scale_phase(parser)
    _add_pools_and_startup(parser)
    _add_commands_phase(parser)
    return parser


def _add_task_event_phase(parser: argparse.ArgumentParser) -> None:
    """``--json``, and the options of the task-event phase (``--concurrency`` is every
    phase's)."""
    parser.add_argument(
        "--json",
        action="store_true",
        help="Print one JSON object of the results on standard output; the tables go to "
        "standard error.",
    )
    parser.add_argument(
        "--events",
        metavar="N",
        type=int,
        default=2000,
        help="Events per scenario of the task-event phase (0 skips that phase).",
    )
    parser.add_argument(
        "--concurrency", metavar="N", type=int, default=2, help="Celery processes per node."
    )
    parser.add_argument(
        "--timeout-s",
        metavar="S",
        type=float,
        default=600,
        help="Longest a scenario may take, in seconds.",
    )


def _add_engines(parser: argparse.ArgumentParser) -> None:
    """The in-process round trips, and the workers on real engines the phases add."""
    parser.add_argument(
        "--engine-messages",
        metavar="N",
        type=int,
        default=5000,
        help="Messages of the Python engine's round trip (0 skips it).",
    )
    parser.add_argument(
        "--native-zip",
        metavar="ZIP",
        type=Path,
        help="A native worker zip (make -C native_abi builds build/c-example.zip): adds a "
        "native worker scenario and the native engine's round trip.",
    )
    parser.add_argument(
        "--dotnet-package",
        metavar="NUPKG",
        type=Path,
        help="A nupkg of engines/dotnet/examples/CommandWorker.cs (see "
        "docs/guides/dotnet-workers.md): adds a .NET DLL worker scenario and the .NET engine's "
        "round trip.",
    )
    parser.add_argument(
        "--csharp-file",
        metavar="CS",
        type=Path,
        help="C# source of a command worker with an 'echo' command (such as "
        "engines/dotnet/examples/CommandWorker.cs): adds a C# worker scenario and round trip.",
    )


def _add_pools_and_startup(parser: argparse.ArgumentParser) -> None:
    """The pool and start-up phases."""
    parser.add_argument(
        "--pools",
        type=int,
        default=0,
        metavar="EVENTS",
        help="Also run the pool phase: EVENTS queued events per workload drained under "
        "prefork, threads and several nodes (0 skips it).",
    )
    parser.add_argument(
        "--pool-repeats",
        metavar="R",
        type=int,
        default=2,
        help="Interleaved rounds of the pool phase.",
    )
    parser.add_argument(
        "--publish-events",
        type=int,
        default=0,
        metavar="N",
        help="Publish phase: N events per round from this process by a bare send_task, "
        "publish and publish_many, on the broker --broker names (0: skip).",
    )
    parser.add_argument(
        "--publish-repeats", metavar="R", type=int, default=3, help="Rounds of the publish phase."
    )
    parser.add_argument(
        "--startup-repeats",
        metavar="R",
        type=int,
        default=0,
        help="Start-up phase: time `wm --help` and `wm worker list` R times each, as new "
        "processes, against an empty interpreter and the import of the libraries `wm worker "
        "list` needs (0: skip).",
    )


def _add_commands_phase(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--commands-repeats",
        metavar="R",
        type=int,
        default=0,
        help="Read-command phase: build a store and time every read command of wm (status, "
        "worker list/show/history/transitions/code, dlq list/show, schedule list, "
        "subscriptions, tokens, audit...) R times each, as new processes (0: skip).",
    )
    parser.add_argument(
        "--commands-workers",
        metavar="N",
        type=int,
        default=150,
        help="Workers of the read-command phase's store (each with versions, transitions, "
        "dead letters; a third with a schedule).",
    )
    parser.add_argument(
        "--commands-database-url",
        metavar="URL",
        help="A PostgreSQL server (postgresql+psycopg://user@host:5432/db) on which the "
        "read-command phase makes a database of its own, dropped at the end; without it, "
        "SQLite.",
    )


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's paragraphs, and shows an option's default where it has one
    (not for a flag or an option that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default in (0, []):
            return action.help
        return super()._get_help_string(action)


def _add_scale_phase(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scale-workers",
        metavar="W",
        type=int,
        default=0,
        help="Also run the scale phase: this many stub workers against one, on the broker "
        "--broker names (0 skips it).",
    )
    parser.add_argument(
        "--scale-topics",
        metavar="T",
        type=int,
        default=100,
        help="Topics of the scale phase's workers.",
    )
    parser.add_argument(
        "--scale-nodes",
        metavar="N,N,…",
        type=node_counts,
        default=[],
        help="Without --scale-workers: run the multi-node drain phase, at each count N, N "
        "plain Celery nodes against N WorkManager nodes (each of --concurrency processes) "
        "draining --drain-events queued events, --scale-repeats times: throughput and scaling "
        "efficiency. With --scale-workers: the nodes of the scale phase (the largest count; "
        f"{SCALE_NODES} if none is given).",
    )
    parser.add_argument(
        "--scale-deliveries",
        metavar="K",
        type=int,
        default=5,
        help="Deliveries per worker in each throughput run of the scale phase.",
    )
    parser.add_argument(
        "--scale-repeats",
        metavar="R",
        type=int,
        default=2,
        help="Interleaved throughput runs per side of the scale phase.",
    )


def _add_broker_phases(parser: argparse.ArgumentParser) -> None:
    """The drain and round-trip phases, then the broker the phases after the first run on."""
    parser.add_argument(
        "--drain-repeats",
        metavar="R",
        type=int,
        default=0,
        help="Also run the drain phase (queues filled first, then timed), this many "
        "interleaved repetitions (0 skips it).",
    )
    parser.add_argument(
        "--drain-events",
        metavar="N",
        type=int,
        default=2000,
        help="Queued events per scenario of the drain and multi-node phases.",
    )
    parser.add_argument(
        "--round-trips",
        metavar="N",
        type=int,
        default=0,
        help="Also run the round-trip phase (one event at a time, publish → answer): this "
        "many round trips per side in each block (0 skips it).",
    )
    parser.add_argument(
        "--round-trip-repeats",
        metavar="R",
        type=int,
        default=3,
        help="Interleaved blocks per side of the round-trip phase.",
    )
    _add_broker(parser)


def _add_broker(parser: argparse.ArgumentParser) -> None:
    """Where the drain, round-trip, scale and pool phases run, and with what task events."""
    parser.add_argument(
        "--drain-task-events",
        action="store_true",
        help="Run the drain, round-trip, scale and pool phases with Celery task events on "
        "(off by default, as on a node).",
    )
    parser.add_argument(
        "--broker",
        choices=BROKERS,
        default="redis",
        help="The broker of the drain, round-trip, scale and pool phases: the embedded Redis, "
        "or RabbitMQ (the state store stays on the embedded Redis).",
    )
    parser.add_argument(
        "--broker-url",
        metavar="URL",
        help=f"RabbitMQ for --broker amqp (default {DEFAULT_AMQP_URL}); the bench's queues "
        "and exchanges there are its own and deleted when it ends.",
    )


def _multi_node(args: argparse.Namespace) -> bool:
    """The multi-node drain runs on ``--scale-nodes`` unless they are the scale phase's."""
    return bool(args.scale_nodes) and not args.scale_workers


def node_counts(text: str) -> list[int]:
    """``--scale-nodes``: counts of nodes, ascending, each 1 or more."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no list of node counts such as 1,2,4,8")
    return sorted(set(counts))


def _broker_phases(
    settings: Settings, home: Path, args: argparse.Namespace, begin: Begin
) -> dict[str, Any]:
    """The drain and round-trip phases, on the broker ``--broker`` names; the drain's
    figures."""
    found: dict[str, Any] = {}
    if not (args.drain_repeats or args.round_trips):
        return found
    settings = settings.replace(task_events=args.drain_task_events)
    if args.broker == "amqp":
        settings = settings.replace(broker_url=args.broker_url)
    # the .NET example answers to its fixed type ``orders.done``, not a topic of the bench's
    engines = [e for e in _engine_workers(args, answering=True) if e.processed]
    if args.drain_repeats:
        begin("drain phase")
        found["drain"] = drain.run(
            settings, home, args.drain_events, args.drain_repeats, args.concurrency, engines
        )
    if args.round_trips:
        begin("round-trip phase")
        roundtrip.run(
            settings, home, args.round_trips, args.round_trip_repeats, args.concurrency, engines
        )
    return found


def _multi_node_phase(
    settings: Settings, home: Path, args: argparse.Namespace, begin: Begin
) -> dict[str, Any]:
    """The multi-node drain, on the broker ``--broker`` names."""
    if args.broker == "amqp":
        settings = settings.replace(broker_url=args.broker_url)
    begin("multi-node phase")
    return multinode.run(
        settings.replace(task_events=args.drain_task_events),
        home,
        args.scale_nodes,
        args.drain_events,
        args.scale_repeats,
        args.concurrency,
    )


def _pools_phase(settings: Settings, home: Path, args: argparse.Namespace, begin: Begin) -> None:
    """The pool phase, on the broker ``--broker`` names."""
    if not args.pools:
        return
    if args.broker == "amqp":
        settings = settings.replace(broker_url=args.broker_url)
    begin("pool phase")
    pools.run(
        settings.replace(task_events=args.drain_task_events), home, args.pools, args.pool_repeats
    )


def _scale_phase(settings: Settings, home: Path, args: argparse.Namespace, begin: Begin) -> None:
    """The scale phase, on the broker ``--broker`` names."""
    if not args.scale_workers:
        return
    if args.broker == "amqp":
        settings = settings.replace(broker_url=args.broker_url)
    begin("scale phase")
    scale.run(
        settings.replace(task_events=args.drain_task_events),
        home,
        args.scale_workers,
        args.scale_topics,
        max(args.scale_nodes, default=SCALE_NODES),
        args.scale_deliveries,
        args.scale_repeats,
        args.concurrency,
    )


def _check_rabbitmq(url: str) -> None:
    """Refuse to start unless RabbitMQ answers at ``url``."""
    try:
        with Connection(url, connect_timeout=5) as connection:
            connection.ensure_connection(max_retries=1)
    except BROKER_ERRORS as exc:
        raise BrokerUnavailable(
            f"RabbitMQ at --broker-url {masked(url)} is unreachable ({exc}); start "
            "it or pass another --broker-url"
        ) from exc


def _task_event_phase(
    settings: Settings, home: Path, args: argparse.Namespace, begin: Begin
) -> dict[str, Any]:
    """The first phase, printed; its figures for the JSON answer."""
    engines = _engine_workers(args, answering=False)
    return taskevents.run(
        settings, home, args.events, args.concurrency, args.timeout_s, engines, begin
    )


def _dotnet_workers(args: argparse.Namespace) -> list[tuple[str, Path]]:
    return [
        (mime_type, path)
        for mime_type, path in ((DOTNET_DLL, args.dotnet_package), (CSHARP, args.csharp_file))
        if path is not None
    ]


def _engine_workers(args: argparse.Namespace, *, answering: bool) -> list[EngineWorker]:
    """The workers on real engines: a sandboxed Python worker (in the task-event phase one
    that returns nothing, as measured there since the start; in the drain and round-trip
    phases one answering each event, like the others), and the native and .NET workers the
    options name."""
    python = PYTHON_ANSWER if answering else b"def process(event):\n    return None\n"
    workers = [EngineWorker("python worker", "python", PYTHON, python)]
    if args.native_zip:
        workers.append(
            EngineWorker("native worker", "native", NATIVE, args.native_zip.read_bytes())
        )
    for mime_type, path in _dotnet_workers(args):
        name = ".NET dll worker" if mime_type == DOTNET_DLL else "C# worker"
        suffix = mime_type.split("-")[-1]
        workers.append(EngineWorker(name, suffix, mime_type, path.read_bytes(), processed=False))
    return workers
