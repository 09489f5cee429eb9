"""How often one message went back to its queue unsettled, and since when.

A requeue (``basic.reject`` with ``requeue``) hands the broker the very message it
delivered: nothing in it can count its returns, so the count lives here, per message — its
Celery task id and its number of resends (a retry or a wait is a new message with the same
id) — in a hash tagged with both (``wm:requeues:{<task id>:<resends>}``). The hash lives
as long as the requeue limit after its last requeue: a message that stops looping is
forgotten; one that loops on has its first requeue's time kept.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from wm.config import Settings
from wm.state.connection import redis_errors, redis_for

_REQUEUES = "wm:requeues:"
# KEYS: the message's hash. ARGV: now, seconds to keep it. Returns {requeues, first's time}.
_COUNT = """
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
redis.call('HSETNX', KEYS[1], 'since', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {n, redis.call('HGET', KEYS[1], 'since')}
"""


class Requeued(NamedTuple):
    """A message's requeues so far (this one included), and the time of its first."""

    times: int
    since: float

    def looping_s(self, now: float) -> float:
        return max(0.0, now - self.since)


def requeues_key(task_id: str, resends: int) -> str:
    return f"{_REQUEUES}{{{task_id}:{resends}}}"


class Requeues:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def count(self, task_id: str, resends: int) -> Requeued:
        """Count one more requeue of the message; raises ``BrokerUnavailable`` when Redis
        is out of reach (then nothing can be counted, and the outage bounds the loop)."""
        keep_s = max(1, int(self.settings.requeue_limit_s) + 1)
        with redis_errors(self.settings):
            n, since = redis_for(self.settings).eval(
                _COUNT, 1, requeues_key(task_id, resends), repr(time.time()), keep_s
            )
        return Requeued(int(n), float(since))
