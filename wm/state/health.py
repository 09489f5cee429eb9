"""A worker's health, orthogonal to its status (issue 14, point 2; seed 003).

``healthy | degraded | unhealthy | unknown``, judged from its real deliveries and, when its
code has one, its health probe:

- the error rate over the last :data:`WINDOW_MIN` minutes, from per-minute counts in a hash
  per worker (``wm:health:{<id>}``). Each process tallies its deliveries in memory
  (:class:`Tally`) and adds them to Redis at most once every :data:`FLUSH_S`, with the next
  outcome record's round trip (or with a failure's), so the hot path sends no command of its
  own for health: at most one per worker and second per process;
- the failed attempts in a row (the circuit breaker's count, ``wm.state.breaker``);
- the last probe and the probes failed in a row (``wm:probe:{<id>}``, written by the node
  that ran it, ``wm.dataplane.probes``; forgotten :data:`PROBE_FACTS_TTL_S` or three
  intervals after the last probe, so a worker no longer probed is judged by its deliveries).

``unknown``: no delivery in the window and no probe (failures in a row count only while
the window holds deliveries: those of a worker paused while unhealthy age out, and it
resumes). ``unhealthy``:
``health_max_consecutive_failures`` failures in a row (default 3), an error rate of at least
``health_unhealthy_rate`` (default 0.5) over at least ``health_min_deliveries`` deliveries
(default 10: a quiet worker's one failure is no verdict on it), or ``max_probe_failures``
failed probes in a row (default 3; 0: failed probes alone never make a worker unhealthy).
``degraded``: an error rate of at least ``health_degraded_rate`` (default 0.05), over any
number of deliveries, or a failed last probe. The worst
of the deliveries' verdict and the probe's holds; a passing probe makes a worker without
deliveries ``healthy``. The maintaining node judges every live worker each reconcile period
and keeps the verdict (``wm:health-state:{<id>}``); a change is a lifecycle event
``health_changed``.

Both keys outlive the last judgement that kept them by :data:`VERDICT_TTL_S` (at least three
reconcile periods): each period's judgement renews them, so only a deleted worker's come to
their end, ones a judgement in flight kept again after the delete, or ones a Redis outage
kept from being deleted with it.

When the kept verdict changes, ``wm:health-since:{<id>}`` records the time: a worker paused as
unhealthy (``pause_when_unhealthy``, ``wm.dataplane.features.pause``) whose probe passed after
that, or that has no probe and has been paused ``health_pause_s``, is given a trial
(:meth:`WorkerHealth.judge_all`).

Probes are scheduled with two more keys per worker: ``wm:probe-due:{<id>}`` exists while a
probe is outstanding or not yet due, and ``wm:no-probe:{<id>}:<version>`` remembers that a
version's code has no probe, so it is not asked again.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from wm.config import Settings
from wm.state.breaker import failures_key
from wm.state.connection import StatePipeline, queue_eval, redis_errors, redis_for, text
from wm.workersettings import WorkerSettings

HEALTHY, DEGRADED, UNHEALTHY, UNKNOWN = "healthy", "degraded", "unhealthy", "unknown"
HEALTHS = (HEALTHY, DEGRADED, UNHEALTHY, UNKNOWN)
#: Which verdict wins when deliveries and the probe disagree: the worse one.
_SEVERITY = {UNKNOWN: 0, HEALTHY: 1, DEGRADED: 2, UNHEALTHY: 3}
#: Minutes of deliveries the error rate is taken over.
WINDOW_MIN = 5
#: seconds the last probe's facts are kept at least (longer for long probe intervals).
PROBE_FACTS_TTL_S = WINDOW_MIN * 60
#: seconds a version's "no probe" is remembered (a version's code never changes; the key
#: only ends so that deleted workers leave nothing behind).
NO_PROBE_TTL_S = 7 * 24 * 3600
_COUNTS = "wm:health:"
_STATE = "wm:health-state:"
_SINCE = "wm:health-since:"
_PROBE = "wm:probe:"
_PROBE_DUE = "wm:probe-due:"
_NO_PROBE = "wm:no-probe:"
# KEYS: no-probe marker, due. ARGV: lease in ms. 1 when a probe is to be sent now.
_CLAIM_PROBE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return 1 end
return 0
"""
# KEYS: probe facts, due. ARGV: ok (1/0), at, error, version, facts ttl s, next probe in ms.
# Returns the probes failed in a row.
_RECORD_PROBE = """
local failures = 0
if ARGV[1] == '1' then
  redis.call('HSET', KEYS[1], 'failures', 0)
else
  failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
end
redis.call('HSET', KEYS[1], 'ok', ARGV[1], 'at', ARGV[2], 'error', ARGV[3], 'version', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('SET', KEYS[2], '1', 'PX', ARGV[6])
return failures
"""
_COUNTS_TTL_S = (WINDOW_MIN + 1) * 60
#: Seconds a kept verdict and since when outlive the judgement that kept them (the module's
#: docstring); at least three reconcile periods.
VERDICT_TTL_S = 24 * 3600
#: Seconds a process keeps its tally before adding it to Redis.
FLUSH_S = 1.0


