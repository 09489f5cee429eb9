"""Text every store accepts: what a worker, a publisher or a request hands WorkManager may
hold anything, and a store that refuses it must not turn one bad string into a loop.

PostgreSQL's text type refuses NUL; every UTF-8 encoder (psycopg, redis-py, a log stream)
refuses a lone surrogate (``"\\udcff"``, what Python makes of undecodable bytes); and a
multi-megabyte error message has no place in a column or a log line. :func:`storable` makes
any text storable, and every place that stores or logs outside text calls it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_TEXT_CHARS", "storable", "storable_data"]

#: Longest text kept where no tighter limit is given (characters); the rest is cut, and says so.
MAX_TEXT_CHARS = 65536
#: The marker's room: ``" [cut N characters]"`` with N up to 20 digits.
_MARKER_CHARS = 40


def storable(text: object, limit: int | None = MAX_TEXT_CHARS) -> str:
    """``text`` as a string every store accepts: NUL written ``\\x00``, a lone surrogate
    ``\\udcff``, bytes that are not UTF-8 ``\\xff``; longer than ``limit`` characters (None:
    unbounded) it is cut, ending with ``[cut N characters]``. Valid text comes back as is."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8", "backslashreplace")
    elif not isinstance(text, str):
        text = str(text)
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if limit is None or len(text) <= limit:
        return text
    keep = max(0, limit - _MARKER_CHARS)
    return f"{text[:keep]} [cut {len(text) - keep} characters]"


def storable_data(value: Any, limit: int | None = MAX_TEXT_CHARS) -> Any:
    """``value`` (JSON-like: mappings, lists, strings, numbers) with every string, key
    included, made :func:`storable`."""
    if isinstance(value, str):
        return storable(value, limit)
    if isinstance(value, dict):
        return {storable(k, limit): storable_data(v, limit) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_data(v, limit) for v in value]
    return value
