"""How commands are declared on click, and the argument types and inputs several commands share.

Every command and group made through :class:`Group` accepts ``--json`` (so it works before or
after the command's name) and gets the :class:`~wm.cli.output.Output` through
:func:`pass_output`. Modules of this package import only click and light parts of ``wm`` at
their top: a command's module loads before it runs, and completion loads them all.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from wm.errors import InvalidArgument

if TYPE_CHECKING:
    from wm.cli.output import Output

F = TypeVar("F", bound=Callable[..., Any])

#: What every command's help shows: defaults, ``-h``, and text up to 100 columns wide.
CONTEXT_SETTINGS: dict[str, Any] = {
    "show_default": True,
    "help_option_names": ["-h", "--help"],
    "max_content_width": 100,
}

#: Raised by a command when arguments conflict in a way the option types cannot express:
#: reported with the command's usage, exit code 2.
UsageError = click.UsageError


def output_of(ctx: click.Context) -> Output:
    """The run's :class:`~wm.cli.output.Output`, kept on the root context (made there when
    ``cli`` is invoked without ``main``, as click's test runner does)."""
    from wm.cli.output import Output

    root = ctx.find_root()
    if not isinstance(root.obj, Output):
        root.obj = Output()
    return root.obj


def _set_json(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        output_of(ctx).as_json = True


def json_option() -> click.Option:
    """``--json``, which every command takes, before or after its name."""
    return click.Option(
        ["--json"],
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_set_json,
        help="Print JSON for scripts (the Python API's fields).",
    )


def _set_format(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        output = output_of(ctx)
        output.as_json = value != "table"
        output.as_yaml = value == "yaml"


def format_option() -> click.Option:
    """``-o json|yaml|table``, which every command takes, before or after its name
    (``--json`` is ``-o json``; YAML holds the same fields as JSON)."""
    return click.Option(
        ["-o", "--output"],
        type=click.Choice(["table", "json", "yaml"]),
        metavar="FORMAT",
        expose_value=False,
        is_eager=True,
        callback=_set_format,
        help="table (for people), json or yaml (for scripts: the Python API's fields). "
        "[default: table]",
    )


def _set_tenant(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        output_of(ctx).tenant = value


def tenant_option() -> click.Option:
    """``--tenant NAME``, which every command takes, before or after its name."""
    return click.Option(
        ["--tenant"],
        metavar="NAME",
        expose_value=False,
        is_eager=True,
        callback=_set_tenant,
        help="Work in this tenant. [default: $WM_TENANT, default]",
    )


class Command(click.Command):
    """A leaf command; it accepts ``--json``, ``-o`` and ``--tenant``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params += [json_option(), format_option(), tenant_option()]


class Group(click.Group):
    """A group whose commands and sub-groups accept ``--json``, ``-o`` and ``--tenant``, listed in
    the order declared."""

    command_class = Command

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params += [json_option(), format_option(), tenant_option()]

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


Group.group_class = Group


def pass_output(function: F) -> F:
    """Hand the command the :class:`~wm.cli.output.Output` of this run as first argument."""
    from functools import update_wrapper

    def run(*args: Any, **kwargs: Any) -> Any:
        return function(output_of(click.get_current_context()), *args, **kwargs)

    return update_wrapper(run, function)  # type: ignore[return-value]


class KeyValue(click.ParamType[tuple[str, str]]):
    """``KEY=VALUE`` of ``--setting`` and ``--extension``."""

    name = "KEY=VALUE"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, str]:
        if isinstance(value, tuple):
            return (str(value[0]), str(value[1]))
        key, sep, text = str(value).partition("=")
        if not sep or not key.strip():
            self.fail(f"expected KEY=VALUE, got {value!r}", param, ctx)
        return key.strip(), text


KEY_VALUE = KeyValue()
POSITIVE_INT = click.IntRange(min=1)
POSITIVE_FLOAT = click.FloatRange(min=0, min_open=True)
NON_NEGATIVE_FLOAT = click.FloatRange(min=0)


def number_or_text(value: str) -> Any:
    """A JSON number or boolean when ``value`` is one (``3``, ``2.5``, ``true``), otherwise
    the text itself."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if isinstance(parsed, int | float) else value


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


def iso_time(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    """An option's ISO 8601 time (``2026-11-24``, ``2026-11-24T09:00:00+01:00``), read as
    :meth:`datetime.fromisoformat` reads it."""
    if value is None:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an ISO 8601 time (e.g. 2026-11-24T09:00:00+00:00)"
        ) from None
