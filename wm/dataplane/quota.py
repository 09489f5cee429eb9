"""``max_events`` (issue 14): a worker that has processed its quota is ``finished``.

A natural end, distinct from ``stopped`` (asked for) and ``failed`` (an error): the per-worker
setting ``max_events`` (0 or absent: no limit) counts successful deliveries in Redis
(``wm:events-done:{<id>}``). Each delivery takes a slot before it runs and gives it back if it
does not succeed, so concurrent deliveries never run more than the quota; the one that fills
it moves the worker ``running → finished`` and every node stops consuming. What is left in the
queue stays there: ``start`` runs the worker again with a fresh quota.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from celery.exceptions import Reject

from wm.config import Settings
from wm.dataplane import outbox
from wm.dataplane.bus import Bus
from wm.dataplane.delivery import REQUEUE_PAUSE_S, Runtime
from wm.lifecycle import Status
from wm.state.connection import redis_errors, redis_for
from wm.state.directory import WorkerMeta

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


def limit_of(meta: WorkerMeta) -> int:
    return int(meta.settings.get("max_events") or 0)


@contextmanager
def slot(rt: Runtime, meta: WorkerMeta) -> Iterator[None]:
    """Run the block in one of the worker's ``max_events`` slots (no limit: just run it)."""
    limit = limit_of(meta)
    if not limit:
        yield
        return
    redis, key = redis_for(rt.settings), done_key(meta.id)
    with redis_errors(rt.settings):
        taken = int(redis.eval(_TAKE, 1, key, limit))
    if not taken:
        time.sleep(REQUEUE_PAUSE_S)
        raise Reject(f"worker {meta.id} has processed its max_events; requeued", requeue=True)
    try:
        yield
    except BaseException:
        with redis_errors(rt.settings):
            redis.decr(key)
        raise
    if taken == limit:
        finish(rt.settings, rt.bus, meta, limit)


def finish(settings: Settings, bus: Bus, meta: WorkerMeta, limit: int) -> None:
    """``running → finished`` (if still running); consumers cancelled on every node."""
    reason = f"finished: processed its max_events ({limit})"
    outbox.leave_running(settings, bus, uuid.UUID(meta.id), Status.FINISHED, reason, actor="node")


def reset(settings: Settings, worker_id: str) -> None:
    """A fresh quota (the worker is started again)."""
    with redis_errors(settings):
        redis_for(settings).delete(done_key(worker_id))
