"""The ``wm`` command line: operate workers, events and dead letters from a shell.

Tables for people by default, ``--json`` (before or after the command) for scripts. An
expected failure prints one line ``wm: error: …`` and exits 1, a usage error exits 2, and no
traceback is shown for either. Logging is configured here, once; library code adds no handlers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from wm.cli import access, admin, deadletters, messaging, schedules, workers
from wm.cli.arguments import Handler, UsageError
from wm.cli.output import Context
from wm.config import Settings
from wm.errors import ConfigurationError, WorkManagerError

__all__ = ["build_parser", "main"]

#: Exit codes: an expected failure, and an interrupted command (128 + SIGINT).
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_OWN_LOGGERS = ("wm", "engines")


def build_parser() -> argparse.ArgumentParser:
    # Every parser accepts --json; SUPPRESS keeps a sub-parser from resetting the global one.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for scripts"
    )
    parser = argparse.ArgumentParser(
        prog="wm",
        description="Operate WorkManager: workers, events, dead letters.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (workers, schedules, messaging, deadletters, admin, access):
        module.register(commands, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the process exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_FAILURE
    try:
        return _run(args)
    except UsageError as exc:
        return _usage_error(args.command_parser, exc)
    except WorkManagerError as exc:
        return _fail(str(exc) or type(exc).__name__)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``wm worker list | head``): quiet, like other shell tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


def _run(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    _configure_logging(settings)
    handler: Handler = args.handler
    return handler(Context(settings, as_json=args.json), args)


def _configure_logging(settings: Settings) -> None:
    """WM_LOG_LEVEL sets WorkManager's own loggers; other libraries (Celery, kombu, Alembic)
    speak only from WARNING, unless the level is DEBUG."""
    level = settings.log_level.upper()
    if level not in _LOG_LEVELS:
        raise ConfigurationError(
            f"WM_LOG_LEVEL={settings.log_level!r} is malformed: expected one of "
            f"{', '.join(_LOG_LEVELS)}"
        )
    own: int = logging.getLevelName(level)
    others = own if level == "DEBUG" else max(own, logging.WARNING)
    logging.basicConfig(level=others, format=_LOG_FORMAT, stream=sys.stderr)
    for name in _OWN_LOGGERS:
        logging.getLogger(name).setLevel(own)


def _usage_error(parser: argparse.ArgumentParser, exc: UsageError) -> int:
    try:
        parser.error(str(exc))
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_FAILURE
    return EXIT_FAILURE


def _fail(message: str) -> int:
    print(f"wm: error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_FAILURE
