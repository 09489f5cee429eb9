"""Group locks with fencing tokens, kept in Redis (DESIGN §6).

Workers of one group must not process messages concurrently. A lock is a Redis hash holding
the owner, a fence, the acquisition time (Redis server clock) and a *written* flag. Every
operation is one Lua script, so it is atomic and costs one round trip: an uncontended
acquire plus release is two round trips.

* Acquire mints a fence with ``INCR`` on a counter that is never reset, so fences of a group
  increase strictly across releases, steals and expiries.
* A lock older than ``group_lock_max_age_s`` may be stolen, but only while its holder has not
  written: a slow but valid holder that already published keeps its lock, so one message is
  never processed to completion twice.
* Before each side effect the holder calls :meth:`GroupLocks.mark_write`, the atomic fence
  check: it marks the write, or refuses a holder whose lock was stolen.
* A holder that wrote can never be robbed, so the lock of a holder that crashed after writing
  would stay until deleted by hand. The record therefore expires :data:`SAFETY_TTL_FACTOR` *
  max age after it was taken (5 min by default): far beyond any legitimate processing (the
  per-message time limit is 30 s), short enough for the group to recover by itself. Writes do
  not extend it; a holder still running at expiry has its next :meth:`GroupLocks.mark_write`
  refused, which is the safe outcome.

Keys are ``<prefix>{<group>}`` (the record) and ``<prefix>{<group>}:fence`` (the counter);
the hash tag keeps both on one cluster slot, as a Lua script touching both requires.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypedDict

import redis

from wm.config import Settings
from wm.errors import FenceRejected, LockContention
from wm.state.connection import redis_errors, redis_for

__all__ = [
    "MIN_SAFETY_TTL_MS",
    "SAFETY_TTL_FACTOR",
    "GroupLocks",
    "Holder",
    "Lease",
    "make_owner",
]

logger = logging.getLogger(__name__)

#: Lifetime of a lock record as a multiple of the lock max age (dimensionless).
SAFETY_TTL_FACTOR = 10
#: Floor of the lock record lifetime (ms), so a max age of 0 never expires a lock at once.
MIN_SAFETY_TTL_MS = 1000

#: Shortest BLPOP wait worth a round trip (BLPOP with timeout 0 blocks for ever).
_MIN_BLOCK_S = 0.001
_HELD = "held"
_STOLEN = "stolen"

# KEYS: record, fence counter. ARGV: owner, max age ms, safety ttl ms.
# Reply: status, owner, fence, acquired_at_ms, written, server_ms[, previous owner, fence].
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'owner', 'fence', 'acquired_at_ms', 'written')
local status = 'acquired'
if cur[1] then
  if cur[1] == ARGV[1] then
    return {'acquired', cur[1], cur[2], cur[3], cur[4], now}
  end
  if cur[4] == '1' or now - tonumber(cur[3]) <= tonumber(ARGV[2]) then
    return {'held', cur[1], cur[2], cur[3], cur[4], now}
  end
  status = 'stolen'
end
local fence = redis.call('INCR', KEYS[2])
local at = string.format('%d', now)
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence, 'acquired_at_ms', at,
           'written', '0')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if status == 'stolen' then
  return {status, ARGV[1], fence, at, '0', now, cur[1], cur[2]}
end
return {status, ARGV[1], fence, at, '0', now}
"""

# KEYS: record. ARGV: owner, fence. Reply: {1} or {0, current owner, current fence}.
_MARK_WRITE_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'fence')
if cur[1] == ARGV[1] and cur[2] == ARGV[2] then
  redis.call('HSET', KEYS[1], 'written', '1')
  return {1}
