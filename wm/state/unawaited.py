"""Writes whose replies nobody waits for.

A pool process that records the outcome of a delivery without outputs needs nothing from
the reply: there is no output to publish, and an outcome that another copy of the delivery
recorded first was published by that copy (``wm.dataplane.outputs``). Nor does one whose
outputs go only to topics without worker subscribers: their pushes to plain subscriptions
run in the record's round trip, and a push that finds more to do (a worker subscriber come
meanwhile, routes to load) puts the delivery back in the ledger, due at once
(``wm.dataplane.outputs``). Waiting for the reply cost the process a round trip per
delivery (its send, Redis's turn, the wake-up): without it such deliveries drain about a
tenth faster on two cores (docs/benchmarks.md).
:class:`Unawaited` sends such a write on a connection of its own (one per thread) and reads
its reply when the thread sends the next one, by when it has long arrived, or when the
process ends (:meth:`Unawaited.settle`); a reply that came and that no send read for
:data:`IDLE_S` (a process gone idle) is read by the process's reader thread. A reply that
holds an error, or a connection lost before it, is logged then, naming what was sent.

Nothing is lost when such a write fails: the delivery's entry in the pending ledger stays,
and the sweep delivers the event again (``wm.state.ledger``) after WM_REDELIVER_AFTER_S. A
write sent with a ``fallback`` (the record's: its ledger entry made due at once) has it run
when its reply does not come or holds a failover's error (:data:`PASSING`), so the sweep's
next turn (every WM_RECONCILE_INTERVAL_S) delivers the event again, not an hour later by
default. An error the write would meet again (a key of the wrong type) keeps the hour: run
again every turn, the event's code would run again every turn. An error in a command sent
behind it (an output's push, after the record was written) runs the fallback whatever it
is: the event delivered again finds its outcome recorded and republishes it, waiting for
the replies, so that error fails the delivery and its retries and dead letter follow. A
fallback that fails too leaves the entry to the later turn.

A connection the server closed is found before the send, as redis-py's pool finds it, and
a send that fails raises (the delivery then goes back to its queue, as a record that waits
would). The write is on its way to the server before the delivery is acknowledged; a read
on another connection at the same moment may still miss it (a copy of the delivery that
then runs again records nothing new: the first record counts).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import redis

logger = logging.getLogger(__name__)
#: Seconds :meth:`Unawaited.settle` waits for a reply at most.
SETTLE_TIMEOUT_S = 1.0
#: Seconds after which a reply that has come but that no send read yet (a thread that sends
#: no more, a process gone idle) is read by the process's reader thread: a failed write is
#: known, and its fallback run, about this long after it at most.
IDLE_S = 1.0
#: Errors a failover answers with, for a while (a replica, a server loading its data, a
#: cluster without a primary for a slot): a write's fallback runs after one of them, or
#: after its connection was lost, not after an error the write would meet again.
PASSING = (
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.MasterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)
#: Their codes, as a script's error quotes them (``... -READONLY You can't write ...``).
_PASSING_CODES = ("-READONLY ", "-LOADING ", "-MASTERDOWN ", "-TRYAGAIN ", "-CLUSTERDOWN ")


def _passing(error: redis.ResponseError) -> bool:
    """Whether ``error`` is a failover's (:data:`PASSING`), its own or a script's."""
    return isinstance(error, PASSING) or any(code in str(error) for code in _PASSING_CODES)


class _Slot:
    """A thread's connection and what its unread reply answers (None: nothing unread)."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        # not the pool's (``make_connection`` counts it there): one nobody else borrows (Any:
        # redis-py's connections are untyped)
        self.connection: Any = pool.connection_class(**pool.connection_kwargs)
        self.unread: str | None = None
        #: How many replies the unread write has coming (its commands sent together).
        self.replies = 0
        #: What to run should the unread reply hold an error or not come (None: nothing).
        self.fallback: tuple[Any, ...] | None = None
        #: When the unread reply's write was sent (``time.monotonic()``).
        self.sent_at = 0.0
        #: Held by whoever uses the connection: its thread, or the reader of idle replies.
        self.lock = threading.Lock()


class Unawaited:
    """Sends commands whose replies are read at the thread's next send (:meth:`send`), or by
    the process's reader thread once they are :attr:`idle_s` old (:meth:`read_idle`)."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        #: Age at which the reader thread reads a reply no send read (:data:`IDLE_S`).
        self.idle_s = idle_s
        self._forget()
        me = weakref.ref(self)  # a hook per instance, which keeps none alive
        os.register_at_fork(after_in_child=lambda: _forget(me()))

    def _forget(self) -> None:
        """No connection (nor unread reply): new, or in a forked child."""
        self._local = threading.local()
        #: Every thread's slot, for :meth:`unread`; a slot goes with its thread.
        self._slots: weakref.WeakSet[_Slot] = weakref.WeakSet()
        #: The thread that reads replies left unread for :data:`IDLE_S` (started at a send).
        self._reader: threading.Thread | None = None

    def send(
        self,
        client: redis.Redis,
        command: tuple[Any, ...],
        what: str,
        fallback: tuple[Any, ...] | None = None,
        more: Sequence[tuple[Any, ...]] = (),
    ) -> None:
        """Send ``command`` (its arguments, as ``execute_command`` takes them) to the server of
        ``client`` without waiting for its reply, with ``more`` commands behind it in the
        same write; ``what`` names them in a log line should a reply hold an error, and
        ``fallback`` is run then (and waited for), unless ``command`` itself met an error it
        would meet again. Raises redis-py's errors when they cannot be sent."""
        slot = self._slot(client)
        with slot.lock:
            self._settle(slot)
            connection = slot.connection
            try:  # nothing is due on it: anything readable is the server's close
                if connection.is_connected and connection.can_read():
                    raise redis.ConnectionError("the server sent what nobody asked for")
            except redis.ConnectionError:
                connection.disconnect()
            if not connection.is_connected:
                # its own connect (a Sentinel's asks the sentinels for the primary), not the
                # plain one a send makes
                connection.connect()
            connection.send_packed_command(connection.pack_commands([command, *more]))
            slot.unread, slot.fallback, slot.sent_at = what, fallback, time.monotonic()
            slot.replies = 1 + len(more)
        if self._reader is None:
            self._start_reader()

    def _slot(self, client: redis.Redis) -> _Slot:
        """This thread's slot on ``client``'s server: a new one when its last was another's
        (whose reply is read first)."""
        slot: _Slot | None = getattr(self._local, "slot", None)
        if slot is not None and slot.pool is client.connection_pool:
            return slot
        if slot is not None:
            with slot.lock:
                self._settle(slot)
                slot.connection.disconnect()
        slot = self._local.slot = _Slot(client.connection_pool)
        self._slots.add(slot)
        return slot

    def _start_reader(self) -> None:
        with _start_lock:
            if self._reader is None:
                reader = threading.Thread(
                    target=_read_idle, args=(weakref.ref(self),), name="wm-unawaited", daemon=True
                )
                reader.start()
                self._reader = reader

    def read_idle(self) -> None:
        """Read each reply that came, whose write is :attr:`idle_s` old and that no send
        read yet, running its fallback if it failed; a slot in use is left for later,
        and so is a reply that has not come (a slow server is no lost connection)."""
        now = time.monotonic()
        for slot in list(self._slots):
            if slot.unread is None or now - slot.sent_at < self.idle_s:
                continue
            if not slot.lock.acquire(blocking=False):
                continue
            try:
                try:
                    ready = slot.unread is not None and slot.connection.can_read(timeout=0)
                except (redis.RedisError, OSError):
                    ready = True  # the connection broke: settling finds it, and says so
                if ready:
                    self._settle(slot, SETTLE_TIMEOUT_S)
            finally:
                slot.lock.release()

    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Read the reply this thread's last send left (if any), logging an error it holds,
        waiting ``timeout_s`` at most (a process that ends: a server that hangs does not
        hold it)."""
        slot: _Slot | None = getattr(self._local, "slot", None)
        if slot is not None:
            with slot.lock:
                self._settle(slot, timeout_s)

    def unread(self) -> list[str]:
        """What each reply not read yet answers, over every thread of this process."""
        return [slot.unread for slot in list(self._slots) if slot.unread is not None]

    @staticmethod
    def _settle(slot: _Slot, timeout_s: float | None = None) -> None:
        what, slot.unread = slot.unread, None
        fallback, slot.fallback = slot.fallback, None
        replies, slot.replies = slot.replies, 0
        if what is None:
            return
        error: Exception
        try:
            refused = _read(slot.connection, replies, timeout_s)
        except (redis.RedisError, OSError) as exc:
            slot.connection.disconnect()  # the next send connects again
            error, lost = exc, True
        else:
            if refused is None:
                return
            (error, first), lost = refused, False
            if first and not _passing(error):  # it would fail again: not sooner than before
                fallback = None
        when = "at its next turn" if _fall_back(slot, fallback) else "after WM_REDELIVER_AFTER_S"
        then = f"the pending ledger's sweep delivers its event again {when}"
        if lost:
            logger.warning(
                "%s may not have been written: its reply did not come (%s; if it was not, %s)",
                what,
                error,
                then,
            )
        else:
            logger.error("%s was not written: %s (%s)", what, error, then)


def _read(
    connection: Any, replies: int, timeout_s: float | None
) -> tuple[redis.ResponseError, bool] | None:
    """Read ``replies`` replies, each one even after an error (none is left unread); the
    first error one held, and whether it was the first reply's (None: no error)."""
    refused = None
    for index in range(replies):
        try:
            if timeout_s is None:
                connection.read_response()
            else:
                connection.read_response(timeout=timeout_s)
        except redis.ResponseError as exc:
            refused = refused or (exc, index == 0)
    return refused


def _fall_back(slot: _Slot, fallback: tuple[Any, ...] | None) -> bool:
    """Run ``fallback`` on ``slot``'s connection, then once more on a new one (a failover's
    new primary) should it fail; whether it ran."""
    if fallback is None:
        return False
    for attempt in (1, 2):
        connection = slot.connection
        try:
            if not connection.is_connected:
                connection.connect()
            connection.send_command(*fallback)
            connection.read_response(timeout=SETTLE_TIMEOUT_S)
            return True
        except (redis.RedisError, OSError) as exc:
            connection.disconnect()
            if attempt == 2:
                logger.warning("could not run %s after a write failed: %s", fallback[0], exc)
    return False


def _read_idle(unawaited: weakref.ref[Unawaited]) -> None:
    """The reader thread: :meth:`Unawaited.read_idle` every half ``idle_s``, while its
    :class:`Unawaited` lives."""
    while True:
        me = unawaited()
        if me is None:
            return
        wait = me.idle_s / 2
        try:
            me.read_idle()
        except Exception:  # never end the thread: the next send reads what this could not
            logger.exception("reading the replies nobody waited for")
        del me
        time.sleep(wait)


#: Guards the start of each instance's reader thread.
_start_lock = threading.Lock()


def _forget(unawaited: Unawaited | None) -> None:
    """In a forked child: none of the parent's connections (nor its unread replies)."""
    if unawaited is not None:
        unawaited._forget()


#: The process's one :class:`Unawaited`.
UNAWAITED = Unawaited()
