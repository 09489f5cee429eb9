"""A worker's count of successful deliveries against its ``max_events`` (the ``quota``
feature of ``wm.dataplane.features``): ``wm:events-done:{<id>}``."""

from __future__ import annotations

from wm.config import Settings
from wm.state.connection import redis_errors, redis_for

_DONE = "wm:events-done:"
# KEYS: the count. ARGV: the limit. Returns the slot taken (1..limit), or 0 when full.
_TAKE = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(ARGV[1]) then
  redis.call('DECR', KEYS[1])
  return 0
end
return n
"""


def done_key(worker_id: str) -> str:
    return f"{_DONE}{{{worker_id}}}"


def take(settings: Settings, worker_id: str, limit: int) -> int:
    """One of the worker's ``limit`` slots: its number (1..limit), or 0 when all are taken."""
    with redis_errors(settings):
        return int(redis_for(settings).eval(_TAKE, 1, done_key(worker_id), limit))


def give_back(settings: Settings, worker_id: str) -> None:
    """The delivery that took a slot did not succeed."""
    with redis_errors(settings):
        redis_for(settings).decr(done_key(worker_id))


def reset(settings: Settings, worker_id: str) -> None:
    """A fresh quota (the worker is started again)."""
    with redis_errors(settings):
        redis_for(settings).delete(done_key(worker_id))
