"""What a command works with: the settings, the API objects, and output in the chosen format.

For people: rich tables that fit the terminal and wrap long cells, ``key: value`` blocks,
progress bars on a terminal, colour only on a terminal (and never with ``NO_COLOR``). For
scripts (``--json``): JSON with the Python API's fields, times in RFC 3339 with their zone,
nested JSON as JSON. The API objects and rich are imported on first use, so a command that
fails early, or prints help, starts fast.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from wm.cli.remote import ApiReader, Reader
    from wm.config import Settings
    from wm.manager import WorkManager

#: Width a table is laid out to when standard output is not a terminal, whatever ``COLUMNS``
#: says (a shell or CI may export it): wide enough that every row, its error text whole,
#: stays on one line for ``grep`` and ``awk``.
PIPE_WIDTH = 1000
#: Narrowest an identifier column gets on a small terminal: a short id (12 characters) stays whole.
MIN_ID_CHARS = 12
#: Narrowest a column of free text (an error, a reason) gets, and any other column.
MIN_WRAP_CHARS = 16
MIN_CELL_CHARS = 6
#: Spaces between two table columns (rich's padding, one on each side), plus one for the
#: invisible column rule of a table with a header rule.
COLUMN_GAP = 2
#: Spaces at the end of a line, before any closing ANSI style codes.
_TRAILING_SPACE = re.compile(r" +((?:\x1b\[[0-9;]*m)*)$")


class Output:
    """Made once per command run; the settings and API objects are made on first use."""

    def __init__(self, *, as_json: bool = False, settings: Settings | None = None) -> None:
        self.as_json = as_json
        #: ``-o yaml``: what ``--json`` prints, as YAML.
        self.as_yaml = False
        #: ``--tenant``; None: WM_TENANT.
        self.tenant: str | None = None
        if settings is not None:
            self.settings = settings

    @cached_property
    def settings(self) -> Settings:
        from wm.config import Settings

        return Settings.from_env()

    @cached_property
    def store_settings(self) -> Settings:
        """The settings of a command that works on the database, broker and Redis itself.
        With ``WM_API_URL`` set it needs ``WM_DATABASE_URL`` too: without it, it would read
        or change an empty local store instead of the deployment the API shows."""
        from wm.config import given
        from wm.errors import ConfigurationError

        if self.settings.api_url and not given("WM_DATABASE_URL"):
            raise ConfigurationError(
                f"this command does not go through the admin API (WM_API_URL="
                f"{self.settings.api_url}): it works on the deployment's database itself, and "
                "WM_DATABASE_URL is not set. Set WM_DATABASE_URL (WM_BROKER_URL, WM_REDIS_URL) "
                "to the deployment's, or run it where they are set"
            )
        return self.settings

    @cached_property
    def manager(self) -> WorkManager:
        """The facade on the database, broker and Redis (:attr:`store_settings`)."""
        from wm.manager import WorkManager

        return WorkManager(self.store_settings, actor="cli", tenant=self.tenant)

    @cached_property
    def remote(self) -> ApiReader | None:
        """The admin API when ``WM_API_URL`` is set (``wm.cli.remote``), else None."""
        if not self.settings.api_url:
            return None
        from wm.cli.remote import ApiReader

        return ApiReader(self.settings, self.tenant)

    @property
    def reader(self) -> Reader:
        """What the read commands ask: :attr:`remote`, else :attr:`manager`."""
        return self.remote or self.manager

    # -- consoles ----------------------------------------------------------------------------

    @cached_property
    def console(self) -> Console:
        from rich.console import Console

        tty = sys.stdout.isatty()
        width = None if tty else PIPE_WIDTH
        # No markup: a cell is the operator's data, and ``[/x]`` in an error is no style tag.
        return Console(width=width, markup=False, highlight=False, soft_wrap=False, emoji=False)

    @cached_property
    def err_console(self) -> Console:
        from rich.console import Console

        return Console(stderr=True, markup=False, highlight=False, emoji=False)

    @property
    def interactive(self) -> bool:
        """Progress and live views only for a person at a terminal, not with ``--json``."""
        return not self.as_json and sys.stderr.isatty()

    # -- output ------------------------------------------------------------------------------

    def json(self, value: Any) -> None:
        """``value`` as indented JSON on standard output (``--json``), or as YAML
        (``-o yaml``: the same fields, through JSON's conversions)."""
        text = json.dumps(value, indent=2, default=jsonable, ensure_ascii=False)
        if self.as_yaml:
            import yaml

            text = yaml.safe_dump(json.loads(text), sort_keys=False, allow_unicode=True).rstrip()
        self.line(text)

    def line(self, text: str = "") -> None:
        """One line of text on standard output, as it is (no markup, no wrapping)."""
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def note(self, text: str) -> None:
        """A remark for the person, on standard error: never mixed into the output."""
        self.err_console.print(text, style="dim")

    def raw(self, data: bytes) -> None:
        """Bytes on standard output unchanged (``wm worker code``)."""
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    def table(
        self,
        headers: Sequence[str],
        rows: Iterable[Sequence[Any]],
        *,
        empty: str,
        wrap: Sequence[str] = (),
    ) -> None:
        """A table as wide as the terminal: the columns in ``wrap`` (and the last one) wrap
        their long cells, the others keep one line and are cut with ``…`` only when the
        terminal is too narrow. ``empty`` is printed instead of no rows."""
        cells = [[cell(value) for value in row] for row in rows]
        if not cells:
            self.line(empty)
            return
        if self._plain_table([list(headers), *cells]):
            return
        wraps = [header in wrap or i == len(headers) - 1 for i, header in enumerate(headers)]
        self.show(self._rich_table(headers, cells, wraps))

    def _plain_table(self, rows: list[list[str]]) -> bool:
        """Print ``rows`` (the headers first) as rich lays them out for a pipe -- no style, no
        rule, each column as wide as its widest cell, two spaces apart -- without rich's
        layout, which takes a while for a few hundred rows; False (nothing printed) at a
        terminal, with colour forced, or when a cell or the row is more than one plain
        line: rich lays those out."""
        console = self.console
        if console.is_terminal or console.color_system is not None:
            return False
        if not all(text.isprintable() for row in rows for text in row):
            return False
        widths = [max(map(_width, column)) for column in zip(*rows, strict=True)]
        if sum(widths) + COLUMN_GAP * (len(widths) - 1) > console.width:
            return False
        for row in rows:
            padded = (
                text + " " * (width - _width(text)) for text, width in zip(row, widths, strict=True)
            )
            self.line((" " * COLUMN_GAP).join(padded).rstrip(" "))
        return True

    def _rich_table(self, headers: Sequence[str], cells: list[list[str]], wraps: list[bool]) -> Any:
        from rich import box
        from rich.table import Table

        # A rule under the header on a terminal; plain columns for grep and awk.
        boxed = self.console.is_terminal
        widths = column_widths(
            [max(map(_width, column)) for column in zip(headers, *cells, strict=True)],
            [_floor(header, wrapping) for header, wrapping in zip(headers, wraps, strict=True)],
            wraps,
            self.console.width - (COLUMN_GAP + boxed) * (len(headers) - 1),
        ) or [None] * len(headers)
        table = Table(
            box=box.SIMPLE_HEAD if boxed else None,
            show_edge=False,
            pad_edge=False,
            header_style="bold",
        )
        for header, wrapping, width in zip(headers, wraps, widths, strict=True):
            table.add_column(
                header,
                width=width,
                no_wrap=not wrapping,
                overflow="fold" if wrapping else "ellipsis",
            )
        for row in cells:
            table.add_row(*row)
        return table

    def fields(self, pairs: Sequence[tuple[str, Any]]) -> None:
        """One ``key: value`` line per pair, values aligned and wrapped; nested values as JSON."""
        from rich.table import Table

        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(overflow="fold")
        for key, value in pairs:
            shown = json.dumps(value, default=jsonable) if isinstance(value, dict | list) else value
            grid.add_row(f"{key}:", cell(shown))
        self.show(grid)

    def show(self, renderable: Any) -> None:
        """Print a rich renderable without the spaces rich pads lines to its full width."""
        with self.console.capture() as captured:
            self.console.print(renderable)
        for text in captured.get().splitlines():
            self.line(_TRAILING_SPACE.sub(r"\1", text))

    @contextlib.contextmanager
    def progress(self, what: str, total: int | None) -> Iterator[Callable[[int], None]]:
        """A progress bar on standard error at a terminal (nothing otherwise); yields the
        function that advances it."""
        if not self.interactive:
            yield lambda advance: None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.err_console,
            transient=False,
        ) as bar:
            task = bar.add_task(what, total=total)
            yield lambda advance: bar.advance(task, advance)


