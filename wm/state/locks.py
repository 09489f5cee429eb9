"""Group locks with fencing tokens and leases, kept in Redis (DESIGN §6).

Workers of one group must not process messages concurrently. A lock is a Redis hash holding
the owner, a fence, the acquisition time (Redis server clock) and a *written* flag, and it
expires after a lease (``WM_GROUP_LOCK_LEASE_S``). Every operation is one Lua script, so it
is atomic and costs one round trip: an uncontended acquire plus release is two round trips.

* Acquire takes a lock that does not exist: never taken, released, or expired because its
  holder stopped renewing it. It mints a fence with ``INCR`` on a counter that is never
  reset, so fences of a group increase strictly across releases and takeovers.
* The holder renews its lease from a :class:`Heartbeat` while it runs, for at most a limit
  its caller sets (a delivery: its time limit plus one lease). A holder killed, paused or
  hung beyond that limit stops renewing, so its group is free again within one lease. No
  other way takes a lock from its holder: a slow but live holder keeps it.
* Before each side effect the holder calls :meth:`GroupLocks.mark_write`, the atomic fence
  check: it renews the lease of a holder that still holds the lock, and refuses one whose
  lease expired, so a holder never writes after a takeover. What it wrote before (a recorded
  outcome) is what the next attempt of its delivery republishes (``wm.dataplane.delivery``).
  A write that is itself a script on the lock's server runs the check as its first step
  (:meth:`GroupLocks.write_fence`): check and write in one round trip, with no gap between.
* :meth:`GroupLocks.take_reading` reads one more key in the acquire script, so a taker sees
  what the previous holder wrote without another round trip.
* A release leaves a wake-up token, so a contender waiting in :meth:`GroupLocks.take`'s
  short hand-off window (or in the blocking :meth:`GroupLocks.acquire`) retries at once;
  only a lock someone found held (its record's *waiting* flag) leaves one.
* The written flag only tells operators that a holder is in its publishing phase.
* With ``WM_REDIS_WAIT_REPLICAS``, an acquire is followed by ``WAIT`` on its connection and
  counts only once that many replicas have it: a fence minted survives a failover, so no
  promoted replica mints it again (:func:`wm.state.connection.queue_wait`).
* Acquire also records the new holder (``…:last``), and release deletes that record with the
  lock's, in their scripts: an acquire that finds a holder recorded took the lock after that
  holder's lease expired without a release, and says so (:attr:`Lease.stolen_from`). It
  takes nothing more than before: fences and leases are what decide.

Keys are ``<prefix>{<group>}`` (the record), ``<prefix>{<group>}:fence`` (the counter),
``<prefix>{<group>}:wake`` (the wake-up token) and ``<prefix>{<group>}:last`` (the holder
until it releases); a lock of one item of the group (a shared group locks each event) has its
own record, token and last holder, ``<prefix>{<group>}:item:<item>``, ``…:wake`` and
``…:last``, and mints from the group's counter. The hash tag keeps them on one cluster slot,
as a Lua script touching several requires (the prefix is ``wm:lock:``; an empty group, which
would tag nothing, is refused). On a Redis Cluster the BLPOP on the wake-up token goes to the
node of the group's slot.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypedDict

from redis.cluster import RedisCluster
from redis.commands.core import Script

from wm.config import Settings
from wm.errors import BrokerUnavailable, FenceRejected, LockContention
from wm.state.connection import (
    StatePipeline,
    StateRedis,
    check_wait,
    queue_eval,
    queue_wait,
    redis_errors,
    redis_for,
    text,
)

__all__ = [
    "ACQUIRE_RETRIES",
    "FENCE_CHECK_LUA",
    "LAST_HOLDER_MS",
    "MIN_LEASE_MS",
    "RENEWALS_PER_LEASE",
    "GroupLocks",
    "Heartbeat",
    "Holder",
    "Lease",
    "WriteFence",
    "lease_ms",
    "make_owner",
    "retry_delay_ms",
]

logger = logging.getLogger(__name__)

#: Shortest lease (ms): a lease of 0 would delete a lock the moment it is taken.
MIN_LEASE_MS = 100
#: Retries of the blocking :meth:`GroupLocks.acquire` (the seeds' in-process attempts,
#: 500 ms → 1 s → 2 s apart by default); a delivery waits in the broker instead.
ACQUIRE_RETRIES = 3
#: Heartbeats per lease: a holder survives two lost or late renewals in a row.
RENEWALS_PER_LEASE = 3
#: How long stopping a heartbeat waits for a renewal in flight (s).
_HEARTBEAT_JOIN_S = 1.0
#: Shortest BLPOP wait worth a round trip (BLPOP with timeout 0 blocks for ever).
_MIN_BLOCK_S = 0.001
#: Shortest life of a wake-up token (ms): long enough for a waiter's next BLPOP to see it.
_MIN_WAKE_TTL_MS = 1000
_HELD = "held"
#: How long a lock's last holder is remembered (ms): a lock whose holder died and that no one
#: takes for this long is not reported as stolen when it is taken at last.
LAST_HOLDER_MS = 24 * 3600 * 1000

# KEYS: record, fence counter, last holder[, a key to read once acquired]. ARGV: owner,
# lease ms, last holder's memory ms. Reply: status, owner, fence, acquired_at_ms, written,
# server_ms, lease left ms[, the value read when acquired, the holder whose lease expired
# without a release: "<fence> <owner>"].
_ACQUIRE_LUA = """
local function read() return KEYS[4] and redis.call('GET', KEYS[4]) or false end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'owner', 'fence', 'acquired_at_ms', 'written')
if cur[1] then
  if cur[1] ~= ARGV[1] then
    redis.call('HSET', KEYS[1], 'waiting', '1')
    return {'held', cur[1], cur[2], cur[3], cur[4], now, redis.call('PTTL', KEYS[1])}
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {'acquired', cur[1], cur[2], cur[3], cur[4], now, ARGV[2], read(), false}
end
local fence = redis.call('INCR', KEYS[2])
local at = string.format('%d', now)
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence, 'acquired_at_ms', at,
           'written', '0')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local last = redis.call('GET', KEYS[3])
