"""Writes whose replies nobody waits for.

A pool process that records the outcome of a delivery without outputs needs nothing from
the reply: there is no output to publish, and an outcome that another copy of the delivery
recorded first was published by that copy (``wm.dataplane.outputs``). Waiting for the reply
cost the process a round trip per delivery (its send, Redis's turn, the wake-up): without
it such deliveries drain about a tenth faster on two cores (docs/benchmarks.md).
:class:`Unawaited` sends such a write on a connection of its own (one per thread) and reads
its reply when the thread sends the next one, by when it has long arrived. A reply that
holds an error, or a connection lost before it, is logged then, naming what was sent.

Nothing is lost when such a write fails: the delivery's entry in the pending ledger stays,
and the sweep delivers the event again after WM_REDELIVER_AFTER_S (``wm.state.ledger``). The
send itself still raises when the server cannot be reached (the delivery then goes back to
its queue, as a record that waits would). The write is with the server before the delivery
is acknowledged; a read on another connection at the same moment may still miss it (a copy
of the delivery that then runs again records nothing new: the first record counts).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import redis

logger = logging.getLogger(__name__)


class _Slot:
    """A thread's connection and what its unread reply answers (None: nothing unread)."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        self.connection: Any = pool.make_connection()
        self.unread: str | None = None


class Unawaited:
    """Sends commands whose replies are read at the thread's next send (:meth:`send`)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._slots: list[_Slot] = []  # every thread's, for :meth:`unread`
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a forked child: none of the parent's connections (nor its unread replies)."""
        self._local = threading.local()
        self._slots = []
        self._lock = threading.Lock()

    def send(self, client: redis.Redis, command: tuple[Any, ...], what: str) -> None:
        """Send ``command`` (its arguments, as ``execute_command`` takes them) to the server of
        ``client`` without waiting for its reply; ``what`` names it in a log line should the
        reply hold an error. Raises redis-py's errors when it cannot be sent."""
        slot: _Slot | None = getattr(self._local, "slot", None)
        if slot is not None:
            self._settle(slot)
        if slot is None or slot.pool is not client.connection_pool:
            old, slot = slot, _Slot(client.connection_pool)
            if old is not None:
                old.connection.disconnect()
            self._local.slot = slot
            with self._lock:
                self._slots = [s for s in self._slots if s is not old] + [slot]
        slot.connection.send_command(*command)
        slot.unread = what

    def unread(self) -> list[str]:
        """What each reply not read yet answers, over every thread of this process."""
        return [slot.unread for slot in self._slots if slot.unread is not None]

    @staticmethod
    def _settle(slot: _Slot) -> None:
        """Read the reply the slot's last send left, logging an error it holds."""
        what, slot.unread = slot.unread, None
        if what is None:
            return
        try:
            slot.connection.read_response()
        except redis.ResponseError as exc:
            logger.error("%s was not written: %s (the pending ledger sends it again)", what, exc)
        except (redis.RedisError, OSError) as exc:
            slot.connection.disconnect()  # the next send connects again
            logger.warning(
                "%s may not have been written: the connection was lost before its reply (%s; "
                "if it was not, the pending ledger sends it again)",
                what,
                exc,
            )


#: The process's one :class:`Unawaited`.
UNAWAITED = Unawaited()