def _floor(header: str, wrapping: bool) -> int:
    """The narrowest a column gets when the terminal is too narrow for every column whole."""
    if wrapping:
        return MIN_WRAP_CHARS
    return max(len(header), MIN_ID_CHARS if header.endswith("ID") else MIN_CELL_CHARS)


def _width(text: str) -> int:
    """Columns ``text`` takes on a terminal: its widest line, a wide character as two."""
    from rich.cells import cell_len

    return max((cell_len(line) for line in text.splitlines()), default=0)


def column_widths(
    natural: Sequence[int], floors: Sequence[int], wraps: Sequence[bool], room: int
) -> list[int | None] | None:
    """Each column's width in ``room``: its widest cell when they all fit. Otherwise each
    starts at its floor, the columns that keep one line (ids, names, states) grow first to
    their widest cell, and what is left goes to the wrapping ones in proportion to what they
    lack. None when not even the floors fit (rich then squeezes the table as best it can).

    rich's own layout shrinks the wrapping columns first, to nothing if need be: the error
    text an operator looks for would vanish before an id is cut.
    """
    if sum(natural) <= room:
        return [None] * len(natural)
    widths = [min(f, n) for f, n in zip(floors, natural, strict=True)]
    spare = room - sum(widths)
    if spare < 0:
        return None
    for wrapping in (False, True):
        wanted = [
            n - w if wrap == wrapping else 0
            for n, w, wrap in zip(natural, widths, wraps, strict=True)
        ]
        total = sum(wanted)
        if not total:
            continue
        share = min(spare, total)
        given = [want * share // total for want in wanted]
        # the rounding's remainder to the last column that wants more
        given[max(i for i, want in enumerate(wanted) if want)] += share - sum(given)
        widths = [w + g for w, g in zip(widths, given, strict=True)]
        spare -= share
    return list(widths)


#: From how many seconds on a duration is shown in whole minutes.
SHOW_MINUTES_FROM_S = 120


def duration(seconds: float) -> str:
    """``850 ms``, ``12.3 s``, ``4 min``: how long, for people."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s" if seconds < SHOW_MINUTES_FROM_S else f"{seconds // 60:.0f} min"


#: How a time is shown to people: UTC, to the second.
TIME_FORMAT = "%Y-%m-%d %H:%M:%SZ"


def cell(value: Any) -> str:
    """A value as a table cell: ``-`` for nothing, times in UTC to the second."""
    if value is None or value == "":
        return "-"
    if isinstance(value, datetime):
        from wm.views import aware

        return aware(value).astimezone(UTC).strftime(TIME_FORMAT)
    return str(value)


def jsonable(value: Any) -> Any:
    """``json.dumps``' fallback: an API object by its ``to_json()``, times in RFC 3339 with
    their zone, ids as text."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, datetime | uuid.UUID):
        from wm.views import jsonable as to_jsonable

        return to_jsonable(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def unavailable(service: str, missing: Mapping[str, str]) -> str | None:
    """``unavailable (redis)`` for a part that needs a service that did not answer (the
    reason is shown once, at the end: :func:`unavailable_reasons`)."""
    return f"unavailable ({service})" if service in missing else None


def unavailable_reasons(missing: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(redis unavailable, <why>)`` fields, one per service that did not answer."""
    return [(f"{service} unavailable", why) for service, why in missing.items()]


def labelled(identifier: Any, name: str | None) -> str:
    """``name (3f2a…)`` when a name is known, else the id itself: how tables show a worker."""
    if identifier is None:
        return "-"
    return f"{name} ({identifier})" if name else str(identifier)
