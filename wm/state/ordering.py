"""Ordered keys (``ordering: key``, DESIGN.md §5.3): events with the same ``partitionkey``
reach a worker one at a time, in publish order, retries included.

Each key's state is a hash ``wm:order:{<worker>}:key:<key>``: ``last``, the last number
given, ``next``, the number whose turn it is, and ``seen``, when the head last ran or the turn
last moved. Sending numbers each event per (worker, partition key) (:func:`number_command`,
in the pending ledger's write, no extra round trip). A delivery runs in its turn; a later
one waits (in the broker, like a group lock's waiter) until the head succeeds or is
dead-lettered; an earlier one (a replayed or duplicate event) runs at once. A number that
never arrives (its publisher failed between numbering and sending) holds its key at most the
worker's ``ordering_gap_s`` without any run of the head; then the turn skips it.

A key's hash ends :data:`KEY_TTL_S` after every number given has had its turn, so keys that go
quiet (a customer's, an order's) leave nothing behind; while a number may still be on its
way (queued, retried, its worker stopped) it has no end. A key whose hash ended goes on from
the number due when it is next numbered. Earlier releases kept the last numbers in one hash
per worker (``wm:order:{<worker>}:seq``, with no end); a key numbered there moves its number
into its own hash when it is next numbered.
"""

from __future__ import annotations

import time

from wm.config import Settings
from wm.errors import LockContention
from wm.state.connection import redis_errors, redis_for, text

#: The CloudEvents partitioning extension.
PARTITION_EXTENSION = "partitionkey"
#: Longest wait (s) of an event for its turn before it looks again.
WAIT_MAX_S = 1.0
#: Seconds a partition key's hash lasts once its last number has had its turn.
KEY_TTL_S = 7 * 24 * 3600
GO, WAIT, LATE, SKIP = "go", "wait", "late", "skip"

#: ``ends(turn, legacy, partition)``: a key's hash lasts KEY_TTL_S once every number given
#: (its own last, else the one in the worker's hash of earlier releases) has had its turn,
#: and has no end while one may still be on its way (queued, retried, its worker stopped):
#: its turn must outlast it.
ENDS_FUNCTION = f"""
local function ends(turn, legacy, partition)
  local last = redis.call('HGET', turn, 'last') or redis.call('HGET', legacy, partition) or '0'
  if tonumber(redis.call('HGET', turn, 'next') or '1') > tonumber(last) then
    redis.call('EXPIRE', turn, {KEY_TTL_S})
  else
    redis.call('PERSIST', turn)
  end
end
"""
#: ``number(turn, legacy, partition)``: the next number of a partition key, kept in its hash
#: (``turn``), which has no end until that number's turn has passed. A hash without a last
#: number (ended, or from an earlier release) goes on from the number due or, if higher, the
#: key's number in the worker's hash of earlier releases (``legacy``), which is moved in.
NUMBER_FUNCTION = """
local function number(turn, legacy, partition)
  if redis.call('HEXISTS', turn, 'last') == 0 then
    local last = tonumber(redis.call('HGET', turn, 'next') or '1') - 1
    local before = redis.call('HGET', legacy, partition)
    if before then
      last = math.max(last, tonumber(before))
      redis.call('HDEL', legacy, partition)
    end
    redis.call('HSET', turn, 'last', last)
  end
  local n = redis.call('HINCRBY', turn, 'last', 1)
  redis.call('PERSIST', turn)
  return n
end
"""
# KEYS: the key's hash, the worker's hash of earlier releases. ARGV: the partition key.
_NUMBER = NUMBER_FUNCTION + "return number(KEYS[1], KEYS[2], ARGV[1])\n"


class NotYourTurn(LockContention):
    """Raised when an ordered event's predecessor under its key has not finished: it waits in
    the broker (at most :data:`WAIT_MAX_S` between looks), without counting a failure."""


# KEYS: the key's hash, the worker's hash of earlier releases. ARGV: number, now, gap,
# partition key. Returns the verdict and the number due.
_TURN = (
    ENDS_FUNCTION
    + """
local due = tonumber(redis.call('HGET', KEYS[1], 'next') or '1')
local seq, now = tonumber(ARGV[1]), tonumber(ARGV[2])
if seq < due then return {'late', due} end
if seq == due then
  redis.call('HSET', KEYS[1], 'seen', ARGV[2])
  ends(KEYS[1], KEYS[2], ARGV[4])
  return {'go', due}
end
local seen = tonumber(redis.call('HGET', KEYS[1], 'seen') or '0')
if seen == 0 then
  redis.call('HSET', KEYS[1], 'seen', ARGV[2])
  ends(KEYS[1], KEYS[2], ARGV[4])
  return {'wait', due}
end
if now - seen > tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[1], 'next', seq, 'seen', ARGV[2])
  ends(KEYS[1], KEYS[2], ARGV[4])
  return {'skip', due}
end
return {'wait', due}
"""
)
# KEYS: the key's hash, the worker's hash of earlier releases. ARGV: the number done, now,
# partition key. Moves the turn past it if it was due.
_ADVANCE = (
    ENDS_FUNCTION
    + """
local due = tonumber(redis.call('HGET', KEYS[1], 'next') or '1')
if due == tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'next', due + 1, 'seen', ARGV[2])
  ends(KEYS[1], KEYS[2], ARGV[3])
  return 1
end
return 0
"""
)


def legacy_sequence_key(worker_id: str) -> str:
    """The hash of partition key → last number in which earlier releases numbered events."""
    return f"wm:order:{{{worker_id}}}:seq"


def turn_key(worker_id: str, partition: str) -> str:
    return f"wm:order:{{{worker_id}}}:key:{partition}"


def number_command(worker_id: str, partition: str) -> tuple[str, list[str], str]:
    """(script, keys, argument) that number an event of ``partition`` for ``worker_id``
    (``wm.state.connection.queue_eval``)."""
    return _NUMBER, [turn_key(worker_id, partition), legacy_sequence_key(worker_id)], partition


class Ordering:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def turn(self, worker_id: str, partition: str, seq: int, gap_s: float) -> tuple[str, int]:
        """(verdict, number due): :data:`GO`, :data:`WAIT`, :data:`LATE` (its turn passed:
        run it unordered) or :data:`SKIP` (the number due never came: the turn moved here)."""
        with redis_errors(self.settings):
            verdict, due = redis_for(self.settings).eval(
                _TURN, 2, *self._keys(worker_id, partition), seq, time.time(), gap_s, partition
            )
        return text(verdict), int(due)

    def advance(self, worker_id: str, partition: str, seq: int) -> None:
        """Number ``seq`` is done (succeeded or dead-lettered): the next one's turn."""
        with redis_errors(self.settings):
            redis_for(self.settings).eval(
                _ADVANCE, 2, *self._keys(worker_id, partition), seq, time.time(), partition
            )

    @staticmethod
    def _keys(worker_id: str, partition: str) -> tuple[str, str]:
        return turn_key(worker_id, partition), legacy_sequence_key(worker_id)

    def keys_of(self, worker_id: str) -> list[str]:
        """The worker's keys: its numbers and each partition key's turn."""
        with redis_errors(self.settings):
            found = redis_for(self.settings).scan_iter(
                match=f"wm:order:{{{worker_id}}}:*", count=500
            )
            return [text(key) for key in found]

    def forget_worker(self, worker_id: str) -> None:
        """A deleted worker's numbers and turns."""
        keys = self.keys_of(worker_id)
        with redis_errors(self.settings):
            for start in range(0, len(keys), 500):
                redis_for(self.settings).delete(*keys[start : start + 500])
