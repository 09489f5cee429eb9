"""Loaded engines of one process, by worker, within a memory budget."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wm.config import Settings
from wm.dataplane.observe import notify
from wm.engine import Engine, WorkerSpec, engine_class, resident_bytes, tree_resident_bytes
from wm.names import bare_group, split_route_topic
from wm.state.directory import Directory, WorkerMeta, cached_code, code_key

logger = logging.getLogger(__name__)

#: Seconds between two samples of an engine handed out again and again with no other in
#: between (reading a sandbox's memory from ``/proc`` on every event cost 3 % of a batch).
RESAMPLE_S = 1.0


@dataclass
class _Loaded:
    """One cached engine: its version, what loading it added to this process (fixed), and
    what it was charged when last sampled."""

    version: int
    engine: Engine
    in_process: int
    charge: int = 0
    sampled_at: float = 0.0

    def sample(self) -> int:
        """Charge the engine its current memory: its processes' resident memory now, plus
        what loading it added to this process; returns how much the charge grew."""
        before = self.charge
        self.charge = self.in_process + sum(map(tree_resident_bytes, self.engine.processes()))
        self.sampled_at = time.monotonic()
        return self.charge - before


class EngineCache:
    """Loaded engines by worker id, reloaded when the worker's version moves.

    Sized by memory, not by a count: a process keeps every worker it serves while they fit.
    Each engine is charged what it holds now, sampled: the resident memory of the processes
    it keeps (:meth:`Engine.processes`: a sandbox, a helper), re-read whenever the engine was
    handed out since the last sample (a child's memory grows only while it runs; one handed
    out again with no other in between, at most every :data:`RESAMPLE_S`), plus what
    loading it added to this process's resident memory. Code that runs in this process
    shares its heap with every other engine, so what it allocates later cannot be told apart
    and stays uncharged (the pool process's own memory limit bounds it). Beyond
    ``WM_ENGINE_CACHE_MB`` the least recently used are closed, never the one being handed
    out; a closed worker's next delivery loads it again.
    """

    def __init__(self, settings: Settings, directory: Directory) -> None:
        self.settings = settings
        self.directory = directory
        self.budget_bytes = cache_budget_bytes(settings)
        self._engines: OrderedDict[str, _Loaded] = OrderedDict()
        self._lock = threading.Lock()
        #: Per worker: held while one thread (of a ``-P threads`` pool) loads it.
        self._loading: dict[str, threading.Lock] = {}
        #: Workers whose engines were handed out since their last sample.
        self._used: set[str] = set()
        #: What the loaded engines are charged, together (kept as charges change).
        self._charged = 0
        #: Workers whose engines may keep processes (their class says so): the gauge of
        #: sandboxes, read after every load, asks these alone (asking each of a thousand
        #: loaded engines made a load's cost grow with the cache).
        self._keeping: set[str] = set()

    def __len__(self) -> int:
        return len(self._engines)

    def processes(self) -> int:
        """Processes the loaded engines keep (sandboxes, helpers)."""
        with self._lock:
            keeping = [self._engines[worker_id].engine for worker_id in self._keeping]
        return sum(len(engine.processes()) for engine in keeping)

    @property
    def charged_bytes(self) -> int:
        """What the loaded engines are charged, together (as last sampled)."""
        return self._charged

    def engine(
        self, meta: WorkerMeta, version: int, read: Mapping[str, Any] | None = None
    ) -> tuple[Engine, bool]:
        """(engine, temporary): a pinned old version gets a temporary engine to close after.
        ``read``: what the delivery's first round trip read, by key (the worker's cached code
        among it when this process had not loaded the worker)."""
        if version != meta.version:
            return self._load(meta, version), True
        hit = self._hit(meta, version)
        if hit is not None:
            return hit, False
        with self._lock:
            loading = self._loading.setdefault(meta.id, threading.Lock())
        with loading:  # the threads that miss together wait for one load, not one each
            return self._load_cached(meta, version, read or {}), False

    def _hit(self, meta: WorkerMeta, version: int) -> Engine | None:
        """The cached engine of ``version``, handed out; None when there is none."""
        with self._lock:
            cached = self._engines.get(meta.id)
            if cached is None or cached.version != version:
                return None
            evicted = self._handing_out(meta.id)
        self._close(evicted, meta)
        return cached.engine

    def _load_cached(self, meta: WorkerMeta, version: int, read: Mapping[str, Any]) -> Engine:
        hit = self._hit(meta, version)  # loaded while this one waited
        if hit is not None:
            return hit
        with self._lock:
            cached = self._engines.get(meta.id)
        engine = (
            cached.engine if cached is not None else engine_class(meta.mime_type)(self.settings)
        )
        before = resident_bytes()
        engine.load(_current_code(self.directory, meta, read), _spec(meta, version))
        loaded = _Loaded(version, engine, max(0, resident_bytes() - before))
        loaded.sample()
        with self._lock:
            replaced = self._engines.get(meta.id)
            self._charged += loaded.charge - (replaced.charge if replaced else 0)
            self._engines[meta.id] = loaded
            if type(engine).processes is not Engine.processes:
                self._keeping.add(meta.id)
            evicted = self._handing_out(meta.id)
        self._close(evicted, meta, loaded=True)
        return engine

    def _handing_out(self, worker_id: str) -> list[Engine]:
        """(With the lock.) Mark ``worker_id`` most recently used, re-sample the engines used
        since their last sample, and take out the least recently used beyond the budget."""
        self._engines.move_to_end(worker_id)
        now = time.monotonic()
        for used in self._used:
            loaded = self._engines.get(used)
            if loaded is None or (used == worker_id and now - loaded.sampled_at < RESAMPLE_S):
                continue
            self._charged += loaded.sample()
        self._used = {worker_id}
        return self._evict() if self._charged > self.budget_bytes else []

    def _close(self, evicted: list[Engine], meta: WorkerMeta, loaded: bool = False) -> None:
        """Close what was evicted, outside the lock (closing may wait for calls in flight),
        and tell the gauges when the engines changed."""
        for old in evicted:
            old.close()
        if evicted or loaded:
            notify("engines", meta, len(self))
            notify("sandboxes", meta, self.processes())

    def _load(self, meta: WorkerMeta, version: int) -> Engine:
        engine = engine_class(meta.mime_type)(self.settings)
        engine.load(self.directory.code(meta.id, version), _spec(meta, version))
        return engine

    def _evict(self) -> list[Engine]:
        """The least recently used engines beyond the budget, taken out of the cache."""
        evicted = []
        total = self.charged_bytes
        while total > self.budget_bytes and len(self._engines) > 1:
            worker_id, loaded = self._engines.popitem(last=False)
            logger.info(
                "unloading worker %s (%d MiB): engines over WM_ENGINE_CACHE_MB (%d MiB charged)",
                worker_id,
                loaded.charge >> 20,
                total >> 20,
            )
            evicted.append(loaded.engine)
            self._used.discard(worker_id)
            self._keeping.discard(worker_id)
            total -= loaded.charge
        self._charged = total
        return evicted

    def loaded(self, worker_id: str) -> Engine | None:
        with self._lock:
            cached = self._engines.get(worker_id)
        return cached.engine if cached is not None else None

    def drop(self, worker_id: str) -> Engine | None:
        """Take the worker's engine out of the cache (the caller closes it)."""
        with self._lock:
            cached = self._engines.pop(worker_id, None)
            self._keeping.discard(worker_id)
            if cached is not None:
                self._charged -= cached.charge
        return cached.engine if cached is not None else None

    def close(self) -> None:
        with self._lock:
            for loaded in self._engines.values():
                loaded.engine.close()
            self._engines.clear()
            self._keeping.clear()
            self._charged = 0


def cache_budget_bytes(settings: Settings) -> int:
    """``WM_ENGINE_CACHE_MB``, or half the machine's memory shared by the node's processes."""
    if settings.engine_cache_mb > 0:
        return settings.engine_cache_mb << 20
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    processes = settings.node_concurrency or os.cpu_count() or 1
    return physical // 2 // processes


def _current_code(directory: Directory, meta: WorkerMeta, read: Mapping[str, Any]) -> bytes:
    """The worker's current code: as the delivery read it beside the facts, or cached, or
    from the database."""
    key = code_key(meta.id)
    if key not in read:
        return directory.code(meta.id, meta.version, meta.sha256)
    code = cached_code(read[key], meta.sha256)
    return code if code is not None else directory.stored_code(meta.id, meta.version, meta.sha256)


def _spec(meta: WorkerMeta, version: int) -> WorkerSpec:
    tenant, topic = split_route_topic(meta.topic)
    group = bare_group(meta.group)
    return WorkerSpec(meta.id, topic, group, version, meta.sha256, None, meta.settings, tenant)
