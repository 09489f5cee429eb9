"""What a node needs to know about a worker to deliver to it, cached in Redis.

The manager invalidates an entry after every committed change; a node that misses reads
PostgreSQL and caches again, so a code update reaches every node on its next message. A
shared group's deliveries carry its share's id (``wm.store.shares``): its entry lists the
share's members, each of whose own entry says whether it runs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import Any

from sqlalchemy import func, select, tuple_

from wm import store
from wm.config import Settings
from wm.errors import VersionNotFound
from wm.names import split_route_topic
from wm.state.connection import StateRedis, queue_eval, redis_errors, redis_for
from wm.store import shares
from wm.store import tenants as tenant_rows
from wm.store.models import Tenant, Worker, WorkerVersion
from wm.store.shares import Share
from wm.workersettings import WorkerSettings

_KEY = "wm:worker:"
#: A cached entry expires even if an invalidation was lost (e.g. Redis briefly down).
_CACHE_TTL_S = 60
#: A worker's current code (``wm:worker:{<id>}:code``: its SHA-256 in hex, then the code),
#: for the pool processes loading it after the first: beside the worker's facts (its hash
#: tag), so a delivery whose process has not loaded the worker reads it in the same MGET.
#: Checked against the facts' SHA-256, so an entry left from an older version is never used;
#: it lapses after the TTL, and code larger than the cap is always read from the database.
_CODE_SUFFIX = ":code"
_CODE_CACHE_TTL_S = 600
_CODE_CACHE_MAX_BYTES = 1 << 20
_SHA256_HEX = 64
#: Workers whose facts one query of :meth:`Directory.warm` reads.
_WARM_PER_QUERY = 500
#: Versions whose code one query of :meth:`Directory.warm` reads (each up to the cap).
_WARM_CODE_PER_QUERY = 50
#: A worker's row with its current version's SHA-256.
_FACTS = select(Worker, WorkerVersion.sha256).join(
    WorkerVersion,
    (WorkerVersion.worker_id == Worker.id) & (WorkerVersion.version == Worker.current_version),
)
#: Bumped by every invalidation, so a read that raced a change is not cached.
_GENERATION = "wm:worker-generation:"
#: Seconds a generation is kept after its worker's (or share's) last change. A read compares
#: the generation before and after it; one that has ended reads as none, so a read that
#: spans its end is not cached, and one that begins after it finds no change to miss: a
#: worker's or a deleted worker's generation need not outlive this.
GENERATION_TTL_S = 24 * 3600
# KEYS: generation, cache. ARGV: generation seen before the read ('' = none), value, ttl.
_CACHE_IF_UNCHANGED = """
if (redis.call('GET', KEYS[1]) or '') == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class WorkerMeta:
    id: str
    topic: str
    group: str | None
    mime_type: str
    status: str
    version: int
    sha256: str
    settings: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    #: Its tenant's limits a node enforces (``wm.tenantlimits.TenantLimits.delivery``),
    #: read with the worker's facts; None: its tenant has none (nothing to pay for).
    tenant_limits: dict[str, Any] | None = None

    @functools.cached_property
    def tenant(self) -> str:
        """The worker's tenant (``topic`` is its route topic, ``wm.names.route_topic``)."""
        return split_route_topic(self.topic)[0]

    @functools.cached_property
    def worker_settings(self) -> WorkerSettings:
        """:attr:`settings` (as stored) typed."""
        return WorkerSettings.of(self.settings)

    def to_json(self) -> str:
        """The cached text; without ``tenant_limits`` when there are none, so an entry
        reads as before tenant limits existed (and an older node parses it)."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        if given["tenant_limits"] is None:
            del given["tenant_limits"]
        return json.dumps(given)


#: Worker facts a pool process keeps parsed (a few KiB each).
_PARSED_MAX = 4096


@functools.lru_cache(maxsize=_PARSED_MAX)
def _parsed(raw: bytes | str) -> WorkerMeta:
    """Worker facts parsed, by their cached text: a pool process reads the same text for
    every delivery to a worker, and parses it (and types its settings) once per change. The
    least recently used are dropped first: a process serving more workers than it keeps
    parses again only those it has not served for longest."""
    return WorkerMeta(**json.loads(raw))


class Directory:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @property
    def redis(self) -> StateRedis:
        return redis_for(self.settings)

    def get(self, worker_id: str) -> WorkerMeta | None:
        """The worker's delivery facts, or None if it never existed.

        A miss reads the database and caches what it read only if no change was announced
        meanwhile (the generation is unchanged): a read that raced a commit is not cached.
        """
        return self.get_with(worker_id)[0]

    def get_with(self, worker_id: str, *keys: str) -> tuple[WorkerMeta | None, list[Any]]:
        """:meth:`get`, with the values of ``keys`` read in the same command; they come
        second (each None when missing). Each of ``keys`` must carry the worker's hash tag
        (``{<worker id>}``, as its outcomes do): on a Redis Cluster an MGET reads one slot."""
        if not worker_id:  # no worker, and ``{}`` would tag no key
            return None, [None] * len(keys)
        cache, generation = _keys(worker_id)
        with redis_errors(self.settings):
            raw, seen, *more = self.redis.mget([cache, generation, *keys])
            if raw is not None:
                return _parsed(raw), more
            meta = self.load(worker_id)
            if meta is not None:
                self.redis.eval(
                    _CACHE_IF_UNCHANGED,
                    2,
                    generation,
                    cache,
                    seen or b"",
                    meta.to_json(),
                    _CACHE_TTL_S,
                )
            return meta, more

    def find(
        self, target: str, *keys: str, read: list[Any] | None = None
    ) -> tuple[WorkerMeta | Share | None, list[Any]]:
        """:meth:`get_with` for the id a delivery carries: a worker's, or a shared group's
        (its :class:`~wm.store.shares.Share`, read in the same MGET, cached as a worker's
        entry is; ``keys`` carry ``target``'s hash tag). ``read``: the values of
        :func:`find_keys` and ``keys``, read already (by the take of the delivery's message);
        read here if they are not as many."""
        if not target:
            return None, [None] * len(keys)
        names = [*find_keys(target), *keys]
        if read is None or len(read) != len(names):
            with redis_errors(self.settings):
                read = self.redis.mget(names)
        raw, seen, shared, *more = read
        if raw is not None:
            return _parsed(raw), more
        if shared is not None:
            return Share.from_json(shared), more
        meta, more = self.get_with(target, *keys)
        if meta is not None:
            return meta, more
        return self.load_share(target, seen), more

    def load_share(self, share_id: str, seen: Any = None) -> Share | None:
        """The share from the database, cached unless a change was announced meanwhile."""
        with store.session_scope(self.settings) as session:
            found = shares.find(session, share_id)
        if found is not None:
            with redis_errors(self.settings):
                self.redis.eval(
                    _CACHE_IF_UNCHANGED,
                    2,
                    _keys(share_id)[1],
                    _share_key(share_id),
                    seen or b"",
                    found.to_json(),
                    _CACHE_TTL_S,
                )
        return found

    def load(self, worker_id: str) -> WorkerMeta | None:
        try:
            wid = uuid.UUID(worker_id)
        except ValueError:
            return None
        with store.session_scope(self.settings) as session:
            row = session.execute(_FACTS.where(Worker.id == wid)).one_or_none()
            if row is None:
                return None
            worker, sha256 = row
            limits = tenant_rows.limits_of(session.get(Tenant, worker.tenant)).delivery()
            return _meta(worker, sha256, limits)

    def warm(self, worker_ids: Collection[str]) -> int:
        """Cache the facts and code of those of ``worker_ids`` whose facts are not cached, read
        from the database in a few queries: a node starting under a backlog for many workers
        does it once, not each pool process one query per worker and for its code another.
        Entries are written only where no change was announced since (as :meth:`get_with`
        caches); returns how many workers' facts were read."""
        read = 0
        ids = sorted(worker_ids)  # a shared group's id among them matches no worker's row
        for start in range(0, len(ids), _WARM_PER_QUERY):
            read += self._warm(ids[start : start + _WARM_PER_QUERY])
        return read

    def _warm(self, worker_ids: list[str]) -> int:
        with redis_errors(self.settings), self.redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                for key in _keys(worker_id):
                    pipe.get(key)
            found = pipe.execute()
        seen = {
            worker_id: generation
            for worker_id, cached, generation in zip(
                worker_ids, found[::2], found[1::2], strict=True
            )
            if cached is None
        }
        if not seen:
            return 0
        with store.session_scope(self.settings) as session:
            rows = session.execute(
                _FACTS.where(Worker.id.in_([uuid.UUID(worker_id) for worker_id in seen]))
            ).all()
            tenants = {worker.tenant for worker, _ in rows}
            limits = {
                name: tenant_rows.limits_of(session.get(Tenant, name)).delivery()
                for name in tenants
            }
            metas = [_meta(worker, sha256, limits[worker.tenant]) for worker, sha256 in rows]
            self._warm_code(session, metas)
        with redis_errors(self.settings), self.redis.pipeline(transaction=False) as pipe:
            for meta in metas:
                cache, generation = _keys(meta.id)
                args = (seen[meta.id] or b"", meta.to_json(), _CACHE_TTL_S)
                queue_eval(pipe, _CACHE_IF_UNCHANGED, [generation, cache], *args)
            pipe.execute()
        return len(metas)

    def _warm_code(self, session: Any, metas: list[WorkerMeta]) -> None:
        """Cache the current code of ``metas`` not cached yet, up to the cache's cap, a few
        versions per query (each may be up to the cap)."""
        with redis_errors(self.settings), self.redis.pipeline(transaction=False) as pipe:
            for meta in metas:
                pipe.exists(code_key(meta.id))
            cached = pipe.execute()
        wanted = [
            (uuid.UUID(meta.id), meta.version)
            for meta, found in zip(metas, cached, strict=True)
            if not found
        ]
        for start in range(0, len(wanted), _WARM_CODE_PER_QUERY):
            rows = session.execute(
                select(WorkerVersion.worker_id, WorkerVersion.sha256, WorkerVersion.code).where(
                    tuple_(WorkerVersion.worker_id, WorkerVersion.version).in_(
                        wanted[start : start + _WARM_CODE_PER_QUERY]
                    ),
                    func.length(WorkerVersion.code) <= _CODE_CACHE_MAX_BYTES,
                )
            ).all()
            with redis_errors(self.settings), self.redis.pipeline(transaction=False) as pipe:
                for worker_id, sha256, code in rows:
                    entry = _code_entry(sha256, bytes(code))
                    pipe.set(code_key(str(worker_id)), entry, ex=_CODE_CACHE_TTL_S)
                pipe.execute()

    def code(self, worker_id: str, version: int, sha256: str | None = None) -> bytes:
        """The code of a version; the current one's (its ``sha256`` given) from the cache
        when another process loaded it lately (a node fleet starting with many workers loads
        each once per pool process: from the database, that was most of a first delivery)."""
        if sha256 is not None:
            with redis_errors(self.settings):
                code = cached_code(self.redis.get(code_key(worker_id)), sha256)
            if code is not None:
                return code
        return self.stored_code(worker_id, version, sha256)

    def stored_code(self, worker_id: str, version: int, sha256: str | None = None) -> bytes:
        """The code of a version, from the database; the current one's (``sha256`` given)
        cached for the next process."""
        with store.session_scope(self.settings) as session:
            row = session.get(WorkerVersion, (uuid.UUID(worker_id), version))
            if row is None:
                raise VersionNotFound(f"worker {worker_id} has no version {version}")
            code = bytes(row.code)
        if sha256 == row.sha256 and len(code) <= _CODE_CACHE_MAX_BYTES:
            with redis_errors(self.settings):
                entry = _code_entry(sha256, code)
                self.redis.set(code_key(worker_id), entry, ex=_CODE_CACHE_TTL_S)
        return code

    def invalidate(self, worker_id: str | None = None) -> None:
        """Forget one worker or share (after a change) or all of them (reconcile)."""
        with redis_errors(self.settings):
            if worker_id is None:
                for key in self.redis.scan_iter(match=_KEY + "*", count=500):
                    self.redis.delete(key)
            else:
                cache, generation = _keys(worker_id)
                pipe = self.redis.pipeline(transaction=True)
                pipe.incr(generation)
                pipe.expire(generation, GENERATION_TTL_S)
                pipe.delete(cache, _share_key(worker_id))
                pipe.execute()


def code_key(worker_id: str) -> str:
    """Where the worker's current code is cached, beside its facts (the same hash tag)."""
    return f"{_KEY}{{{worker_id}}}{_CODE_SUFFIX}"


def _code_entry(sha256: str, code: bytes) -> bytes:
    """A cache entry of ``code``, whose SHA-256 is ``sha256`` (what :func:`cached_code` reads)."""
    return sha256.encode() + code


def cached_code(entry: Any, sha256: str) -> bytes | None:
    """The code a cache entry holds, if it is the code whose SHA-256 is ``sha256``."""
    if not isinstance(entry, bytes) or entry[:_SHA256_HEX] != sha256.encode():
        return None
    code = entry[_SHA256_HEX:]
    return code if hashlib.sha256(code).hexdigest() == sha256 else None


def find_keys(target: str) -> list[str]:
    """What :meth:`Directory.find` reads of ``target`` before the keys it is given: its
    cache entry, its generation and the entry it would have as a shared group."""
    return [*_keys(target), _share_key(target)]


def _share_key(share_id: str) -> str:
    """A share's entry ``wm:worker:{<share id>}:share``, beside where a worker's would be."""
    return f"{_KEY}{{{share_id}}}:share"


def _keys(worker_id: str) -> tuple[str, str]:
    """The worker's cache entry ``wm:worker:{<id>}`` and generation
    ``wm:worker-generation:{<id>}``: hash-tagged with its id, as its outcomes and pending
    ledger are, so one MGET reads them with an outcome on a Redis Cluster too."""
    return f"{_KEY}{{{worker_id}}}", f"{_GENERATION}{{{worker_id}}}"


def _meta(worker: Worker, sha256: str, limits: dict[str, Any] | None) -> WorkerMeta:
    return WorkerMeta(
        str(worker.id),
        worker.topic,
        worker.group,
        worker.mime_type,
        worker.status,
        worker.current_version,
        sha256,
        dict(worker.settings or {}),
        worker.name,
        limits,
    )