redis.call('SET', KEYS[3], string.format('%d', fence) .. ' ' .. ARGV[1], 'PX', ARGV[3])
return {'acquired', ARGV[1], fence, at, '0', now, ARGV[2], read(), last}
"""

#: The fence check: with the lock's record as ``FENCE_KEY`` and ``FENCE_ARGS`` (owner,
#: fence, lease ms, '1' to mark a write), it ends the script with ``{0, current owner,
#: current fence}`` when the lease was lost, and otherwise renews it and goes on. Alone it is
#: :meth:`GroupLocks.renew` and :meth:`GroupLocks.mark_write`; as the start of a write's own
#: script on the lock's server (:class:`WriteFence`), it checks in the write's round trip.
FENCE_CHECK_LUA = """
local held = redis.call('HMGET', FENCE_KEY, 'owner', 'fence')
if held[1] ~= FENCE_ARGS[1] or held[2] ~= FENCE_ARGS[2] then
  return {0, held[1] or '', held[2] or ''}
end
if FENCE_ARGS[4] == '1' then redis.call('HSET', FENCE_KEY, 'written', '1') end
redis.call('PEXPIRE', FENCE_KEY, FENCE_ARGS[3])
"""

# KEYS: record. ARGV: owner, fence, lease ms, '1' to mark a write.
# Reply: {1} when renewed, else {0, current owner, current fence}.
_RENEW_LUA = "local FENCE_KEY, FENCE_ARGS = KEYS[1], ARGV" + FENCE_CHECK_LUA + "return {1}\n"

# KEYS: record, wake list, last holder. ARGV: owner, fence, wake ttl ms. Reply: 1 when
# deleted, else 0. A release of a lock someone found held leaves one wake-up token, so one
# contender waiting for it retries at once; an uncontended release deletes two keys.
_RELEASE_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'fence', 'waiting')
if cur[1] == ARGV[1] and cur[2] == ARGV[2] then
  redis.call('DEL', KEYS[1], KEYS[3])
  if cur[3] then
    redis.call('RPUSH', KEYS[2], 1)
    redis.call('LTRIM', KEYS[2], -1, -1)
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Lease:
    """Proof of holding a group lock; its fence goes on every output as an attribute.
    ``item``: the lock is one item's of the group (a shared group locks each event), under
    the group's one fence counter."""

    group: str
    owner: str
    fence: int
    acquired_at_ms: int
    item: str | None = None
    #: Taken after this holder's lease expired without a release (a holder killed, hung or
    #: cut off): its owner and fence; None for a lock released or never taken before.
    stolen_from: tuple[str, int] | None = field(default=None, compare=False)


