"""Names an operator or a worker chooses: topics, subscription names and worker names.

One set of rules for ``create``, ``publish`` and ``subscribe``, so that every queue name built
from them (``<topic>::<worker id>``, ``<topic>::sub::<name>``) is unambiguous and fits every
broker: no ``::`` inside a name, no control characters, at most :data:`MAX_NAME_BYTES`.
"""

from __future__ import annotations

import unicodedata

from wm.errors import InvalidArgument

#: Longest name in UTF-8 bytes: a plain subscription's queue joins a topic and a name, and
#: AMQP caps queue names at 255 bytes (120 + 7 + 120 = 247). A dead-letter topic may also
#: carry its suffix (125 + 7 + 120 = 252).
MAX_NAME_BYTES = 120
#: Suffix of the topic a topic's dead letters are published to.
DEAD_SUFFIX = "-dead"
#: Joins the parts of a queue name, so no part may contain it.
SEPARATOR = "::"
#: Topics only WorkManager itself publishes to; a worker's output may not name them.
RESERVED_PREFIXES = ("workmanager.", "com.virtufin.workmanager.")
#: Unicode categories refused in names: control, format, line and paragraph separators, and
#: lone surrogates (no UTF-8 encoder takes them).
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def check_name(kind: str, value: object) -> str:
    """``value`` if it is a valid ``kind`` name (topic, subscription name, worker name);
    otherwise :class:`InvalidArgument` naming the rule it breaks."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{kind} must be a non-empty string, not {value!r}")
    refused = next((c for c in value if unicodedata.category(c) in _REFUSED_CATEGORIES), None)
    if refused is not None:
        what = "a lone surrogate" if unicodedata.category(refused) == "Cs" else "control character"
        raise InvalidArgument(
            f"{kind} {value[:60]!r} contains the {what} {refused!r}; names are printable text"
        )
    size = len(value.removesuffix(DEAD_SUFFIX).encode("utf-8"))
    if size > MAX_NAME_BYTES:
        raise InvalidArgument(
            f"{kind} {value[:40]!r}... is {size} bytes long; the limit is {MAX_NAME_BYTES} "
            "bytes of UTF-8"
        )
    if SEPARATOR in value:
        raise InvalidArgument(
            f"{kind} {value!r} contains {SEPARATOR!r}, which separates the parts of a queue name"
        )
    return value


def reserved_topic(topic: str) -> bool:
    """True for the lifecycle topic, dead-letter topics and everything WorkManager owns."""
    return topic.startswith(RESERVED_PREFIXES) or topic.endswith(DEAD_SUFFIX)
