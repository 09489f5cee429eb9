"""What the hosting process provides to DevKit workers: a log sink and a gateway transport.

Plain use (tests, a REPL, a host process) logs through :mod:`logging` and makes gateway
calls over HTTP directly. Inside the sandbox the runner installs a runtime whose log and
gateway calls are frames to the host, because the sandbox has no network and its stdout is
not a log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from wm.devkit.transport import HttpTransport, Transport

#: Log levels a worker may use, lowest first.
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Runtime:
    """The services of the hosting process."""

    log: Callable[[str, str], None]
    transport: Transport


def _log_to_logging(level: str, message: str) -> None:
    import logging  # lazily: the sandbox never needs it (it would pull in threading)

    logging.getLogger(__name__).log(getattr(logging, level.upper(), logging.INFO), "%s", message)


def _default_runtime() -> Runtime:
    return Runtime(log=_log_to_logging, transport=HttpTransport())


_current: Runtime | None = None


def current_runtime() -> Runtime:
    """The installed runtime (plain use gets logging and direct HTTP)."""
    global _current
    if _current is None:
        _current = _default_runtime()
    return _current


def install_runtime(runtime: Runtime | None) -> None:
    """Install ``runtime`` for this process; None restores the default."""
    global _current
    _current = runtime


#: The reason given to :func:`done` during the current call (empty: not done).
_done: list[str] = []


def done(reason: str = "") -> None:
    """Declare that the worker has done its work (seed 003's natural end): once the outputs
    of the event being processed are published, the worker goes ``running → finished``, and
    no further event is delivered until it is started again. ``reason`` is recorded with
    the transition."""
    _done[:] = [str(reason) or "done"]


def take_done() -> str | None:
    """The reason :func:`done` was called with during the call just made, and forget it."""
    reason = _done[0] if _done else None
    _done.clear()
    return reason