class Holder(TypedDict):
    """What operators see of a held lock."""

    owner: str
    fence: int
    acquired_at_ms: int
    written: bool
    lease_left_ms: int


@dataclass(frozen=True)
class WriteFence:
    """:meth:`GroupLocks.mark_write` for a script that writes on the lock's own server: run
    :data:`FENCE_CHECK_LUA` first with the lock's record among its keys and :attr:`args` as
    ``FENCE_ARGS``, and pass a ``{0, owner, fence}`` reply to :meth:`refused`."""

    key: str
    args: tuple[str, str, str, str]
    lease: Lease

    def refused(self, current_owner: Any, current_fence: Any) -> FenceRejected:
        return _refused(self.lease, text(current_owner), text(current_fence))


@dataclass(frozen=True)
class _AcquireReply:
    status: str
    owner: str
    fence: int
    acquired_at_ms: int
    written: bool
    server_ms: int
    lease_left_ms: int
    value: Any = None
    stolen_from: tuple[str, int] | None = None

    @classmethod
    def parse(cls, raw: list[Any]) -> _AcquireReply:
        status, owner, fence, acquired_at_ms, written, server_ms, lease_left_ms = raw[:7]
        return cls(
            status=text(status),
            owner=text(owner),
            fence=int(fence),
            acquired_at_ms=int(acquired_at_ms),
            written=text(written) == "1",
            server_ms=int(server_ms),
            lease_left_ms=int(lease_left_ms),
            value=raw[7] if len(raw) > 7 else None,
            stolen_from=_last_holder(raw[8]) if len(raw) > 8 and raw[8] else None,
        )


def _last_holder(raw: Any) -> tuple[str, int]:
    fence, _, owner = text(raw).partition(" ")
    return owner, int(fence)


def make_owner(task_id: str) -> str:
    """Owner id unique per delivery attempt, readable by an operator looking at a stuck lock."""
    return f"{socket.gethostname()}:{os.getpid()}:{task_id}"


def retry_delay_ms(settings: Settings, retry: int) -> int:
    """The wait before try ``retry + 1`` of a held lock: ``GROUP_LOCK_RETRY_BASE_DELAY_MS ×
    2^retry``, never longer than half a lease, so a waiter looks at least twice per lease and
    a group whose holder died resumes within 1.5 leases of its last renewal."""
    cap_ms = lease_ms(settings) // 2
    doublings = min(max(retry, 0), cap_ms.bit_length())  # base << bit_length(cap) > cap
    ceiling_ms = settings.group_lock_retry_base_delay_ms << doublings
    return max(1, min(ceiling_ms, cap_ms))


def lease_ms(settings: Settings) -> int:
    """The lock lease in ms, floored at :data:`MIN_LEASE_MS`."""
    return max(MIN_LEASE_MS, round(settings.group_lock_lease_s * 1000))