end
return {0, cur[1] or '', cur[2] or ''}
"""

# KEYS: record, wake list. ARGV: owner, fence, wake ttl ms. Reply: 1 when deleted, else 0.
# A release leaves one wake-up token, so one waiting contender retries at once.
_RELEASE_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'fence')
if cur[1] == ARGV[1] and cur[2] == ARGV[2] then
  redis.call('DEL', KEYS[1])
  redis.call('RPUSH', KEYS[2], 1)
  redis.call('LTRIM', KEYS[2], -1, -1)
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Lease:
    """Proof of holding a group lock; its fence goes on every output as an attribute."""

    group: str
    owner: str
    fence: int
    acquired_at_ms: int


class Holder(TypedDict):
    """What operators see of a held lock."""

    owner: str
    fence: int
    acquired_at_ms: int
    written: bool


@dataclass(frozen=True)
class _AcquireReply:
    status: str
    owner: str
    fence: int
    acquired_at_ms: int
    written: bool
    server_ms: int
    previous_owner: str = ""
    previous_fence: int = 0

    @classmethod
    def parse(cls, raw: list[Any]) -> _AcquireReply:
        status, owner, fence, acquired_at_ms, written, server_ms, *previous = raw
        return cls(
            status=_text(status),
            owner=_text(owner),
            fence=int(fence),
            acquired_at_ms=int(acquired_at_ms),
            written=_text(written) == "1",
            server_ms=int(server_ms),
            previous_owner=_text(previous[0]) if previous else "",
            previous_fence=int(previous[1]) if previous else 0,
        )


def make_owner(task_id: str) -> str:
    """Owner id unique per delivery attempt, readable by an operator looking at a stuck lock."""
    return f"{socket.gethostname()}:{os.getpid()}:{task_id}"


class GroupLocks:
    """Fenced mutual exclusion per worker group, one Redis round trip per operation."""

    def __init__(
        self,
        settings: Settings,
        *,
        client: redis.Redis | None = None,
        prefix: str = "wm:lock:",
    ) -> None:
        self._redis = client = client if client is not None else redis_for(settings)
        self._settings = settings
        self._prefix = prefix
        self._max_age_ms = round(settings.group_lock_max_age_s * 1000)
        self._safety_ttl_ms = max(SAFETY_TTL_FACTOR * self._max_age_ms, MIN_SAFETY_TTL_MS)
        self._acquire_script = client.register_script(_ACQUIRE_LUA)
        self._mark_write_script = client.register_script(_MARK_WRITE_LUA)
        self._release_script = client.register_script(_RELEASE_LUA)

    def try_acquire(self, group: str, owner: str) -> Lease | None:
        """Take the lock if free or stealable, in one round trip; ``None`` if someone holds it.

        Calling again with the owner that already holds the lock returns the same lease, so a
        round trip retried after a lost reply cannot lock the owner out of its own lock.
        """
        reply = self._attempt(group, owner)
        return None if reply.status == _HELD else _lease(group, reply)

    def acquire(self, group: str, owner: str) -> Lease:
        """Take the lock, retrying with backoff; raise :class:`LockContention` when it stays held.

        The first attempt is followed by up to ``group_lock_max_retries`` retries, retry *n*
        after a wait of up to ``base * 2**n`` ms (500 ms → 1 s → 2 s by default) that ends
        early when the holder releases. Giving up quickly
        lets the broker redeliver later instead of pinning a worker process on one group.
        """
        started = time.monotonic()
        reply = self._attempt(group, owner)
        retry = 0
        while reply.status == _HELD and retry < self._settings.group_lock_max_retries:
            delay_ms = self._settings.group_lock_retry_base_delay_ms * 2**retry
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

    def mark_write(self, lease: Lease) -> None:
        """Fence check before a side effect: record the write, or refuse a robbed holder.

        Marking the write is what makes the lock unstealable, so a slow holder that already
        published finishes its message instead of having it processed a second time.
        """
        with redis_errors(self._settings):
            raw = self._mark_write_script(
                keys=[self._record_key(lease.group)], args=[lease.owner, lease.fence]
            )
        if int(raw[0]) == 1:
            return
        current_owner, current_fence = _text(raw[1]), _text(raw[2])
        logger.warning(
            "group lock %r: write under fence %d by %s refused; holder now %s (fence %s)",
            lease.group,
            lease.fence,
            lease.owner,
            current_owner or "nobody",
            current_fence or "-",
        )
        raise FenceRejected(_fence_message(lease, current_owner, current_fence))

    def release(self, lease: Lease) -> bool:
        """Delete the lock if this lease still holds it; ``False`` leaves someone else's lock."""
        with redis_errors(self._settings):
            released = int(
                self._release_script(
                    keys=[self._record_key(lease.group), self._wake_key(lease.group)],
                    args=[lease.owner, lease.fence, self._wake_ttl_ms()],
                )
            )
        if not released:
            logger.warning(
                "group lock %r no longer held by %s (fence %d) at release",
                lease.group,
                lease.owner,
                lease.fence,
            )
        return released == 1

    @contextmanager
    def holding(self, group: str, owner: str) -> Iterator[Lease]:
        """Hold the group lock for a block and release it however the block ends."""
        lease = self.acquire(group, owner)
        try:
            yield lease
        finally:
            self.release(lease)

    def holder(self, group: str) -> Holder | None:
        """Current holder of a group lock, for operators and tests; ``None`` when free."""
        with redis_errors(self._settings):
            raw: dict[Any, Any] = self._redis.hgetall(self._record_key(group))
        if not raw:
            return None
        fields = {_text(key): _text(value) for key, value in raw.items()}
        return Holder(
            owner=fields["owner"],
            fence=int(fields["fence"]),
            acquired_at_ms=int(fields["acquired_at_ms"]),
            written=fields["written"] == "1",
        )

    def _attempt(self, group: str, owner: str) -> _AcquireReply:
        if not group or not owner:
            raise ValueError("group and owner must be non-empty")
        with redis_errors(self._settings):
            raw = self._acquire_script(
                keys=[self._record_key(group), self._fence_key(group)],
                args=[owner, self._max_age_ms, self._safety_ttl_ms],
            )
        reply = _AcquireReply.parse(raw)
        if reply.status == _STOLEN:
            logger.warning(
                "group lock %r stolen by %s (fence %d) from %s (fence %d), "
                "which had not written within %d ms",
                group,
                owner,
                reply.fence,
                reply.previous_owner,
                reply.previous_fence,
                self._max_age_ms,
            )
        return reply

    def _record_key(self, group: str) -> str:
        return f"{self._prefix}{{{group}}}"

    def _fence_key(self, group: str) -> str:
        return f"{self._prefix}{{{group}}}:fence"

    def _wake_key(self, group: str) -> str:
        return f"{self._prefix}{{{group}}}:wake"

    def _wake_ttl_ms(self) -> int:
        return max(1000, self._settings.group_lock_retry_base_delay_ms * 4)

    def _wait_for_release(self, group: str, owner: str, delay_ms: int) -> _AcquireReply:
        """One backoff step: wait ``delay_ms`` for the lock, trying again whenever a release
        leaves a wake-up token (BLPOP) — the lock is handed on without idle time, and the
        time a contender waits in all is still the sum of its backoffs."""
        deadline = time.monotonic() + delay_ms / 1000
        while True:
            remaining = deadline - time.monotonic()
            if remaining < _MIN_BLOCK_S:  # BLPOP's timeout 0 would block for ever
                return self._attempt(group, owner)
            with redis_errors(self._settings):
                woken = self._redis.blpop([self._wake_key(group)], timeout=remaining)
            if woken is None:
                _sleep_ms(int(max(0.0, deadline - time.monotonic()) * 1000))
                return self._attempt(group, owner)
            reply = self._attempt(group, owner)
            if reply.status != _HELD:
                return reply


