"""Names an operator or a worker chooses: topics, subscription names and worker names.

One set of rules for ``create``, ``publish`` and ``subscribe``, so that every queue name built
from them (``<topic>::<worker id>``, ``<topic>::sub::<name>``) is unambiguous and fits every
broker: no ``::`` inside a name, no control characters, at most :data:`MAX_NAME_BYTES`.
"""

from __future__ import annotations

import re
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
    # printable text (the usual name) holds none of the refused categories: no scan
    refused = None if value.isprintable() else _refused(value)
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


def _refused(value: str) -> str | None:
    """The first character of ``value`` no name may hold, if any."""
    return next((c for c in value if unicodedata.category(c) in _REFUSED_CATEGORIES), None)


#: The tenant of every row, queue and key that names none: a single-tenant deployment never
#: names a tenant, and its topics, queues and Redis keys are those of earlier releases.
DEFAULT_TENANT = "default"
#: Longest tenant name: a DNS label, so it fits queue names, Redis keys, metric labels and
#: environment variable values unquoted.
MAX_TENANT_CHARS = 63
#: A tenant name, as a regular expression (the API's header declares it).
TENANT_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
#: The admin API's request header naming the tenant a call works in (absent: the token's
#: tenant, or the default one for a deployment-wide token); ``wm``'s reads through the API
#: send it.
TENANT_HEADER = "WM-Tenant"
_TENANT = re.compile(TENANT_PATTERN)


def check_tenant(value: object) -> str:
    """``value`` if it is a valid tenant name: 1 to 63 characters of lowercase ASCII letters,
    digits and ``-``, starting with a letter or digit; otherwise :class:`InvalidArgument`
    naming the rule it breaks."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"tenant must be a non-empty string, not {value!r}")
    if len(value) > MAX_TENANT_CHARS:
        raise InvalidArgument(
            f"tenant {value[:40]!r}... is {len(value)} characters long; the limit is "
            f"{MAX_TENANT_CHARS}"
        )
    if not _TENANT.fullmatch(value):
        raise InvalidArgument(
            f"tenant {value!r} is not a valid tenant name: use lowercase letters a-z, digits "
            "and '-', starting with a letter or digit"
        )
    return value


def route_topic(tenant: str, topic: str) -> str:
    """The topic as routing knows it (the routing table, queue names, the ``topic`` columns):
    the topic itself in the default tenant, ``<tenant>::<topic>`` in any other, so two
    tenants' topics of the same name never meet."""
    return topic if tenant == DEFAULT_TENANT else f"{tenant}{SEPARATOR}{topic}"


def split_route_topic(route: str) -> tuple[str, str]:
    """The tenant and the topic a user sees of a :func:`route_topic`."""
    tenant, sep, topic = route.partition(SEPARATOR)
    return (tenant, topic) if sep else (DEFAULT_TENANT, route)


def route_group(tenant: str, group: str | None) -> str | None:
    """A group as the store and the data plane know it, qualified as :func:`route_topic`
    qualifies a topic: group locks and shared groups of two tenants never meet."""
    return None if group is None else route_topic(tenant, group)


def bare_group(group: str | None) -> str | None:
    """The group a user sees of a :func:`route_group`."""
    return None if group is None else split_route_topic(group)[1]


def check_route_topic(route: object) -> str:
    """``route`` if it is a valid :func:`route_topic`: a valid topic, in the default tenant or
    qualified by a valid tenant name."""
    if isinstance(route, str) and SEPARATOR in route:
        tenant, topic = split_route_topic(route)
        check_tenant(tenant)
        check_name("topic", topic)
        return route
    return check_name("topic", route)


def reserved_topic(topic: str) -> bool:
    """True for the lifecycle topic, dead-letter topics and everything WorkManager owns."""
    return topic.startswith(RESERVED_PREFIXES) or topic.endswith(DEAD_SUFFIX)
