"""One line for a broker, Redis or database failure that reached the command line unwrapped.

The API wraps the failures it expects (``BrokerUnavailable``, ``DatabaseError``); this is the
last net under every command, so an operator never gets a library's traceback for a service
that is down or a URL that is wrong. Exceptions are recognised by their classes' modules, so
the net imports none of those libraries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wm.config import Settings

#: (module prefix of the exception's class, what failed, the setting that names it, advice).
_SERVICES = (
    (
        "kombu.",
        "the broker",
        "WM_BROKER_URL",
        "start it or fix the setting (a stale value from an old `wm up`? unset it)",
    ),
    ("amqp.", "the broker", "WM_BROKER_URL", "start it or fix the setting"),
    ("redis.", "Redis", "WM_REDIS_URL", "start it or fix the setting"),
    (
        "sqlalchemy.",
        "the database",
        "WM_DATABASE_URL",
        "start it, fix the setting, or run `wm db upgrade`",
    ),
    ("psycopg", "the database", "WM_DATABASE_URL", "start it or fix the setting"),
)


def describe(exc: BaseException, settings: Settings | None) -> str | None:
    """``<what failed> at <setting>=<URL, password masked> (<reason>); <what to do>``, for an
    exception of a broker, Redis or database client; None for anything else."""
    modules = [cls.__module__ for cls in type(exc).__mro__]
    for prefix, what, variable, advice in _SERVICES:
        if any(module.startswith(prefix) for module in modules):
            url = _masked(getattr(settings, variable[3:].lower(), None))
            reason = " ".join(str(exc).split()) or type(exc).__name__
            return f"{what} at {variable}={url} failed ({reason[:300]}); {advice}"
    return None


def _masked(url: str | None) -> str:
    if not url:
        return "(unset)"
    from kombu.utils.url import maybe_sanitize_url

    return str(maybe_sanitize_url(url))
