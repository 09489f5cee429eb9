"""The README's command reference, generated from the real ``--help`` of every command.

``python -m wm.cli.reference README.md`` rewrites the part of the README between the two
markers below; ``tests/test_readme.py`` fails when that part differs from what this renders,
so the documentation cannot drift from the command line.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click

from wm.cli import cli

BEGIN = "<!-- wm-help:begin (python -m wm.cli.reference README.md) -->"
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
    """The reference as Markdown: one folded block per command, in the order ``--help``
    lists them."""
    parts = [BEGIN, ""]
    for name, text in _commands(cli, ("wm",), None):
        parts += [
            f"<details><summary><code>{name}</code></summary>",
            "",
            "```text",
            text.rstrip(),
            "```",
            "",
            "</details>",
            "",
        ]
    parts.append(END)
    return "\n".join(parts)


def replace(readme: str) -> str:
    """``readme`` with its reference part rendered anew."""
    head, found, rest = readme.partition(BEGIN)
    if not found or END not in rest:
        raise SystemExit(f"the README has no {BEGIN!r} … {END!r} part")
    return head + render() + rest.split(END, 1)[1]


def main(argv: list[str]) -> int:
    """Render the reference into the README named by ``argv`` (default ``README.md``)."""
    path = Path(argv[0] if argv else "README.md")
    path.write_text(replace(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
