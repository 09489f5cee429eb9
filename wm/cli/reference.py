"""The documentation's command reference, generated from the real ``--help`` of every command.

``python -m wm.cli.reference docs/reference/cli.md`` (the default file) rewrites the part of
that page between the two markers below; ``tests/test_readme.py`` fails when that part differs
from what this renders, so the documentation cannot drift from the command line.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click

from wm.cli import cli

#: The page the reference lives in, from the root of the clone.
PAGE = "docs/reference/cli.md"
BEGIN = f"<!-- wm-help:begin (python -m wm.cli.reference {PAGE}) -->"
END = "<!-- wm-help:end -->"
#: Columns the help is laid out to, whatever the terminal that renders it.
WIDTH = 100


def _commands(
    command: click.Command, path: tuple[str, ...], parent: click.Context | None
) -> Iterator[tuple[str, str]]:
    """(``wm worker create``, its help text) for ``command`` and everything under it."""
    # As the command line makes it (its context settings: defaults shown, ``-h``), without
    # parsing anything.
    ctx = command.make_context(
        path[-1], [], parent=parent, resilient_parsing=True, terminal_width=WIDTH
    )
    yield " ".join(path), command.get_help(ctx)
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            child = command.get_command(ctx, name)
            if child is not None and not child.hidden:
                yield from _commands(child, (*path, name), ctx)


def render() -> str:
    """The reference as Markdown: a heading and a block per command, in the order ``--help``
    lists them (the heading's anchor is the command: ``#wm-worker-create``)."""
    parts = [BEGIN, ""]
    for name, text in _commands(cli, ("wm",), None):
        parts += [f"## `{name}`", "", "```text", text.rstrip(), "```", ""]
    parts.append(END)
    return "\n".join(parts)


def replace(page: str) -> str:
    """``page`` with its reference part rendered anew."""
    head, found, rest = page.partition(BEGIN)
    if not found or END not in rest:
        raise SystemExit(f"the page has no {BEGIN!r} … {END!r} part")
    return head + render() + rest.split(END, 1)[1]


def main(argv: list[str]) -> int:
    """Render the reference into the page named by ``argv`` (default :data:`PAGE`)."""
    path = Path(argv[0] if argv else PAGE)
    path.write_text(replace(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
