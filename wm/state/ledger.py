"""Pending deliveries: a safety net under the broker's at-least-once promise.

kombu's Redis transport takes a message off its queue (BRPOP) and only then records it as
unacknowledged: a node killed between the two loses the message, and so does one killed
while Redis's reply is in flight. So every delivery to a worker is also written here before
it is sent, and settled once its outcome is recorded or it is dead-lettered. The nodes'
reconcile loop sends again what stayed pending longer than WM_REDELIVER_AFTER_S. A second
copy is harmless: a delivery whose outcome is recorded republishes instead of re-running.
Written before the send, an entry covers a node killed between sending and writing; a send
that raised withdraws the entries it created, since its caller was told the publish failed
(the sweep would deliver it later, and on RabbitMQ nothing would ever settle it).

A worker's pending deliveries are one sorted set, ``wm:pending:{<worker id>}``, scored by
the time they were sent; each member is the event key and the payload sent
(:func:`member`), so adding one is one command and settling one is one more, by the
consumer that holds the payload. Members that are a bare key are *legacy* entries, written
by earlier releases that kept payloads in a hash ``wm:pending:{<worker id>}:body``; they
are still found, sent again and settled.

All keys of a worker carry its id as a hash tag (``{<worker id>}``), as its outcomes do: on a
Redis Cluster the outcome's record script settles the delivery in the same slot. The sweep's
claim ``wm:pending:sweeper`` is one key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from wm.config import Settings
from wm.state.connection import StateRedis, queue_eval, redis_errors, redis_for, text
from wm.state.ordering import NUMBER_FUNCTION, legacy_sequence_key, number_command, turn_key

logger = logging.getLogger(__name__)
_PENDING = "wm:pending:"
_SWEEP_LOCK = "wm:pending:sweeper"
#: The node that claimed the latest sweep; kept three periods (the claim itself lasts less
#: than one), so ``wm status`` names it between sweeps and forgets a node that went away.
_MAINTAINER = "wm:maintainer"
MAINTAINER_PERIODS = 3
#: Seconds a worker's counts of runs (:meth:`Ledger.begin_run`) outlive the latest run
#: counted or the worker's latest start (:meth:`Ledger.restart_clocks`): a count goes when
#: its delivery settles or its run ends, and the end clears what nothing will settle, such
#: as a count begun by a run that raced its worker's delete. A count still due ends with
#: them only where its event waited 7 days in a queue while no other redelivered run of its
#: worker was counted and the worker did not start again; its event then counts from 1.
RUNS_TTL_S = 7 * 24 * 3600
# KEYS: the worker's index, its counts of runs. ARGV: now, RUNS_TTL_S.
_RESTART_CLOCKS = """
redis.call('EXPIRE', KEYS[2], ARGV[2])
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


