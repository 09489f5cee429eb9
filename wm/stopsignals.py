"""The signals that stop a foreground command (``wm up``, ``wm tail``) as Ctrl-C does, and
the handling of them for the length of a block."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

#: Ctrl-C, ``kill`` and service managers, and the terminal (or ssh) closing.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def handled(handler: Callable[[int, FrameType | None], Any]) -> Iterator[None]:
    """While the block runs, ``handler`` answers each of :data:`STOP_SIGNALS` that the
    caller has not ignored (``nohup`` ignores SIGHUP, and so it stays); the handlers before
    are restored after."""
    previous = {
        number: signal.signal(number, handler)
        for number in STOP_SIGNALS
        if signal.getsignal(number) != signal.SIG_IGN
    }
    try:
        yield
    finally:
        for number, before in previous.items():
            signal.signal(number, before)
