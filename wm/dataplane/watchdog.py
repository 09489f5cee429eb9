"""The time limit of code that cannot be stopped (DESIGN.md §7).

Engines stop what they can at a message's limit — a sandbox or helper process is killed, a
.NET task is abandoned — and raise :class:`~wm.errors.WorkerTimeout`. A call into code that
runs in this process and never returns (a native call, a synchronous .NET loop) cannot be
stopped apart from the process. The watchdog watches each engine call; one still running
:data:`OVERRUN_GRACE_S` past its limit is taken over: the thread that made the call never goes
on with that delivery, ``on_overrun`` records how it ended (from the watchdog's thread), and
the process ends, which the prefork pool answers with a fresh one. Without ``on_overrun`` (a
process that cannot be ended apart from the node) the overrun is only logged.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

#: Seconds past its limit before a call is taken over: the engine's own timeout goes first.
OVERRUN_GRACE_S = 2.0
#: How often the watchdog looks at the calls.
POLL_S = 0.1
#: The exit status of a process the watchdog ended.
EXIT_STATUS = 70


class _Call:
    def __init__(self, deadline: float, what: str, on_overrun: Callable[[], None] | None):
        self.deadline, self.what, self.on_overrun = deadline, what, on_overrun
        self._lock = threading.Lock()
        self._taken = False

    def take(self) -> bool:
        """True for the first taker only: the caller's thread, or the watchdog."""
        with self._lock:
            taken, self._taken = self._taken, True
            return not taken


class Watchdog:
    """Watches engine calls of this process (its thread starts with the first call)."""

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @contextmanager
    def watch(
        self, deadline: float, what: str, on_overrun: Callable[[], None] | None
    ) -> Iterator[None]:
        """Around a call that should end by ``deadline`` (``time.monotonic()``). Once the
        watchdog took the call over, its thread stays here until the process ends."""
        call = _Call(deadline, what, on_overrun)
        token = next(self._tokens)
        self._calls[token] = call
        self._start()
        try:
            yield
        finally:
            self._calls.pop(token, None)
            if not call.take():  # taken over: the delivery is the watchdog's now
                threading.Event().wait()

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
                if call.deadline < now and self._calls.pop(token, None) is not None:
                    self._overran(call)

    def _overran(self, call: _Call) -> None:
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