#: Separates the event key from the payload in a member (keys are UUIDs).
_SEP = "\n"
# A publish's routes lookup and its ledger writes in one round trip, on a single Redis server
# (the script names each worker's keys itself: on a Redis Cluster they lie in other slots,
# and :meth:`Ledger.add_many` writes them after the lookup). KEYS: the topic's ready flag,
# routes and drop counter (``wm.dataplane.bus``). ARGV: the seconds a drop counter lasts past
# its last count ('0': count no drops), the time, the ledger index's text before and after a
# worker id, the ordering keys' text before a worker id, after it in the hash of earlier
# releases and after it in a partition key's hash before the key (``wm.state.ordering``),
# then per event its member ('' for none) and partition key ('' for none). Returns false when
# the topic's routes must be loaded first, else {HGETALL's list, {created, number} per event
# and route}.
_ROUTED_ADD = (
    NUMBER_FUNCTION
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local routes = redis.call('HGETALL', KEYS[2])
if #routes == 0 then
  if ARGV[1] ~= '0' then
    redis.call('INCRBY', KEYS[3], (#ARGV - 7) / 2)
    redis.call('EXPIRE', KEYS[3], ARGV[1])
  end
  return {routes, {}}
end
local workers, ordered = {}, {}
for i = 2, #routes, 2 do
  local worker, by_key = routes[i], false
  if string.sub(worker, 1, 1) == '{' then
    local found = cjson.decode(worker)
    worker, by_key = found['id'], found['ordering'] == 'key'
  end
  workers[#workers + 1], ordered[#ordered + 1] = worker, by_key
end
local done = {}
for e = 8, #ARGV, 2 do
  local entry, partition = ARGV[e], ARGV[e + 1]
  for r = 1, #workers do
    local created, numbered = 0, 0
    if workers[r] ~= '' and entry ~= '' then
      created = redis.call('ZADD', ARGV[3] .. workers[r] .. ARGV[4], 'NX', ARGV[2], entry)
      if ordered[r] and partition ~= '' then
        local turn = ARGV[5] .. workers[r] .. ARGV[7] .. partition
        numbered = number(turn, ARGV[5] .. workers[r] .. ARGV[6], partition)
      end
    end
    done[#done + 1] = created
    done[#done + 1] = numbered
  end
end
return {routes, done}
"""
)


def member(key: str, payload: str) -> str:
    """The ledger member of a delivery of ``payload`` (event key ``key``)."""
    return f"{key}{_SEP}{payload}"


@dataclass(frozen=True)
class Pending:
    """A delivery waiting for its outcome: its event key and the payload sent."""

    key: str
    payload: str
    member: str


@dataclass(frozen=True)
class Entries:
    """What :meth:`Ledger.add` wrote for one event: its numbers (ordered keys) by worker id,
    and the workers whose entry it created, not found pending already (by an earlier send
    of the same event, which a failed send must leave alone)."""

    numbers: dict[str, int]
    created: tuple[str, ...]


@dataclass(frozen=True)
class Delivery:
    """An event to write to the ledger before it is sent (:meth:`Ledger.add_many`): its key
    and payload, the (worker id, queue) of each delivery, the workers that number it and its
    partition key (``wm.state.ordering``)."""

    key: str
    payload: str
    deliveries: tuple[tuple[str, str], ...]
    numbered: tuple[str, ...] = ()
    partition: str | None = None


@dataclass(frozen=True)
class Settlement:
    """What settling one delivery removes: its member of the worker's index and, for a
    delivery its broker sent again, its count of runs (see :meth:`Ledger.begin_run`)."""

    index: str
    member: str
    runs: str | None
    key: str

    def due_now(self, pending_only: bool = True) -> tuple[Any, ...]:
        """The command that makes the delivery due at the sweep's next turn, where it is
        still pending (a record that failed: the event runs again then, not after
        WM_REDELIVER_AFTER_S); not ``pending_only``, settled or not (writes after the
        record's may not have run)."""
        return ("ZADD", self.index, *(["XX"] if pending_only else []), 0, self.member)


class Ledger:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @property
    def redis(self) -> StateRedis:
        return redis_for(self.settings)

    @staticmethod
    def _index(worker_id: str) -> str:
        return f"{_PENDING}{{{worker_id}}}"

    @staticmethod
    def _legacy_bodies(worker_id: str) -> str:
        return f"{_PENDING}{{{worker_id}}}:body"

    @staticmethod
    def _runs(worker_id: str) -> str:
        return f"{_PENDING}{{{worker_id}}}:runs"

    def add(
        self,
        deliveries: Iterable[tuple[str, str]],
        key: str,
        payload: str,
        *,
        numbered: Sequence[str] = (),
        partition: str | None = None,
    ) -> Entries:
        """Record the event ``key`` as pending for each (worker id, queue) before it is sent,
        and number it under ``partition`` for each worker of ``numbered`` (ordered keys,
        ``wm.state.ordering``)."""
        now, entry = time.time(), member(key, payload)
        workers = [worker_id for worker_id, _ in deliveries]
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            for worker_id in workers:
                pipe.zadd(self._index(worker_id), {entry: now}, nx=True)
            if partition is not None:
                for worker_id in numbered:
                    queue_eval(pipe, *number_command(worker_id, partition))
            results = pipe.execute()
        created = tuple(w for w, n in zip(workers, results, strict=False) if int(n))
        if partition is None or not numbered:
            return Entries({}, created)
        numbers = zip(numbered, results[-len(numbered) :], strict=True)
        return Entries({w: int(n) for w, n in numbers}, created)

    def add_many(self, events: Sequence[Delivery]) -> list[Entries]:
        """:meth:`add` for many events in one round trip."""
        now = time.time()
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            for event in events:
                entry = member(event.key, event.payload)
                for worker_id, _ in event.deliveries:
                    pipe.zadd(self._index(worker_id), {entry: now}, nx=True)
                if event.partition is not None:
                    for worker_id in event.numbered:
                        queue_eval(pipe, *number_command(worker_id, event.partition))
            results = iter(pipe.execute())
        found = []
        for event in events:
            added = [int(next(results)) for _ in event.deliveries]
            numbers = (
                [int(next(results)) for _ in event.numbered] if event.partition is not None else []
            )
            created = tuple(w for (w, _), n in zip(event.deliveries, added, strict=True) if n)
            found.append(Entries(dict(zip(event.numbered, numbers, strict=False)), created))
        return found

    @staticmethod
    def routed_add_command(
        route_keys: Sequence[str],
        drops_ttl_s: int | None,
        events: Sequence[tuple[str | None, str, str | None]],
    ) -> tuple[Any, ...]:
        """The EVAL arguments that look a topic's routes up (``route_keys``: its ready flag,
        routes and drop counter) and add each of ``events`` (key, payload, partition key) to
        the ledger of each worker route, ordered workers numbering it under its partition
        key, in one round trip (single Redis server only). :meth:`parse_routed_add` reads
        the reply. With ``drops_ttl_s``, events of a topic with no route are counted as
        dropped, the count ending that many seconds after."""
        ordering = [*legacy_sequence_key("\0").split("\0"), turn_key("\0", "").split("\0")[1]]
        around = [*Ledger._index("\0").split("\0"), *ordering]
        args: list[Any] = [drops_ttl_s or 0, time.time(), *around]
        for key, payload, partition in events:
            args += [member(key, payload) if key else "", partition or ""]
        return (_ROUTED_ADD, len(route_keys), *route_keys, *args)

    @staticmethod
    def parse_routed_add(reply: Any) -> tuple[list[Any], list[tuple[int, int]]] | None:
        """(HGETALL's list of the routes, (created, number) per event and route) of a routed
        add's reply; None when the topic's routes must be loaded first."""
        if reply is None:
            return None
        flat, done = reply
        pairs = [(int(c), int(n)) for c, n in zip(done[::2], done[1::2], strict=True)]
        return list(flat), pairs

    def withdraw(self, worker_ids: Iterable[str], key: str, payload: str) -> None:
        """The broker refused these deliveries (or their send failed before it was done):
        their caller was told, so nothing of them stays to be sent again by the sweep."""
        self.withdraw_many([(worker_ids, key, payload)])

    def withdraw_many(self, events: Iterable[tuple[Iterable[str], str, str]]) -> None:
        """:meth:`withdraw` for many events, (worker ids, key, payload) each, in one round
        trip."""
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            for worker_ids, key, payload in events:
                entry = member(key, payload)
                for worker_id in worker_ids:
                    pipe.zrem(self._index(worker_id), entry)
            if len(pipe):
                pipe.execute()

    def settlement(
        self, worker_id: str, key: str, payload: str, *, ran_again: bool = False
    ) -> Settlement:
        """What :meth:`settle` removes, for a script that settles with another write (the
        outcome's record); ``ran_again``: runs were counted (:meth:`begin_run`)."""
        runs = self._runs(worker_id) if ran_again else None
        return Settlement(self._index(worker_id), member(key, payload), runs, key)

    def settle(self, worker_id: str, key: str, payload: str, *, ran_again: bool = False) -> None:
        """The delivery is done (outcome recorded, or dead-lettered): forget it."""
        done = self.settlement(worker_id, key, payload, ran_again=ran_again)
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(done.index, done.member, key)  # a bare key: a legacy entry
            pipe.hdel(self._legacy_bodies(worker_id), key)
            if done.runs is not None:
                pipe.hdel(done.runs, key)
            pipe.execute()

    def begin_run(self, worker_id: str, key: str) -> int:
        """Count a run of a delivery the broker sent again because the process that had it
        died; returns the runs begun and not ended (by :meth:`end_run` or :meth:`settle`)."""
        runs = self._runs(worker_id)
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hincrby(runs, key, 1)
            pipe.expire(runs, RUNS_TTL_S)
            return int(pipe.execute()[0])

    def end_run(self, worker_id: str, key: str) -> None:
        """The run ended, with an error the delivery's policy handles: its process lived."""
        with redis_errors(self.settings):
            self.redis.hdel(self._runs(worker_id), key)

    def restart_clocks(self, worker_id: str) -> None:
        """A worker starts again: time spent stopped is not time a broker lost a message, nor
        time its counts of runs (:data:`RUNS_TTL_S`) run out in."""
        with redis_errors(self.settings):
            keys = (self._index(worker_id), self._runs(worker_id))
            self.redis.eval(_RESTART_CLOCKS, len(keys), *keys, time.time(), RUNS_TTL_S)

    def forget_worker(self, worker_id: str) -> None:
        """A deleted worker's queue is gone, and so are its pending deliveries."""
        with redis_errors(self.settings):
            self.redis.delete(
                self._index(worker_id), self._legacy_bodies(worker_id), self._runs(worker_id)
            )

    def pending(self, worker_id: str) -> int:
        return self.pending_of([worker_id])[worker_id]

    def pending_of(self, worker_ids: list[str]) -> dict[str, int]:
        """Pending deliveries per worker, in one round trip."""
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            for worker_id in worker_ids:
                pipe.zcard(self._index(worker_id))
            counts = pipe.execute()
        return {w: int(n) for w, n in zip(worker_ids, counts, strict=True)}

    def overdue(self, worker_id: str, older_than_s: float) -> list[Pending]:
        """Deliveries pending longer than ``older_than_s``, oldest first (legacy entries with
        their payload from its hash; one whose payload is gone is forgotten)."""
        with redis_errors(self.settings):
            found = [
                text(raw)
                for raw in self.redis.zrangebyscore(
                    self._index(worker_id), 0, time.time() - older_than_s
                )
            ]
            legacy = [entry for entry in found if _SEP not in entry]
            bodies = self.redis.hmget(self._legacy_bodies(worker_id), legacy) if legacy else []
        old = dict(zip(legacy, bodies, strict=True))
        pending = []
        for entry in found:
            key, sep, payload = entry.partition(_SEP)
            if sep:
                pending.append(Pending(key, payload, entry))
            elif old[entry] is not None:
                pending.append(Pending(key, text(old[entry]), entry))
            else:
                self.forget(worker_id, [entry])
        return pending

    def restart_clock(self, worker_id: str, sent: list[Pending]) -> None:
        """Deliveries sent again: each is sent again at most once per period. A legacy entry was
        replaced by a current one when it was sent."""
        if not sent:
            return
        legacy = [p.member for p in sent if _SEP not in p.member]
        current = [p.member for p in sent if _SEP in p.member]
        with redis_errors(self.settings):
            if current:
                self.redis.zadd(
                    self._index(worker_id), dict.fromkeys(current, time.time()), xx=True
                )
            if legacy:
                self.forget(worker_id, legacy)

    def forget(self, worker_id: str, members: list[str]) -> None:
        with redis_errors(self.settings):
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(self._index(worker_id), *members)
            pipe.hdel(self._legacy_bodies(worker_id), *members)
            pipe.execute()

    def claim_sweep(self, period_s: float, node: str | None = None) -> bool:
        """One node sweeps at a time, at most once per period; the one that claims it is
        recorded as the maintaining node (:meth:`maintainer`)."""
        with redis_errors(self.settings):
            claimed = self.redis.set(_SWEEP_LOCK, 1, nx=True, px=max(1, int(period_s * 900)))
            if claimed and node:
                keep_ms = max(1, int(period_s * 1000 * MAINTAINER_PERIODS))
                self.redis.set(_MAINTAINER, node, px=keep_ms)
        return bool(claimed)

    def maintainer(self) -> str | None:
        """The node that swept last, if it did so within the last few periods."""
        with redis_errors(self.settings):
            found = self.redis.get(_MAINTAINER)
        return None if found is None else text(found)
