"""Pending deliveries: a safety net under the broker's at-least-once promise.

kombu's Redis transport takes a message off its queue (BRPOP) and only then records it as
unacknowledged: a node killed between the two loses the message, and so does one killed
while Redis's reply is in flight. So every delivery to a worker is also written here before
it is sent, and settled once its outcome is recorded or it is dead-lettered. The nodes'
reconcile loop sends again what stayed pending longer than WM_REDELIVER_AFTER_S. A second
copy is harmless: a delivery whose outcome is recorded republishes instead of re-running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import redis
from redis.client import Pipeline

from wm.config import Settings
from wm.state.connection import redis_errors, redis_for

logger = logging.getLogger(__name__)
_PENDING = "wm:pending:"
_SWEEP_LOCK = "wm:pending:sweeper"
_RESTART_CLOCKS = """
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
for i = 1, #members, 500 do
  local batch = {}
  for j = i, math.min(i + 499, #members) do
    batch[#batch + 1] = ARGV[1]
    batch[#batch + 1] = members[j]
  end
  redis.call('ZADD', KEYS[1], 'XX', unpack(batch))
end
return #members
"""


class Ledger:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @property
    def redis(self) -> redis.Redis:
        return redis_for(self.settings)

    @staticmethod
    def _keys(worker_id: str) -> tuple[str, str]:
        return f"{_PENDING}{{{worker_id}}}", f"{_PENDING}{{{worker_id}}}:body"

    @staticmethod
    def _runs(worker_id: str) -> str:
        return f"{_PENDING}{{{worker_id}}}:runs"

    def add(self, deliveries: Iterable[tuple[str, str]], key: str, payload: str) -> None:
        """Record the event ``key`` as pending for each (worker id, queue) before it is sent."""
        now = time.time()
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            for worker_id, _ in deliveries:
                index, bodies = self._keys(worker_id)
                pipe.zadd(index, {key: now}, nx=True)
                pipe.hset(bodies, key, payload)
            pipe.execute()

    def settle(self, worker_id: str, key: str) -> None:
        """The delivery is done (outcome recorded, or dead-lettered): forget it."""
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            self.settling(worker_id, key)(pipe)
            pipe.execute()

    def settling(self, worker_id: str, key: str) -> Callable[[Pipeline], None]:
        """Queues :meth:`settle` in a pipeline (the outcome record's, for one)."""
        index, bodies = self._keys(worker_id)
        runs = self._runs(worker_id)

        def queue(pipe: Pipeline) -> None:
            pipe.zrem(index, key)
            pipe.hdel(bodies, key)
            pipe.hdel(runs, key)

        return queue

    def begin_run(self, worker_id: str, key: str) -> int:
        """Count a run of a delivery the broker sent again because the process that had it
        died; returns the runs begun and not ended (by :meth:`end_run` or :meth:`settle`)."""
        with redis_errors(self.settings):
            return int(self.redis.hincrby(self._runs(worker_id), key, 1))

    def end_run(self, worker_id: str, key: str) -> None:
        """The run ended, with an error the delivery's policy handles: its process lived."""
        with redis_errors(self.settings):
            self.redis.hdel(self._runs(worker_id), key)

    def restart_clocks(self, worker_id: str) -> None:
        """A worker starts again: time spent stopped is not time a broker lost a message."""
        with redis_errors(self.settings):
            self.redis.eval(_RESTART_CLOCKS, 1, self._keys(worker_id)[0], time.time())

    def forget_worker(self, worker_id: str) -> None:
        """A deleted worker's queue is gone, and so are its pending deliveries."""
        with redis_errors(self.settings):
            self.redis.delete(*self._keys(worker_id), self._runs(worker_id))

    def pending(self, worker_id: str) -> int:
        return self.pending_of([worker_id])[worker_id]

    def pending_of(self, worker_ids: list[str]) -> dict[str, int]:
        """Pending deliveries per worker, in one round trip."""
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            for worker_id in worker_ids:
                pipe.zcard(self._keys(worker_id)[0])
            counts = pipe.execute()
        return {w: int(n) for w, n in zip(worker_ids, counts, strict=True)}

    def overdue_keys(self, worker_id: str, older_than_s: float) -> list[str]:
        """Event keys of deliveries pending longer than ``older_than_s``, oldest first."""
        with redis_errors(self.settings):
            found = self.redis.zrangebyscore(
                self._keys(worker_id)[0], 0, time.time() - older_than_s
            )
        return [key.decode() for key in found]  # type: ignore[union-attr]

    def payloads(self, worker_id: str, keys: list[str]) -> dict[str, str]:
        """The payloads of the pending deliveries ``keys`` (settled ones are left out)."""
        if not keys:
            return {}
        with redis_errors(self.settings):
            found = self.redis.hmget(self._keys(worker_id)[1], keys)
        return {k: p.decode() for k, p in zip(keys, found, strict=True) if p is not None}  # type: ignore[union-attr]

    def restart_clock(self, worker_id: str, keys: list[str]) -> None:
        """Deliveries sent again: each is sent again at most once per period."""
        if keys:
            with redis_errors(self.settings):
                self.redis.zadd(self._keys(worker_id)[0], dict.fromkeys(keys, time.time()), xx=True)

    def claim_sweep(self, period_s: float) -> bool:
        """One node sweeps at a time, at most once per period."""
        with redis_errors(self.settings):
            claimed = self.redis.set(_SWEEP_LOCK, 1, nx=True, px=max(1, int(period_s * 900)))
        return bool(claimed)