class GroupLocks:
    """Fenced, leased mutual exclusion per worker group, one Redis round trip per operation."""

    def __init__(
        self,
        settings: Settings,
        *,
        client: StateRedis | None = None,
        prefix: str = "wm:lock:",
    ) -> None:
        self._client = client
        self._settings = settings
        self._prefix = prefix
        self.lease_ms = lease_ms(settings)
        self.handoff_ms = min(settings.group_lock_handoff_ms, self.lease_ms // 4)

    @functools.cached_property
    def _redis(self) -> StateRedis:
        """The client, found at first use: finding out whether WM_REDIS_URL is a cluster
        takes a round trip, which constructing a lock object does not make."""
        return self._client if self._client is not None else redis_for(self._settings)

    @functools.cached_property
    def _acquire_script(self) -> Script:
        return self._redis.register_script(_ACQUIRE_LUA)

    @functools.cached_property
    def _renew_script(self) -> Script:
        return self._redis.register_script(_RENEW_LUA)

    @functools.cached_property
    def _release_script(self) -> Script:
        return self._redis.register_script(_RELEASE_LUA)

    def try_acquire(self, group: str, owner: str) -> Lease | None:
        """Take the lock if free, in one round trip; ``None`` if someone holds it.

        Calling again with the owner that already holds the lock returns the same lease (and
        renews it), so a round trip retried after a lost reply cannot lock the owner out.
        """
        reply = self._attempt(group, owner)
        return None if reply.status == _HELD else _lease(group, reply)

    def acquire(self, group: str, owner: str, *, retries: int | None = None) -> Lease:
        """Take the lock, trying ``retries`` more times (default :data:`ACQUIRE_RETRIES`)
        up to :func:`retry_delay_ms` apart; raise :class:`LockContention` naming the holder.

        Each wait ends early when the holder releases. This blocking form serves scripts and
        operators; a delivery uses :meth:`take`, which never waits longer than a hand-off.
        """
        started = time.monotonic()
        limit = ACQUIRE_RETRIES if retries is None else retries
        reply = self._attempt(group, owner)
        retry = 0
        while reply.status == _HELD and retry < limit:
            delay_ms = retry_delay_ms(self._settings, retry)
            logger.debug(
                "group lock %r held by %s (fence %d); retry %d in %d ms",
                group,
                reply.owner,
                reply.fence,
                retry + 1,
                delay_ms,
            )
            reply = self._wait_for_release(group, owner, delay_ms)
            retry += 1
        if reply.status != _HELD:
            return _lease(group, reply)
        raise _contention(group, reply, retry + 1, time.monotonic() - started)

    def take(self, group: str, owner: str) -> Lease:
        """Take the lock now, or when its holder releases it within the hand-off window
        (``WM_GROUP_LOCK_HANDOFF_MS``, at most a quarter lease); else raise
        :class:`LockContention` naming the holder, and the caller waits elsewhere.

        Why a window: a group busy with short deliveries is handed from one to the next
        without idle time or a trip through the broker, while a waiter for a long delivery
        gives its process back after the window.
        """
        return self.take_reading(group, owner, None)[0]

    def take_reading(
        self, group: str, owner: str, key: str | None, item: str | None = None
    ) -> tuple[Lease, Any]:
        """:meth:`take`, and the value of ``key`` (None when missing) as it was once the
        lock was taken: what a previous holder wrote is seen. On one server the acquire
        script reads it, in the same round trip; on a cluster, where ``key`` may live in
        another slot, a GET follows. With ``item``, the lock of that item of the group."""
        started = time.monotonic()
        inline = key if self._one_server else None
        reply = self._attempt(group, owner, inline, item)
        if reply.status == _HELD and self.handoff_ms:
            reply = self._wait_for_release(group, owner, self.handoff_ms, inline, item)
        if reply.status == _HELD:
            raise _contention(_shown(group, item), reply, 1, time.monotonic() - started)
        lease = _lease(group, reply, item)
        if key is None or inline is not None:
            return lease, reply.value
        with redis_errors(self._settings):
            return lease, self._redis.get(key)

    def renew(self, lease: Lease) -> bool:
        """Extend the lease by a full lease; ``False`` when it expired and the lock is lost."""
        return self._renew(lease, mark_write=False) is None

    def mark_write(self, lease: Lease) -> None:
        """Fence check before a side effect: renew the lease and mark the write, or refuse a
        holder whose lease expired (its group may already run under a higher fence)."""
        refused = self._renew(lease, mark_write=True)
        if refused is not None:
            raise _refused(lease, *refused)

    def write_fence(self, lease: Lease) -> WriteFence | None:
        """The fence check for a write's own script, when the write goes to the lock's
        server; on a cluster (the write's keys in another slot) the check runs now
        (:meth:`mark_write`) and None is returned."""
        if self._one_server:
            args = (lease.owner, str(lease.fence), str(self.lease_ms), "1")
            return WriteFence(self._record_key(lease.group, lease.item), args, lease)
        self.mark_write(lease)
        return None

    def release(self, lease: Lease) -> bool:
        """Delete the lock if this lease still holds it; ``False`` leaves someone else's lock."""
        with redis_errors(self._settings):
            reply = self._release_script(
                keys=self._release_keys(lease), args=self._release_args(lease)
            )
        return self.released(lease, reply)

    def queue_release(self, pipe: StatePipeline, lease: Lease) -> None:
        """:meth:`release`'s script queued in ``pipe``, a pipeline to the lock's server (a
        holder with nothing left to do under the lease releases it with its last write);
        :meth:`released` reads its reply."""
        queue_eval(pipe, _RELEASE_LUA, self._release_keys(lease), *self._release_args(lease))

    def released(self, lease: Lease, reply: Any) -> bool:
        """Whether the release script's ``reply`` says the lock was deleted (logged if not)."""
        if int(reply) != 1:
            logger.warning(
                "group lock %r no longer held by %s (fence %d) at release: its lease expired",
                lease.group,
                lease.owner,
                lease.fence,
            )
            return False
        return True

    def _release_keys(self, lease: Lease) -> list[str]:
        record = self._record_key(lease.group, lease.item)
        return [record, self._wake_key(lease.group, lease.item), f"{record}:last"]

    def _release_args(self, lease: Lease) -> list[str | int]:
        return [lease.owner, lease.fence, self._wake_ttl_ms()]

    def keep_alive(self, lease: Lease, limit_s: float) -> Heartbeat:
        """A heartbeat renewing ``lease`` for at most ``limit_s``; use it as a context."""
        return Heartbeat(self, lease, limit_s)

    @contextmanager
    def holding(self, group: str, owner: str, *, limit_s: float | None = None) -> Iterator[Lease]:
        """Hold the group lock for a block, renewed for at most ``limit_s`` (default: the
        per-message time limit), and release it however the block ends."""
        limit = self._settings.message_handling_timeout_seconds if limit_s is None else limit_s
        lease = self.acquire(group, owner)
        try:
            with self.keep_alive(lease, limit):
                yield lease
        finally:
            self.release(lease)

    def holder(self, group: str) -> Holder | None:
        """Current holder of a group lock, for operators and tests; ``None`` when free."""
        with redis_errors(self._settings):
            pipe = self._redis.pipeline(transaction=True)
            pipe.hgetall(self._record_key(group))
            pipe.pttl(self._record_key(group))
            raw, left_ms = pipe.execute()
        if not raw:
            return None
        fields = {text(key): text(value) for key, value in raw.items()}
        return Holder(
            owner=fields["owner"],
            fence=int(fields["fence"]),
            acquired_at_ms=int(fields["acquired_at_ms"]),
            written=fields["written"] == "1",
            lease_left_ms=int(left_ms),
        )

    @functools.cached_property
    def _one_server(self) -> bool:
        return not isinstance(self._redis, RedisCluster)

    def _attempt(
        self, group: str, owner: str, read: str | None = None, item: str | None = None
    ) -> _AcquireReply:
        if not group or not owner:
            raise ValueError("group and owner must be non-empty")
        record = self._record_key(group, item)
        keys = [record, self._fence_key(group), f"{record}:last"] + ([read] if read else [])
        args: list[str | int] = [owner, self.lease_ms, LAST_HOLDER_MS]
        with redis_errors(self._settings):
            if not self._settings.redis_wait_replicas:
                return _AcquireReply.parse(self._acquire_script(keys=keys, args=args))
            pipe = self._redis.pipeline(transaction=False)  # script and WAIT, one connection
            queue_eval(pipe, _ACQUIRE_LUA, keys, *args)
            queue_wait(pipe, self._settings, record)
            raw, acknowledged = pipe.execute()
        check_wait(self._settings, acknowledged, f"the fence of group lock {group!r}")
        return _AcquireReply.parse(raw)

    def _renew(self, lease: Lease, *, mark_write: bool) -> tuple[str, str] | None:
        """``None`` when renewed, else the (owner, fence) now in the record ('' when free)."""
        with redis_errors(self._settings):
            raw = self._renew_script(
                keys=[self._record_key(lease.group, lease.item)],
                args=[lease.owner, lease.fence, self.lease_ms, "1" if mark_write else "0"],
            )
        if int(raw[0]) == 1:
            return None
        return text(raw[1]), text(raw[2])

    def _record_key(self, group: str, item: str | None = None) -> str:
        if item is None:
            return f"{self._prefix}{{{group}}}"
        return f"{self._prefix}{{{group}}}:item:{item}"

    def _fence_key(self, group: str) -> str:
        return f"{self._prefix}{{{group}}}:fence"

    def _wake_key(self, group: str, item: str | None = None) -> str:
        return f"{self._record_key(group, item)}:wake"

    def _wake_ttl_ms(self) -> int:
        return max(_MIN_WAKE_TTL_MS, self._settings.group_lock_retry_base_delay_ms * 4)

    def _wait_for_release(
        self,
        group: str,
        owner: str,
        delay_ms: int,
        read: str | None = None,
        item: str | None = None,
    ) -> _AcquireReply:
        """Wait up to ``delay_ms`` for the lock, trying again whenever a release leaves a
        wake-up token (BLPOP): the lock is handed on without idle time."""
        deadline = time.monotonic() + delay_ms / 1000
        while True:
            remaining = deadline - time.monotonic()
            if remaining < _MIN_BLOCK_S:  # BLPOP's timeout 0 would block for ever; the
                # rest is rounded up, so the retry never comes before its delay
                _sleep_ms(math.ceil(max(0.0, remaining) * 1000))
                return self._attempt(group, owner, read, item)
            with redis_errors(self._settings):
                woken = self._redis.blpop([self._wake_key(group, item)], timeout=remaining)
            if woken is None:  # timed out, maybe a little early: the rest as above
                continue
            reply = self._attempt(group, owner, read, item)
            if reply.status != _HELD:
                return reply


class Heartbeat:
    """Renews a lease every 1/:data:`RENEWALS_PER_LEASE` of a lease while it is entered.

    Why renewals from a thread: worker code may run for up to its time limit, far longer than
    a lease, and only a live process renews, so a killed or paused holder frees its group
    within one lease. Renewal stops at ``limit_s`` (code that hangs beyond its time limit
    loses the lock rather than stall its group) and when a renewal finds the lease lost; a
    Redis error is logged and renewal goes on, as the lease may still be saved. :attr:`lost`
    tells whether the lease was found lost; the holder's next fence check refuses anyway.

    The renewing thread is the process's one :class:`_Renewer`, not a thread per heartbeat:
    starting and joining a thread took about 180 µs, spent while the group waits.
    """

    def __init__(self, locks: GroupLocks, lease: Lease, limit_s: float) -> None:
        self._locks = locks
        self._lease = lease
        self._interval_s = locks.lease_ms / RENEWALS_PER_LEASE / 1000
        self._deadline = time.monotonic() + limit_s
        self.due = time.monotonic() + self._interval_s
        self._stopped = False
        self._renewing = threading.Lock()  # held while a renewal of this lease is in flight
        self.renewals = 0
        self.lost = False

    def __enter__(self) -> Heartbeat:
        self.due = time.monotonic() + self._interval_s
        _renewer().add(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop renewing, waiting for a renewal in flight; the holder then releases the lock
        (or lets the lease run out)."""
        self._stopped = True
        _renewer().remove(self)
        if self._renewing.acquire(timeout=_HEARTBEAT_JOIN_S):
            self._renewing.release()

    def beat(self) -> bool:
        """One renewal, run by the renewer when :attr:`due`; False once renewing is over."""
        lease = self._lease
        with self._renewing:
            if self._stopped:
                return False
            if time.monotonic() >= self._deadline:
                logger.warning(
                    "group lock %r: %s (fence %d) still runs at its limit; no longer renewing "
                    "its lease, so the group moves on and its late writes are refused",
                    lease.group,
                    lease.owner,
                    lease.fence,
                )
                return False
            self.due = time.monotonic() + self._interval_s
            try:
                renewed = self._locks.renew(lease)
            except BrokerUnavailable as exc:
                logger.warning("group lock %r: renewal failed, trying again: %s", lease.group, exc)
                return True
            if not renewed:
                self.lost = True
                logger.warning(
                    "group lock %r: lease of %s (fence %d) expired before its renewal",
                    lease.group,
                    lease.owner,
                    lease.fence,
                )
                return False
            self.renewals += 1
            return True


class _Renewer:
    """The daemon thread that runs every entered :class:`Heartbeat` of the process when due,
    sleeping until the next one is (a forked child starts its own: threads do not survive a
    fork)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._beats: set[Heartbeat] = set()
        threading.Thread(target=self._run, name="lease-renewer", daemon=True).start()

    def add(self, beat: Heartbeat) -> None:
        with self._changed:
            self._beats.add(beat)
            self._changed.notify()

    def remove(self, beat: Heartbeat) -> None:
        with self._changed:
            self._beats.discard(beat)

    def _run(self) -> None:
        while True:
            with self._changed:
                now = time.monotonic()
                due = [beat for beat in self._beats if beat.due <= now]
                if not due:
                    next_due = min((beat.due for beat in self._beats), default=None)
                    self._changed.wait(None if next_due is None else next_due - now)
                    continue
            for beat in due:  # outside the condition: a renewal is a round trip
                try:
                    going = beat.beat()
                except Exception:  # the thread serves every lease of the process: it goes on
                    logger.exception("group lock renewal failed; trying again when next due")
                    going = True
                if not going:
                    self.remove(beat)


_the_renewer: _Renewer | None = None
_renewer_lock = threading.Lock()


def _renewer() -> _Renewer:
    """This process's renewer, started at first use."""
    global _the_renewer
    with _renewer_lock:
        if _the_renewer is None:
            _the_renewer = _Renewer()
        return _the_renewer


def _forget_renewer() -> None:
    """In a forked child: the parent's renewer thread (and maybe its lock's holder) is gone."""
    global _the_renewer, _renewer_lock
    _the_renewer, _renewer_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_renewer)


def _lease(group: str, reply: _AcquireReply, item: str | None = None) -> Lease:
    return Lease(
        group=group,
        owner=reply.owner,
        fence=reply.fence,
        acquired_at_ms=reply.acquired_at_ms,
        item=item,
        stolen_from=reply.stolen_from,
    )


def _shown(group: str, item: str | None) -> str:
    """How a lock is named in messages: the group, and its item if any."""
    return group if item is None else f"{group}, item {item}"


def _contention(
    group: str, reply: _AcquireReply, attempts: int, elapsed_s: float
) -> LockContention:
    state = "has written" if reply.written else "has not written"
    age_ms = reply.server_ms - reply.acquired_at_ms
    return LockContention(
        f"group {group!r} is held by {reply.owner!r} (fence {reply.fence}, {state}, "
        f"age {age_ms} ms, lease left {reply.lease_left_ms} ms) after {attempts} attempts in "
        f"{elapsed_s:.3f} s"
    )


def _refused(lease: Lease, current_owner: str, current_fence: str) -> FenceRejected:
    """The error of a write refused by the fence check, logged."""
    logger.warning(
        "group lock %r: write under fence %d by %s refused; holder now %s (fence %s)",
        lease.group,
        lease.fence,
        lease.owner,
        current_owner or "nobody",
        current_fence or "-",
    )
    if current_owner:
        now = f"the lock is now held by {current_owner!r} (fence {current_fence})"
    else:
        now = "the lock is free (released, or its lease expired)"
    return FenceRejected(
        f"group {lease.group!r}: write under fence {lease.fence} by {lease.owner!r} refused "
        f"because its lease expired; {now}; the delivery must be retried"
    )


def _sleep_ms(delay_ms: int) -> None:
    """Sleep at least ``delay_ms`` on the monotonic clock, immune to wall-clock steps."""
    deadline = time.monotonic() + delay_ms / 1000
    remaining = delay_ms / 1000
    while remaining > 0:
        time.sleep(remaining)
        remaining = deadline - time.monotonic()
