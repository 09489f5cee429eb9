"""Redis Sentinel URLs: where the sentinels are and which primary they watch.

The form is kombu's for a Sentinel broker, one ``sentinel://`` URL per sentinel joined by
``;``, with the primary's name as ``master_name`` (kombu's transport option of that name)::

    sentinel://:PASSWORD@10.0.0.1:26379;sentinel://10.0.0.2:26379;sentinel://10.0.0.3:26379/1?master_name=wm

The password (of the primary and its replicas, not of the sentinels), the database number
and ``master_name`` may stand on any one of the URLs, or on several if they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlsplit

#: The scheme of a Sentinel URL (kombu's).
SCHEME = "sentinel"
#: A sentinel's port when its URL names none.
DEFAULT_PORT = 26379
#: What a Sentinel URL looks like, for error messages.
EXPECTED = "sentinel://HOST:26379;sentinel://HOST:26379/DB?master_name=NAME"


@dataclass(frozen=True)
class SentinelURL:
    """A parsed Sentinel URL."""

    #: (host, port) of each sentinel.
    sentinels: tuple[tuple[str, int], ...]
    #: The name the sentinels know the primary by (``sentinel monitor NAME …``).
    master_name: str
    db: int = 0
    password: str | None = None


def is_sentinel(url: str) -> bool:
    """Whether ``url`` names Redis through its sentinels."""
    return url.strip().lower().startswith(SCHEME + "://")


def parse(url: str) -> SentinelURL:
    """``url`` parsed; a ValueError naming what is wrong with it."""
    sentinels: list[tuple[str, int]] = []
    found: dict[str, str] = {}
    for part in url.strip().split(";"):
        parts = urlsplit(part.strip())
        if parts.scheme.lower() != SCHEME or not parts.hostname:
            raise ValueError(
                f"{part.strip()!r} is not a sentinel://HOST:PORT URL; expected {EXPECTED}"
            )
        try:
            sentinels.append((parts.hostname, parts.port or DEFAULT_PORT))
        except ValueError:
            raise ValueError(f"{part.strip()!r} has a port that is not a number") from None
        given = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if parts.path.strip("/"):
            given["db"] = parts.path.strip("/")
        if parts.password:
            given["password"] = unquote(parts.password)
        for key, value in given.items():
            if found.setdefault(key, value) != value:
                raise ValueError(f"the sentinels' URLs disagree on {key}")
    return _checked(sentinels, found)


def _checked(sentinels: list[tuple[str, int]], found: dict[str, str]) -> SentinelURL:
    unknown = set(found) - {"db", "password", "master_name"}
    if unknown:
        raise ValueError(f"unknown option {sorted(unknown)[0]!r}; expected {EXPECTED}")
    if not found.get("master_name"):
        raise ValueError(
            f"no master_name (the primary's name the sentinels watch); expected {EXPECTED}"
        )
    db = found.get("db", "0")
    if not db.isdigit():
        raise ValueError(f"the database {db!r} is not a number")
    return SentinelURL(tuple(sentinels), found["master_name"], int(db), found.get("password"))


def kombu_url(url: str) -> str:
    """``url`` as kombu's Sentinel transport reads it: the password and database on every
    sentinel's URL (kombu takes them from the first) and no ``master_name``, which kombu
    takes as a transport option only."""
    where = parse(url)
    auth = f":{quote(where.password, safe='')}@" if where.password else ""
    return ";".join(f"{SCHEME}://{auth}{host}:{port}/{where.db}" for host, port in where.sentinels)
