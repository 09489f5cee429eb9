"""What a handler works with: the settings, the API objects, and output in the chosen format --
aligned tables and ``key: value`` blocks for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

from wm.config import Settings
from wm.dataplane.deadletters import DeadLetters
from wm.manager import WorkManager

#: Widest a table cell is printed, in characters (a SHA-256 fits); ``--json`` shows all.
MAX_CELL_CHARS = 64
#: Spaces between table columns.
COLUMN_GAP = 2


class Context:
    """Built once per command, after the settings loaded; API objects are made on first use."""

    def __init__(self, settings: Settings, *, as_json: bool) -> None:
        self.settings = settings
        self.as_json = as_json

    @cached_property
    def manager(self) -> WorkManager:
        return WorkManager(self.settings, actor="cli")

    @cached_property
    def dead_letters(self) -> DeadLetters:
        return DeadLetters(self.settings, self.manager.bus)

    def json(self, value: Any) -> None:
        self.line(json.dumps(value, indent=2))

    def line(self, text: str = "") -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def raw(self, data: bytes) -> None:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    def table(
        self,
        headers: Sequence[str],
        rows: Iterable[Sequence[Any]],
        *,
        empty: str,
        limit: int = MAX_CELL_CHARS,
    ) -> None:
        """Columns aligned to their widest cell, each cut at ``limit`` but the last (free text);
        ``empty`` is printed instead of no rows."""
        cells = [
            [*(cell(v, limit=limit) for v in row[:-1]), cell(row[-1], limit=None)] for row in rows
        ]
        if not cells:
            self.line(empty)
            return
        lines = [list(headers), *cells]
        widths = [max(map(len, column)) + COLUMN_GAP for column in zip(*lines, strict=True)]
        for row in lines:
            self.line("".join(text.ljust(w) for text, w in zip(row, widths, strict=True)).rstrip())

    def fields(self, pairs: Sequence[tuple[str, Any]]) -> None:
        """One ``key: value`` line per pair, values aligned."""
        width = max(len(key) for key, _ in pairs) + 1
        for key, value in pairs:
            shown = json.dumps(value) if isinstance(value, dict | list) else cell(value, limit=None)
            self.line(f"{key + ':':<{width}} {shown}")


def cell(value: Any, *, limit: int | None = MAX_CELL_CHARS) -> str:
    """A value as a table cell: ``-`` for nothing, times to the second, long text cut."""
    if value is None or value == "":
        text = "-"
    elif isinstance(value, datetime):
        text = value.strftime("%Y-%m-%d %H:%M:%S")
    else:
        text = str(value)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text
