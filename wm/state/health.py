"""A worker's health, orthogonal to its status (issue 14, point 2; seed 003).

``healthy | degraded | unhealthy | unknown``, judged from its real deliveries:

- the error rate over the last :data:`WINDOW_MIN` minutes, from per-minute counts in a hash
  per worker (``wm:health:{<id>}``). Each process tallies its deliveries in memory
  (:class:`Tally`) and adds them to Redis at most once every :data:`FLUSH_S`, with the next
  outcome record's round trip (or with a failure's), so the hot path sends no command of its
  own for health: at most one per worker and second per process;
- the failed attempts in a row (the circuit breaker's count, ``wm.state.breaker``).

``unknown``: no delivery in the window. ``unhealthy``: ``health_max_consecutive_failures``
failures in a row (default 3), or an error rate of at least ``health_unhealthy_rate`` (default
0.5). ``degraded``: an error rate of at least ``health_degraded_rate`` (default 0.05). The
maintaining node judges every live worker each reconcile period and keeps the verdict
(``wm:health-state:{<id>}``); a change is a lifecycle event ``health_changed``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from wm.config import Settings
from wm.state.breaker import failures_key
from wm.state.connection import StatePipeline, redis_errors, redis_for, text

HEALTHY, DEGRADED, UNHEALTHY, UNKNOWN = "healthy", "degraded", "unhealthy", "unknown"
#: Minutes of deliveries the error rate is taken over.
WINDOW_MIN = 5
DEFAULT_DEGRADED_RATE = 0.05
DEFAULT_UNHEALTHY_RATE = 0.5
DEFAULT_MAX_CONSECUTIVE_FAILURES = 3
_COUNTS = "wm:health:"
_STATE = "wm:health-state:"
_COUNTS_TTL_S = (WINDOW_MIN + 1) * 60
#: Seconds a process keeps its tally before adding it to Redis.
FLUSH_S = 1.0


def counts_key(worker_id: str) -> str:
    return f"{_COUNTS}{{{worker_id}}}"


def state_key(worker_id: str) -> str:
    return f"{_STATE}{{{worker_id}}}"


def _minute(now: float | None = None) -> int:
    return int((time.time() if now is None else now) // 60)


@dataclass(frozen=True)
class Verdict:
    health: str
    error_rate: float | None
    deliveries: int
    consecutive_failures: int

    @property
    def reason(self) -> str:
        if self.error_rate is None:
            return f"no delivery in the last {WINDOW_MIN} minutes"
        return (
            f"{self.error_rate:.0%} of {self.deliveries} attempts failed in the last "
            f"{WINDOW_MIN} minutes; {self.consecutive_failures} failed in a row"
        )


def judge(ok: int, failed: int, consecutive: int, worker_settings: dict[str, Any]) -> Verdict:
    """The verdict on these counts, with the worker's thresholds."""
    total = ok + failed
    if total == 0 and consecutive == 0:
        return Verdict(UNKNOWN, None, 0, 0)
    rate = failed / total if total else 1.0
    degraded = float(worker_settings.get("health_degraded_rate", DEFAULT_DEGRADED_RATE))
    unhealthy = float(worker_settings.get("health_unhealthy_rate", DEFAULT_UNHEALTHY_RATE))
    in_a_row = int(
        worker_settings.get("health_max_consecutive_failures", DEFAULT_MAX_CONSECUTIVE_FAILURES)
    )
    if (in_a_row and consecutive >= in_a_row) or rate >= unhealthy:
        health = UNHEALTHY
    elif rate >= degraded:
        health = DEGRADED
    else:
        health = HEALTHY
    return Verdict(health, rate, total, consecutive)


class Tally:
    """A process's count of deliveries per worker, minute and outcome, not yet in Redis."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, int, str]] = Counter()
        self._lock = threading.Lock()  # the threads of a ``-P threads`` pool share it
        self._flushed = 0.0  # a process's first count goes out with its first record

    def add(self, worker_id: str, *, ok: bool) -> None:
        with self._lock:
            self._counts[(worker_id, _minute(), "ok" if ok else "failed")] += 1

    def queue_if_due(self, pipe: StatePipeline) -> None:
        """Queue the tally's commands in ``pipe`` if :data:`FLUSH_S` has passed."""
        with self._lock:
            if time.monotonic() - self._flushed < FLUSH_S or not self._counts:
                return
            counts, self._counts = self._counts, Counter()
            self._flushed = time.monotonic()
        for (worker_id, minute, kind), n in counts.items():
            pipe.hincrby(counts_key(worker_id), f"{minute}:{kind}", n)

    def flush_if_due(self, settings: Settings) -> None:
        """Add the tally to Redis now if :data:`FLUSH_S` has passed (its own round trip)."""
        with redis_errors(settings):
            pipe = redis_for(settings).pipeline(transaction=False)
            self.queue_if_due(pipe)
            if len(pipe):
                pipe.execute()


class WorkerHealth:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def judge_all(self, workers: dict[str, dict[str, Any]]) -> dict[str, tuple[Verdict, str]]:
        """Judge these workers (id → its settings) and keep the verdicts: id → (verdict,
        the verdict it replaced, ``unknown`` when none), in two pipelined round trips."""
        ids = list(workers)
        if not ids:
            return {}
        redis, since = redis_for(self.settings), _minute() - WINDOW_MIN + 1
        with redis_errors(self.settings):
            pipe = redis.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hgetall(counts_key(worker_id))
                pipe.get(failures_key(worker_id))
            read = pipe.execute()
            tallies = [_tally(counts, since) for counts in read[::2]]
            verdicts = [
                judge(ok, failed, int(consecutive or 0), workers[worker_id])
                for worker_id, (ok, failed, _), consecutive in zip(
                    ids, tallies, read[1::2], strict=True
                )
            ]
            pipe = redis.pipeline(transaction=False)
            for worker_id, verdict in zip(ids, verdicts, strict=True):
                pipe.set(state_key(worker_id), verdict.health, get=True)
            for worker_id, (_, _, stale), counts in zip(ids, tallies, read[::2], strict=True):
                if stale:  # minutes out of the window, and the key's end when the worker rests
                    pipe.hdel(counts_key(worker_id), *stale)
                if counts:
                    pipe.expire(counts_key(worker_id), _COUNTS_TTL_S)
            before = pipe.execute()[: len(ids)]
        return {
            worker_id: (verdict, UNKNOWN if old is None else text(old))
            for worker_id, verdict, old in zip(ids, verdicts, before, strict=True)
        }

    def known(self, worker_ids: list[str]) -> dict[str, str]:
        """The kept verdicts of these workers (``unknown`` where none was made yet)."""
        if not worker_ids:
            return {}
        with redis_errors(self.settings):
            pipe = redis_for(self.settings).pipeline(transaction=False)  # keys in many slots
            for worker_id in worker_ids:
                pipe.get(state_key(worker_id))
            found = pipe.execute()
        return {
            w: UNKNOWN if v is None else text(v) for w, v in zip(worker_ids, found, strict=True)
        }


def _tally(counts: dict[Any, Any] | None, since: int) -> tuple[int, int, list[Any]]:
    """(successes, failures) of the per-minute counts from minute ``since`` on, and the
    fields of the minutes before it."""
    ok = failed = 0
    stale = []
    for field, value in (counts or {}).items():
        minute, _, kind = text(field).partition(":")
        if int(minute) < since:
            stale.append(field)
        elif kind == "ok":
            ok += int(value)
        elif kind == "failed":
            failed += int(value)
    return ok, failed, stale
