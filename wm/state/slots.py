"""``max_concurrency`` (issue 14): at most N deliveries of one worker run at once, across
every node (a group is the special case of a shared limit of 1, with fencing on top).

A sorted set per worker (``wm:slots:{<id>}``) holds the deliveries running, each scored with
the time its slot expires: its time limit plus a grace, so a slot whose holder was killed
frees itself without a heartbeat. Taking a slot first drops the expired ones. A delivery
that finds every slot taken raises :class:`~wm.errors.LockContention`: like a group member,
it waits in the broker (``wm.dataplane.features.contention``) and uses up none of its retries.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from wm.config import Settings
from wm.errors import LockContention
from wm.state.connection import redis_errors, redis_for

_SLOTS = "wm:slots:"
# KEYS: the slots. ARGV: holder, hold ms, limit. Returns 1 when taken, else 0. The server's
# clock, so every node measures expiry alike.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
local expiry = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], expiry, ARGV[1])
redis.call('PEXPIREAT', KEYS[1], expiry)
return 1
"""


def slots_key(worker_id: str) -> str:
    return f"{_SLOTS}{{{worker_id}}}"


class Slots:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @contextmanager
    def hold(self, worker_id: str, holder: str, limit: int, hold_s: float) -> Iterator[None]:
        """Run the block in one of ``limit`` slots, kept at most ``hold_s`` seconds."""
        redis, key = redis_for(self.settings), slots_key(worker_id)
        with redis_errors(self.settings):
            taken = int(redis.eval(_TAKE, 1, key, holder, int(hold_s * 1000), limit))
        if not taken:
            raise LockContention(
                f"worker {worker_id} runs {limit} deliveries already (max_concurrency)"
            )
        try:
            yield
        finally:
            with redis_errors(self.settings):
                redis.zrem(key, holder)