def counts_key(worker_id: str) -> str:
    return f"{_COUNTS}{{{worker_id}}}"


def state_key(worker_id: str) -> str:
    return f"{_STATE}{{{worker_id}}}"


def since_key(worker_id: str) -> str:
    """When the kept verdict last changed (``time.time()``)."""
    return f"{_SINCE}{{{worker_id}}}"


def probe_key(worker_id: str) -> str:
    return f"{_PROBE}{{{worker_id}}}"


def probe_due_key(worker_id: str) -> str:
    return f"{_PROBE_DUE}{{{worker_id}}}"


def no_probe_key(worker_id: str, version: int) -> str:
    return f"{_NO_PROBE}{{{worker_id}}}:{version}"


def _minute(now: float | None = None) -> int:
    return int((time.time() if now is None else now) // 60)


@dataclass(frozen=True)
class ProbeFacts:
    """A worker's last health probe, and how many failed in a row up to it."""

    ok: bool
    failures: int
    #: When it ended (``time.time()`` of the node that ran it).
    at: float
    error: str = ""
    version: int = 0

    @classmethod
    def parse(cls, raw: Mapping[Any, Any] | None) -> ProbeFacts | None:
        """The facts of a ``wm:probe:{<id>}`` hash (None when there is none)."""
        fields = {text(k): text(v) for k, v in (raw or {}).items()}
        if "ok" not in fields:
            return None
        return cls(
            ok=fields["ok"] == "1",
            failures=int(fields.get("failures") or 0),
            at=float(fields.get("at") or 0),
            error=fields.get("error", ""),
            version=int(fields.get("version") or 0),
        )

    @property
    def reason(self) -> str:
        if self.ok:
            return "its last probe passed"
        times = "once" if self.failures == 1 else f"{self.failures} times"
        return f"its probe failed {times} in a row: {self.error}"

    def to_json(self) -> dict[str, Any]:
        """The facts a ``health_changed`` event carries."""
        return {
            "probe_ok": self.ok,
            "probe_failures": self.failures,
            "probe_error": self.error or None,
            "probe_at": self.at,
            "probe_version": self.version,
        }


@dataclass(frozen=True)
class Verdict:
    health: str
    error_rate: float | None
    deliveries: int
    consecutive_failures: int
    #: The last probe, when the worker's code has one and it ran lately.
    probe: ProbeFacts | None = None
    #: ``health_min_deliveries`` when the error rate alone would have made the worker
    #: unhealthy, but the window held fewer attempts (0 otherwise).
    too_few_for: int = 0

    @property
    def reason(self) -> str:
        if self.error_rate is None:
            reason = f"no delivery in the last {WINDOW_MIN} minutes"
        else:
            reason = (
                f"{self.error_rate:.0%} of {self.deliveries} attempts failed in the last "
                f"{WINDOW_MIN} minutes; {self.consecutive_failures} failed in a row"
            )
        if self.too_few_for:
            reason += f" (under {self.too_few_for} attempts the rate makes it degraded at most)"
        return reason if self.probe is None else f"{reason}; {self.probe.reason}"


def judge(
    ok: int,
    failed: int,
    consecutive: int,
    worker_settings: Mapping[str, Any],
    probe: ProbeFacts | None = None,
) -> Verdict:
    """The verdict on these counts and the last probe, with the worker's thresholds."""
    verdict = _judge_deliveries(ok, failed, consecutive, worker_settings)
    if probe is None:
        return verdict
    health = max(verdict.health, probe_health(probe, worker_settings), key=_SEVERITY.__getitem__)
    return replace(verdict, health=health, probe=probe)


def _judge_deliveries(
    ok: int, failed: int, consecutive: int, worker_settings: Mapping[str, Any]
) -> Verdict:
    total = ok + failed
    if total == 0:  # a run of failures counts while it is in the window: a paused worker's
        return Verdict(UNKNOWN, None, 0, consecutive)  # ages out, and it may try again
    rate = failed / total
    typed = WorkerSettings.of(worker_settings)
    degraded, unhealthy = typed.health_degraded_rate, typed.health_unhealthy_rate
    in_a_row, minimum = typed.health_max_consecutive_failures, typed.health_min_deliveries
    over = rate >= unhealthy
    if (in_a_row and consecutive >= in_a_row) or (over and total >= minimum):
        return Verdict(UNHEALTHY, rate, total, consecutive)
    health = DEGRADED if rate >= degraded else HEALTHY  # over here: too few attempts
    return Verdict(health, rate, total, consecutive, too_few_for=minimum if over else 0)


def probe_health(probe: ProbeFacts, worker_settings: Mapping[str, Any]) -> str:
    """What the last probe says alone: ``max_probe_failures`` failed in a row (0: never)
    make a worker unhealthy, fewer degraded; a passing one healthy."""
    if probe.ok:
        return HEALTHY
    limit = WorkerSettings.of(worker_settings).max_probe_failures
    return UNHEALTHY if limit and probe.failures >= limit else DEGRADED


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
        for worker_id in {worker_id for worker_id, _, _ in counts}:  # an end, whoever judges
            pipe.expire(counts_key(worker_id), _COUNTS_TTL_S)

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
        the verdict it replaced, ``unknown`` when none), in two pipelined round trips.

        A worker paused as unhealthy (``pause_when_unhealthy``) whose probe passed after
        the pause began, or that has no probe and was paused ``health_pause_s`` ago, is
        given a trial: the failures behind the pause are forgotten (its
        deliveries' counts and its run of failures, as a success would), so it resumes; new
        failures pause it again."""
        ids = list(workers)
        if not ids:
            return {}
        redis, since = redis_for(self.settings), _minute() - WINDOW_MIN + 1
        with redis_errors(self.settings):
            read = _read_facts(redis, ids)
            kept, probes = _kept_and_probes(read)
            tried = [
                _trial(workers[w], old, probe)
                for w, old, probe in zip(ids, kept, probes, strict=True)
            ]
            counts = [{} if trial else found for trial, found in zip(tried, read[::5], strict=True)]
            in_a_row = [0 if t else int(n or 0) for t, n in zip(tried, read[1::5], strict=True)]
            tallies = [_tally(found, since) for found in counts]
            verdicts = [
                judge(ok, failed, consecutive, workers[w], probe)
                for w, (ok, failed, _), consecutive, probe in zip(
                    ids, tallies, in_a_row, probes, strict=True
                )
            ]
            pipe = redis.pipeline(transaction=False)
            ttl = max(VERDICT_TTL_S, math.ceil(3 * self.settings.reconcile_interval_s))
            for worker_id, verdict, (old, _), trial in zip(ids, verdicts, kept, tried, strict=True):
                _keep(pipe, worker_id, verdict.health, old, trial, ttl)
            _trim_counts(pipe, ids, [stale for _, _, stale in tallies], counts)
            pipe.execute()
        return {
            worker_id: (verdict, old)
            for worker_id, verdict, (old, _) in zip(ids, verdicts, kept, strict=True)
        }

    def forget_worker(self, worker_id: str) -> None:
        """A deleted worker's kept verdict, since when, and counts (its probe facts end by
        themselves)."""
        keys = state_key(worker_id), since_key(worker_id), counts_key(worker_id)
        with redis_errors(self.settings):
            redis_for(self.settings).delete(*keys)

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


class Probes:
    """When each worker's health probe is due, and what the last one found (see the module
    docs): the scheduling node claims probes, the node that ran one records it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def claim_due(self, workers: Mapping[str, tuple[int, float]]) -> list[str]:
        """Of these workers (id → (version, seconds a probe may stay outstanding)), those
        whose probe is due now, each claimed for that long: no probe of theirs is
        outstanding or ran within their interval, and their version's code is not known to
        have no probe. One pipelined round trip."""
        ids = list(workers)
        if not ids:
            return []
        with redis_errors(self.settings):
            pipe = redis_for(self.settings).pipeline(transaction=False)
            for worker_id in ids:
                version, lease_s = workers[worker_id]
                keys = [no_probe_key(worker_id, version), probe_due_key(worker_id)]
                queue_eval(pipe, _CLAIM_PROBE, keys, _ms(lease_s))
            claimed = pipe.execute()
        return [w for w, won in zip(ids, claimed, strict=True) if int(won)]

    def record(
        self, worker_id: str, version: int, error: str | None, interval_s: float
    ) -> ProbeFacts:
        """Record a probe of ``version`` (``error`` None: it passed; else why it failed);
        the next is due ``interval_s`` from now."""
        at = time.time()
        keys = [probe_key(worker_id), probe_due_key(worker_id)]
        ttl_s = max(PROBE_FACTS_TTL_S, math.ceil(3 * interval_s))
        ok = "1" if error is None else "0"
        with redis_errors(self.settings):
            failures = redis_for(self.settings).eval(
                _RECORD_PROBE, 2, *keys, ok, repr(at), error or "", version, ttl_s, _ms(interval_s)
            )
        return ProbeFacts(error is None, int(failures), at, error or "", version)

    def no_probe(self, worker_id: str, version: int) -> None:
        """``version``'s code has no probe: never ask it again, and forget the facts of an
        earlier version's probe (they would judge code that no longer runs)."""
        with redis_errors(self.settings):
            pipe = redis_for(self.settings).pipeline(transaction=False)
            pipe.set(no_probe_key(worker_id, version), "1", ex=NO_PROBE_TTL_S)
            pipe.delete(probe_key(worker_id), probe_due_key(worker_id))
            pipe.execute()

    def release(self, worker_id: str) -> None:
        """The claimed probe was not run (the worker does not run now): due again at once."""
        with redis_errors(self.settings):
            redis_for(self.settings).delete(probe_due_key(worker_id))

    def forget(self, worker_id: str) -> None:
        """The worker was taken out of service: its probes start again when it does."""
        with redis_errors(self.settings):
            redis_for(self.settings).delete(probe_key(worker_id), probe_due_key(worker_id))

    def last(self, worker_id: str) -> ProbeFacts | None:
        with redis_errors(self.settings):
            return ProbeFacts.parse(redis_for(self.settings).hgetall(probe_key(worker_id)))


