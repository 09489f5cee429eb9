"""What one worker's own look adds to its record (``wm worker show``): its queue's depth,
its dead letters not replayed, its last error, its recent deliveries and its circuit breaker.

The last error is the newest of what is recorded about the worker's failures: its newest
dead letter, its newest move to ``failed`` or ``killed`` or by its breaker (whose reason
names the error), and its last health probe when that failed. Delivery counts are the
per-minute counts health keeps in Redis (``wm.state.health``): a process adds its tally
there at most once a second, with its next delivery's record, so the newest deliveries may
show a little late. Parts are read as ``wm.control.overview`` reads them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.control.overview import (
    BROKER,
    REDIS,
    LiveWorker,
    breaker_info,
    connect,
    part,
)
from wm.dataplane.app import broker_errors
from wm.dataplane.bus import Bus, queue_depths
from wm.lifecycle import Status
from wm.names import route_group, route_topic
from wm.state.breaker import Breaker, failures_key
from wm.state.connection import redis_errors, redis_for, text
from wm.state.health import WINDOW_MIN, ProbeFacts, counts_key, probe_key
from wm.store import deadletters as dead_letters
from wm.store import workers as rows
from wm.views import BreakerInfo, DeliveryCounts, LastError, WorkerDetails, WorkerInfo, aware

#: Transitions whose reason is an error worth showing as a worker's last one: these moves,
#: and the breaker's.
_FAILING = (Status.FAILED.value, Status.KILLED.value)
_BREAKER_MOVES = (Status.PENDING.value, Status.STOPPED.value)


def worker_details(settings: Settings, bus: Bus, info: WorkerInfo) -> WorkerDetails:
    """What ``wm worker show`` adds to ``info``; a service that does not answer leaves its
    parts None (see ``wm.control.overview``)."""
    live = LiveWorker(
        str(info.id),
        info.name,
        route_topic(info.tenant, info.topic),
        info.status,
        dict(info.settings),
        aware(info.status_since),
        route_group(info.tenant, info.group),
    )
    with store.session_scope(settings) as session:
        letters, errors = _letters_of(session, info.id)
        paused = bool(
            rows.paused_by_breaker(session, [live.id] if live.status == Status.PENDING else [])
        )
    missing: dict[str, str] = {}
    facts = part(missing, REDIS, lambda: _redis_facts(settings, live, paused))
    depth = part(missing, BROKER, lambda: _depth(settings, bus.app, live.queue))
    if facts is not None and facts.probe is not None and not facts.probe.ok:
        at = datetime.fromtimestamp(facts.probe.at, UTC)
        errors.append(LastError(at, "probe", facts.probe.error))
    return WorkerDetails(
        worker=info,
        queue=live.queue,
        queue_depth=depth,
        dead_letters=letters,
        last_error=max(errors, key=lambda e: e.at, default=None),
        deliveries_last_minute=None if facts is None else facts.last_minute,
        deliveries_window=None if facts is None else facts.window,
        breaker=None if facts is None else facts.breaker,
        unavailable=missing,
    )


def _letters_of(session: Session, wid: uuid.UUID) -> tuple[int, list[LastError]]:
    """The worker's dead letters not replayed, and the newest errors the database holds."""
    found = [_newest_letter(session, wid), _newest_failing_move(session, wid)]
    return dead_letters.waiting_of(session, wid), [error for error in found if error is not None]


def _newest_letter(session: Session, wid: uuid.UUID) -> LastError | None:
    letter = dead_letters.newest_of(session, wid)
    if letter is None:
        return None
    at = aware(letter.last_failure_at)
    return LastError(at, "dead letter", letter.error_message, letter.error_type)


def _newest_failing_move(session: Session, wid: uuid.UUID) -> LastError | None:
    """The reason of the worker's newest move to failed or killed, or by its breaker."""
    moved = rows.newest_move(session, wid, to=_FAILING, by_breaker_to=_BREAKER_MOVES)
    return None if moved is None else LastError(aware(moved.at), "transition", moved.reason)


@dataclass(frozen=True)
class _RedisFacts:
    last_minute: DeliveryCounts
    window: DeliveryCounts
    breaker: BreakerInfo
    probe: ProbeFacts | None


def _redis_facts(settings: Settings, worker: LiveWorker, paused: bool) -> _RedisFacts:
    """Delivery counts, breaker and last probe of one worker: two round trips."""
    with redis_errors(settings):
        pipe = redis_for(settings).pipeline(transaction=False)  # keys in many slots
        pipe.hgetall(counts_key(worker.id))
        pipe.get(failures_key(worker.id))
        pipe.hgetall(probe_key(worker.id))
        counts, failures, probe = pipe.execute()
    trips = Breaker(settings).trips(worker.id)
    minute = int(time.time() // 60)
    return _RedisFacts(
        last_minute=delivery_counts(counts, minute - 1),
        window=delivery_counts(counts, minute - WINDOW_MIN + 1),
        breaker=breaker_info(worker, int(failures or 0), trips, paused),
        probe=ProbeFacts.parse(probe),
    )


def delivery_counts(counts: Mapping[Any, Any] | None, since_minute: int) -> DeliveryCounts:
    """Sum the per-minute counts of ``wm.state.health`` (fields ``<minute>:ok`` and
    ``<minute>:failed``) from minute ``since_minute`` (minutes since the epoch) on."""
    ok = failed = 0
    for field, value in (counts or {}).items():
        minute, _, kind = text(field).partition(":")
        if int(minute) < since_minute:
            continue
        if kind == "ok":
            ok += int(value)
        elif kind == "failed":
            failed += int(value)
    return DeliveryCounts(datetime.fromtimestamp(since_minute * 60, UTC), ok, failed)


def _depth(settings: Settings, app: Celery, queue: str) -> int:
    with broker_errors(settings), connect(app) as conn:
        return queue_depths(conn, [queue])[queue]
