"""Outcome records: no side effect without a recorded outcome (seed 002).

The outcome of a delivery (the output events, with their deterministic ids) is recorded in
Redis *before* any output is published. A redelivered event whose outcome is recorded
republishes the recorded outputs instead of running the code again (``wm.dataplane.outputs`` makes
that republish reach each plain subscription once).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from wm.config import Settings
from wm.events import CloudEvent, decode, encode
from wm.state.connection import StatePipeline, StateRedis, queue_eval, redis_errors, redis_for
from wm.state.ledger import Settlement

#: ``wm:outcome:{<worker id>}:<event key>``: tagged with the worker's id, like its pending
#: ledger and directory entry, so the record script and the directory's MGET touch one slot.
_OUTCOME = "wm:outcome:"
# KEYS: outcome, the worker's pending index[, its runs], all tagged {<worker id>}.
# ARGV: outputs, ttl s, index member, event key. Returns nil when recorded, else the outcome
# recorded before.
_RECORD = """
local stored = false
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  stored = redis.call('GET', KEYS[1])
end
redis.call('ZREM', KEYS[2], ARGV[3])
if KEYS[3] then redis.call('HDEL', KEYS[3], ARGV[4]) end
return stored
"""


class Outcomes:
    """Recorded outcomes keyed by worker id and input event key (source + id)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ttl_s = settings.outcome_ttl_s

    @property
    def redis(self) -> StateRedis:
        return redis_for(self.settings)

    @staticmethod
    def key(worker_id: str, event_key: str) -> str:
        return f"{_OUTCOME}{{{worker_id}}}:{event_key}"

    def get(self, worker_id: str, event_key: str) -> list[CloudEvent] | None:
        """The recorded outputs, or None when this event has no recorded outcome."""
        with redis_errors(self.settings):
            return self.parse(self.redis.get(self.key(worker_id, event_key)))

    @staticmethod
    def parse(raw: bytes | str | None) -> list[CloudEvent] | None:
        return None if raw is None else [decode(item) for item in json.loads(raw)]

    def record(
        self,
        worker_id: str,
        event_key: str,
        outputs: list[CloudEvent],
        settlement: Settlement,
        also: Callable[[StatePipeline], None] | None = None,
    ) -> tuple[list[CloudEvent], list[Any]]:
        """Record the outcome and settle the delivery in the pending ledger, in one script;
        return the outcome that counts: when two copies of a delivery ran at once, the
        first record wins and both publish it. ``also`` may queue more commands in the same
        round trip; their results come second (on a Redis Cluster, a round trip to each
        node their keys live on, sent together)."""
        key = self.key(worker_id, event_key)
        keys = [key, settlement.index] + ([settlement.runs] if settlement.runs else [])
        value = json.dumps([encode(e) for e in outputs])
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            queue_eval(pipe, _RECORD, keys, value, self.ttl_s, settlement.member, settlement.key)
            if also is not None:
                also(pipe)
            stored, *more = pipe.execute()
        return (outputs if stored is None else self.parse(stored) or []), more
