"""Engines are found by MIME type through the ``wm.engines`` entry-point group."""

from __future__ import annotations

import difflib
from functools import cache
from importlib.metadata import EntryPoint, entry_points

from engines.base import Engine
from wm.errors import EngineNotFound, EngineUnavailable

GROUP = "wm.engines"


@cache
def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def registered_mime_types() -> list[str]:
    """MIME types with a registered engine, sorted."""
    return sorted(_entry_points())


def engine_class(mime_type: str) -> type[Engine]:
    """The engine class for ``mime_type``, imported on first use."""
    found = _entry_points().get(mime_type)
    if found is None:
        known = registered_mime_types()
        close = difflib.get_close_matches(mime_type, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise EngineNotFound(
            f"no engine is registered for MIME type {mime_type!r}.{hint} "
            f"Registered: {', '.join(known) or '(none)'}"
        )
    try:
        cls = found.load()
    except ImportError as exc:
        raise EngineUnavailable(
            f"the engine for {mime_type!r} cannot be imported ({exc}); install the extra "
            "that provides it (see the README's engine table)"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise EngineUnavailable(f"entry point {found.value!r} for {mime_type!r} is not an Engine")
    return cls
