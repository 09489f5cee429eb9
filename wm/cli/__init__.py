"""The ``wm`` command line: operate workers, events and dead letters from a shell.

Built on click, with rich for tables and progress. Tables for people by default, ``--json``
(before or after the command) for scripts. An expected failure -- an error of ``wm.errors``,
a broker, Redis or database that cannot be reached included (the layers below translate their
libraries' errors) -- prints one line ``wm: error: …`` and exits with its group's code, a usage
error exits 2, and no traceback is shown for either. Each command's module is imported only when
that command runs (``wm --help`` imports none), and the API behind it on first use. Logging is
configured here, once; library code adds no handlers.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence

import click

from wm.cli.arguments import CONTEXT_SETTINGS, Group
from wm.errors import (
    Conflict,
    DeliveryFailed,
    Misconfigured,
    NotFound,
    Refused,
    Unavailable,
    WorkManagerError,
)

__all__ = ["COMMANDS", "cli", "main"]

#: Exit codes: an expected failure, and an interrupted command (128 + SIGINT).
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
#: Exit code of each group of errors (``wm.errors.GROUPS``); click's usage errors exit 2.
EXIT_CODES: dict[type[WorkManagerError], int] = {
    NotFound: EXIT_FAILURE,
    Conflict: EXIT_FAILURE,
    Refused: EXIT_FAILURE,
    Unavailable: EXIT_FAILURE,
    Misconfigured: EXIT_FAILURE,
    DeliveryFailed: EXIT_FAILURE,
}

#: Every top-level command: its module and object, and the one-line help ``wm --help`` shows
#: without importing the module (the first line of the command's own help: a test checks).
COMMANDS: dict[str, tuple[str, str]] = {
    "status": (
        "wm.cli.status:status",
        "One screen: nodes, workers by state, queues, dead letters, breakers.",
    ),
    "worker": ("wm.cli.workers:worker", "Create and operate workers."),
    "schedule": (
        "wm.cli.schedules:schedule",
        "Send events to a worker on a schedule (celery beat).",
    ),
    "publish": ("wm.cli.messaging:publish", "Publish a CloudEvent (or a file of them) to a topic."),
    "tail": ("wm.cli.tail:tail", "Print a topic's events as they arrive (Ctrl-C stops)."),
    "subscribe": (
        "wm.cli.messaging:subscribe",
        "Feed a topic into a named durable queue any kombu client can read.",
    ),
    "unsubscribe": ("wm.cli.messaging:unsubscribe", "Remove a plain subscription and its queue."),
    "consume": (
        "wm.cli.messaging:consume",
        "Read a plain subscription's messages, oldest first (--peek: leave them queued).",
    ),
    "subscriptions": (
        "wm.cli.messaging:subscriptions",
        "List subscriptions (workers' and plain) with their queue depth.",
    ),
    "dlq": ("wm.cli.deadletters:dlq", "Inspect, replay and purge dead letters."),
    "db": ("wm.cli.admin:db", "Migrate the worker store (WM_DATABASE_URL)."),
    "config": (
        "wm.cli.admin:config",
        "Print every setting: variable, default, current value, meaning.",
    ),
    "up": (
        "wm.cli.admin:up",
        "Run the whole stack embedded on this machine (Redis, SQLite, nodes).",
    ),
    "recover": (
        "wm.cli.admin:recover",
        "Run recovery now: routes, queues, workers' code, the outbox.",
    ),
    "health": (
        "wm.cli.admin:health",
        "A node's health: exit 0 healthy, 1 degraded, 2 unhealthy, 3 unknown (no answer).",
    ),
    "bench": (
        "wm.cli.admin:bench",
        "Run the benchmarks (wm bench --help shows their options).",
    ),
    "api": ("wm.cli.access:api", "Serve the admin HTTP API until Ctrl-C (needs the [api] extra)."),
    "tenant": ("wm.cli.tenants:tenant", "Create, list and delete tenants, and set their limits."),
    "session": (
        "wm.cli.sessions:session",
        "Show or end a session's binding to an engine instance.",
    ),
    "token": ("wm.cli.access:token", "Create, list and revoke admin API tokens."),
    "audit": ("wm.cli.access:audit", "The admin API's mutating calls, newest last."),
    "completion": (
        "wm.cli.admin:completion",
        "Print the shell completion script (SHELL: default the one $SHELL names, else bash).",
    ),
}


class LazyGroup(Group):
    """The root: a command's module is imported when that command is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, _, attribute = COMMANDS[cmd_name][0].partition(":")
        command: click.Command = getattr(importlib.import_module(module), attribute)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help) for name, (_, help) in COMMANDS.items()])


@click.group(
    cls=LazyGroup,
    context_settings=CONTEXT_SETTINGS,
    epilog="Run 'wm COMMAND -h' for a command's options. Settings come from WM_* variables: "
    "wm config lists them.",
)
@click.version_option(package_name="workmanager", prog_name="wm", message="%(prog)s %(version)s")
def cli() -> None:
    """Operate WorkManager: workers, events, dead letters."""
    _configure_logging()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the process exit code."""
    from wm.cli.output import Output

    output = Output()
    try:
        # Not standalone: click returns an --help's or Exit's code, and prints and ends a
        # run whose standard output closed (``wm worker list | head``) itself.
        code = cli.main(
            args=list(argv) if argv is not None else None,
            prog_name="wm",
            standalone_mode=False,
            obj=output,
        )
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except (KeyboardInterrupt, click.Abort):
        return EXIT_INTERRUPTED
    except WorkManagerError as exc:
        return _fail(exc)
    return code if isinstance(code, int) else 0


#: Loggers of the probes of this host's sandbox and process limits.
HOST_PROBES = ("engines.python.isolation", "engines.childproc.limits")


def _configure_logging() -> None:
    from wm.cli.arguments import output_of
    from wm.ops.logs import configure, level_of

    settings = output_of(click.get_current_context()).settings
    configure(settings)
    # What this host's sandbox lacks (no cgroup as a user, say) is the nodes' concern and
    # their logs say it at start; a command that checks code in the sandbox would repeat it
    # on every call, unless asked for INFO or DEBUG.
    quiet = level_of(settings) > logging.INFO
    for name in HOST_PROBES:
        logging.getLogger(name).setLevel(logging.ERROR if quiet else logging.NOTSET)


def _fail(exc: WorkManagerError) -> int:
    """Print the error, and the notes a command added to it, on one line; its group's exit
    code."""
    message = " ".join(
        [str(exc) or type(exc).__name__, *(f"({n})" for n in getattr(exc, "__notes__", ()))]
    )
    print(f"wm: error: {' '.join(message.split())}", file=sys.stderr)
    own: int | None = getattr(exc, "exit_code", None)  # a command's own (wm health: 3)
    if own is not None:
        return own
    return next(
        (code for group, code in EXIT_CODES.items() if isinstance(exc, group)), EXIT_FAILURE
    )