def _lease(group: str, reply: _AcquireReply) -> Lease:
    return Lease(
        group=group, owner=reply.owner, fence=reply.fence, acquired_at_ms=reply.acquired_at_ms
    )


def _contention(
    group: str, reply: _AcquireReply, attempts: int, elapsed_s: float
) -> LockContention:
    state = "has written" if reply.written else "has not written"
    age_ms = reply.server_ms - reply.acquired_at_ms
    return LockContention(
        f"group {group!r} is held by {reply.owner!r} (fence {reply.fence}, {state}, "
        f"age {age_ms} ms) after {attempts} attempts in {elapsed_s:.3f} s; "
        "the delivery should be retried later"
    )


def _fence_message(lease: Lease, current_owner: str, current_fence: str) -> str:
    if current_owner:
        now = f"the lock is now held by {current_owner!r} (fence {current_fence})"
    else:
        now = "the lock is free (released, or expired after its safety TTL)"
    return (
        f"group {lease.group!r}: write under fence {lease.fence} by {lease.owner!r} refused; "
        f"{now}; the delivery must be retried"
    )


def _sleep_ms(delay_ms: int) -> None:
    """Sleep at least ``delay_ms`` on the monotonic clock, immune to wall-clock steps."""
    deadline = time.monotonic() + delay_ms / 1000
    remaining = delay_ms / 1000
    while remaining > 0:
        time.sleep(remaining)
        remaining = deadline - time.monotonic()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
