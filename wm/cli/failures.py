"""One line for a broker, Redis or database failure that reached the command line unwrapped.

The API wraps the failures it expects (``BrokerUnavailable``, ``DatabaseError``); this is the
last net under every command, so an operator never gets a library's traceback for a service
that is down or a URL that is wrong. Exceptions are recognised by their classes' modules, so
the net imports none of those libraries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wm.config import masked

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


#: The exception classes (by name, in any of those modules) that mean "cannot reach or talk
#: to the service": connection refused, timed out, authentication, the server went away. A
#: programming error of a client library (a bad query, an encoding error) is not one of them
#: and keeps its traceback.
_UNREACHABLE = frozenset(
    {"OperationalError", "InterfaceError", "ConnectionError", "TimeoutError", "AuthenticationError"}
)
#: Longest reason quoted from the library's message, in characters.
REASON_CHARS = 300


def describe(exc: BaseException, settings: Settings | None) -> str | None:
    """``<what failed> at <setting>=<URL, password masked> (<reason>); <what to do>``, for a
    broker, Redis or database client's failure to reach its service; None for anything else."""
    classes = [cls for cls in type(exc).__mro__ if cls.__name__ in _UNREACHABLE]
    for prefix, what, variable, advice in _SERVICES:
        if any(cls.__module__.startswith(prefix) for cls in classes):
            url = getattr(settings, variable[3:].lower(), None)
            reason = " ".join(str(exc).split()) or type(exc).__name__
            shown = masked(url) if url else "(unset)"
            return f"{what} at {variable}={shown} failed ({reason[:REASON_CHARS]}); {advice}"
    return None
