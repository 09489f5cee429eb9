"""The time limit of code that cannot be stopped (DESIGN.md §7).

Engines stop what they can at a message's limit — a sandbox or helper process is killed, a
.NET task is abandoned — and raise :class:`~wm.errors.WorkerTimeout`. A call into code that
runs in this process and never returns (a native call, a synchronous .NET loop) cannot be
stopped apart from the process. The watchdog watches each engine call; one still running
:data:`OVERRUN_GRACE_S` past its limit is taken over: the thread that made the call never goes
on with that delivery, ``on_overrun`` records how it ended (from the watchdog's thread), and
the process ends, which the prefork pool answers with a fresh one. Without ``on_overrun`` (a
process that cannot be ended apart from the node) the overrun is only logged.

Before that, at the limit itself (:data:`TELL_AFTER_S` later, so an engine that stops its own
calls reports first), ``on_limit`` runs from the watchdog's thread while the call runs on:
seed 001 wants the ``worker.error`` of an unmanaged timeout then, not when (or if) the call
returns. :attr:`Watch.told` says whether it ran, for the one who reports the call's end.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Seconds past its limit before a call is taken over: the engine's own timeout goes first.
OVERRUN_GRACE_S = 2.0
#: Seconds past its limit before a call still running is reported (``on_limit``): an engine
#: that stops its calls at the limit raises its own timeout first.
TELL_AFTER_S = 0.25
#: How often the watchdog looks at the calls.
POLL_S = 0.1
#: The exit status of a process the watchdog ended.
EXIT_STATUS = 70


class Watch:
    """One watched call, as a context manager around it. Once the watchdog took the call
    over, the thread that made it stays in ``__exit__`` until the process ends."""

    def __init__(
        self,
        watchdog: Watchdog,
        deadline: float,
        what: str,
        on_overrun: Callable[[], None] | None,
        limit: float | None = None,
        on_limit: Callable[[], None] | None = None,
    ) -> None:
        self.watchdog, self.deadline, self.what = watchdog, deadline, what
        self.on_overrun, self.limit, self.on_limit = on_overrun, limit, on_limit
        self._lock = threading.Lock()
        self._taken = False
        #: ``on_limit`` ran (or runs now): the call was still running at its limit.
        self.told = False
        self._token = -1

    def __enter__(self) -> Watch:
        self._token = self.watchdog.enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.watchdog.leave(self._token)
        if not self.take():  # taken over: the delivery is the watchdog's now
            threading.Event().wait()

    def take(self) -> bool:
        """True for the first taker only: the caller's thread, or the watchdog."""
        with self._lock:
            taken, self._taken = self._taken, True
            return not taken

    def tell(self) -> bool:
        """True once, when the call has not ended: ``on_limit`` is to run."""
        with self._lock:
            if self._taken or self.told or self.on_limit is None:
                return False
            self.told = True
            return True


class Watchdog:
    """Watches engine calls of this process (its thread starts with the first call)."""

    def __init__(self) -> None:
        self._calls: dict[int, Watch] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def watch(
        self,
        deadline: float,
        what: str,
        on_overrun: Callable[[], None] | None,
        *,
        limit: float | None = None,
        on_limit: Callable[[], None] | None = None,
    ) -> Watch:
        """Around a call that should end by ``deadline`` (``time.monotonic()``), told to
        ``on_limit`` once past ``limit``."""
        return Watch(self, deadline, what, on_overrun, limit, on_limit)

    def enter(self, call: Watch) -> int:
        token = next(self._tokens)
        self._calls[token] = call
        self._start()
        return token

    def leave(self, token: int) -> None:
        self._calls.pop(token, None)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wm-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            for token, call in list(self._calls.items()):
                if call.limit is not None and call.limit + TELL_AFTER_S < now and call.tell():
                    self._told(call)
                if call.deadline < now and self._calls.pop(token, None) is not None:
                    self._overran(call)

    @staticmethod
    def _told(call: Watch) -> None:
        assert call.on_limit is not None
        logger.error("%s is still running past its time limit", call.what)
        try:
            call.on_limit()
        except Exception:  # the call's own end is still reported
            logger.exception("could not report that %s is past its time limit", call.what)

    def _overran(self, call: Watch) -> None:
        if call.on_overrun is None:
            logger.error(
                "%s is still running past its time limit and cannot be stopped apart from "
                "this process (run the node with the prefork pool to have it replaced)",
                call.what,
            )
            return
        if not call.take():  # it returned meanwhile
            return
        logger.error("%s is still running past its time limit: ending its process", call.what)
        try:
            call.on_overrun()
        except Exception:  # its message is delivered again, as after a crash
            logger.exception("could not record how %s ended", call.what)
        finally:
            end_process()


def end_process() -> None:
    """End this process now (whatever its threads do), its log lines written first."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STATUS)
