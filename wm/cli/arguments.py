"""How a command is registered, and the argument types and inputs several commands share."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from wm.errors import InvalidArgument

if TYPE_CHECKING:
    from wm.cli.output import Context

    #: The sub-command list of a parser, where commands are added.
    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

#: A command's handler: it gets the context and the parsed arguments, returns the exit code.
Handler = Callable[["Context", argparse.Namespace], int]


class UsageError(InvalidArgument):
    """Raised by a handler when arguments conflict in a way argparse cannot express.

    Reported like argparse's own usage errors: the command's usage, one line, exit code 2.
    """


def add_command(
    commands: Commands, name: str, handler: Handler, common: argparse.ArgumentParser, help: str
) -> argparse.ArgumentParser:
    """Add a leaf command; the parser records its handler (the dispatch table) and itself."""
    parser = commands.add_parser(name, parents=[common], help=help, description=help)
    parser.set_defaults(handler=handler, command_parser=parser)
    return parser


def add_group(
    commands: Commands, name: str, common: argparse.ArgumentParser, help: str
) -> Commands:
    """Add a command that only groups sub-commands (``wm worker …``, ``wm dlq …``)."""
    parser = commands.add_parser(name, parents=[common], help=help, description=help)
    return parser.add_subparsers(dest="action", required=True, metavar="ACTION")


def key_value(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``--setting`` and ``--extension``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def number_or_text(value: str) -> Any:
    """A JSON number when ``value`` is one (``3``, ``2.5``), otherwise the text itself."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if isinstance(parsed, int | float) and not isinstance(parsed, bool) else value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def read_bytes(path: str) -> bytes:
    """The content of ``path``, or of standard input for ``-``."""
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror or exc}") from exc


def read_json(path: str, what: str) -> Any:
    """JSON read from ``path`` (``-`` = standard input); ``what`` names it in the error."""
    return parse_json(read_bytes(path), what)


def parse_json(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from exc