def _keep(pipe: Any, worker_id: str, health: str, old: str, trial: bool, ttl: int) -> None:
    """Keep a worker's verdict, when it changed since when (both for ``ttl`` seconds more),
    and forget on a trial the failures behind its pause."""
    pipe.set(state_key(worker_id), health, ex=ttl)
    if health != old:
        pipe.set(since_key(worker_id), repr(time.time()), ex=ttl)
    else:
        pipe.expire(since_key(worker_id), ttl)
    if trial:
        pipe.delete(counts_key(worker_id), failures_key(worker_id))


def _trial(
    worker_settings: Mapping[str, Any], kept: tuple[str, float], probe: ProbeFacts | None
) -> bool:
    """A worker paused as unhealthy since ``kept[1]`` whose probe passed after that, or,
    with no probe to say so, whose pause has lasted ``health_pause_s``."""
    health, since = kept
    typed = WorkerSettings.of(worker_settings)
    if health != UNHEALTHY or not typed.pause_when_unhealthy:
        return False
    if probe is None:
        return time.time() - since >= typed.health_pause_s
    return probe.ok and probe.at > since


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


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


def _kept_and_probes(
    read: list[Any],
) -> tuple[list[tuple[str, float]], list[ProbeFacts | None]]:
    """From :func:`_read_facts`' replies: each worker's kept verdict (``unknown`` when none)
    with since when, and its probe's facts."""
    kept = [
        (UNKNOWN if h is None else text(h), float(t or 0))
        for h, t in zip(read[3::5], read[4::5], strict=True)
    ]
    return kept, [ProbeFacts.parse(probe) for probe in read[2::5]]


def _read_facts(redis: Any, ids: list[str]) -> list[Any]:
    """Per worker, five replies in a row: its counts, its run of failures, its probe, its
    kept verdict and since when (two GETs: a cluster pipeline has no MGET)."""
    pipe = redis.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(counts_key(worker_id))
        pipe.get(failures_key(worker_id))
        pipe.hgetall(probe_key(worker_id))
        pipe.get(state_key(worker_id))
        pipe.get(since_key(worker_id))
    return list(pipe.execute())


def _trim_counts(pipe: Any, ids: list[str], stales: list[Any], counts: list[Any]) -> None:
    """Drop the minutes out of the window, and give the counts key its end when it rests."""
    for worker_id, stale, found in zip(ids, stales, counts, strict=True):
        if stale:
            pipe.hdel(counts_key(worker_id), *stale)
        if found:
            pipe.expire(counts_key(worker_id), _COUNTS_TTL_S)
