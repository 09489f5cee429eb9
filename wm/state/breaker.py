"""The circuit breaker's counts (issue 14; seed 002's back-off 2 s → 2 min).

Per worker, two Redis counters tagged with its id: the consecutive failed delivery attempts
(``wm:breaker:{<id>}``, read with the worker's directory entry in the delivery's one MGET,
so a success costs nothing more unless there were failures to forget) and how often the
breaker opened in a row (``wm:breaker-trips:{<id>}``), which sets the next back-off.

A failure that brings the count to the threshold opens the breaker (exactly once: the
script answers the trip number only to the failure that reached it). Half-open, after the
back-off, the count is set one short of the threshold: the next failure opens it again
with a doubled back-off, a success forgets both counters (closed).
"""

from __future__ import annotations

from wm.config import Settings
from wm.state.connection import StateRedis, redis_errors, redis_for

_FAILURES = "wm:breaker:"
_TRIPS = "wm:breaker-trips:"
#: How long the counters live without a new failure (a worker failing once a week never trips).
COUNT_TTL_S = 24 * 3600
# KEYS: failures, trips. ARGV: threshold, ttl. Returns {failures in a row, the trip number
# when this failure opened the breaker, else 0}.
_FAILED = """
local n = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
if n == tonumber(ARGV[1]) then
  local trips = redis.call('INCR', KEYS[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  return {n, trips}
end
return {n, 0}
"""


def failures_key(worker_id: str) -> str:
    return f"{_FAILURES}{{{worker_id}}}"


def trips_key(worker_id: str) -> str:
    return f"{_TRIPS}{{{worker_id}}}"


class Breaker:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @property
    def redis(self) -> StateRedis:
        return redis_for(self.settings)

    def failed(self, worker_id: str, threshold: int) -> tuple[bool, int]:
        """Count a failed attempt: (whether the breaker is open, the trip number if this
        failure opened it, else 0). With ``threshold`` 0 the breaker is off (never open),
        and the count goes on for the worker's health (``wm.state.health``)."""
        limit = max(0, threshold)
        keys = (failures_key(worker_id), trips_key(worker_id))
        with redis_errors(self.settings):
            count, trips = self.redis.eval(_FAILED, 2, *keys, limit, COUNT_TTL_S)
        return bool(limit) and int(count) >= limit, int(trips)

    def succeeded(self, worker_id: str) -> None:
        """A delivery succeeded: the breaker is closed, its back-off starts over."""
        with redis_errors(self.settings):
            self.redis.delete(failures_key(worker_id), trips_key(worker_id))

    def half_open(self, worker_id: str, threshold: int) -> None:
        """After the back-off: one more failure opens the breaker again."""
        with redis_errors(self.settings):
            self.redis.set(failures_key(worker_id), max(0, threshold - 1), ex=COUNT_TTL_S)

    def trips(self, worker_id: str) -> int:
        with redis_errors(self.settings):
            return int(self.redis.get(trips_key(worker_id)) or 0)
