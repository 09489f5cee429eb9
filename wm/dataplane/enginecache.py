"""Loaded engines of one process, by worker, within a memory budget."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

from wm.config import Settings
from wm.dataplane.observe import notify
from wm.engine import Engine, WorkerSpec, engine_class, resident_bytes
from wm.state.directory import Directory, WorkerMeta

logger = logging.getLogger(__name__)


class EngineCache:
    """Loaded engines by worker id, reloaded when the worker's version moves.

    Sized by memory, not by a count: a process keeps every worker it serves while they fit.
    Each engine is charged what loading it added to this process's resident memory plus the
    resident memory of the processes it keeps (:meth:`Engine.processes`); beyond
    ``WM_ENGINE_CACHE_MB`` the least recently used are closed, never the one just used.
    """

    def __init__(self, settings: Settings, directory: Directory) -> None:
        self.settings = settings
        self.directory = directory
        self.budget_bytes = cache_budget_bytes(settings)
        self._engines: OrderedDict[str, tuple[int, Engine, int]] = OrderedDict()
        self._lock = threading.Lock()
        #: Per worker: held while one thread (of a ``-P threads`` pool) loads it.
        self._loading: dict[str, threading.Lock] = {}

    def __len__(self) -> int:
        return len(self._engines)

    def processes(self) -> int:
        """Processes the loaded engines keep (sandboxes, helpers)."""
        return sum(len(engine.processes()) for _, engine, _ in list(self._engines.values()))

    @property
    def charged_bytes(self) -> int:
        """What the loaded engines are charged, together."""
        return sum(charge for _, _, charge in list(self._engines.values()))

    def engine(self, meta: WorkerMeta, version: int) -> tuple[Engine, bool]:
        """(engine, temporary): a pinned old version gets a temporary engine to close after."""
        if version != meta.version:
            return self._load(meta, version), True
        with self._lock:
            cached = self._engines.get(meta.id)
            if cached is not None and cached[0] == version:
                self._engines.move_to_end(meta.id)
                return cached[1], False
            loading = self._loading.setdefault(meta.id, threading.Lock())
        with loading:  # the threads that miss together wait for one load, not one each
            return self._load_cached(meta, version)

    def _load_cached(self, meta: WorkerMeta, version: int) -> tuple[Engine, bool]:
        with self._lock:
            cached = self._engines.get(meta.id)
            if cached is not None and cached[0] == version:  # loaded while this one waited
                self._engines.move_to_end(meta.id)
                return cached[1], False
        engine = cached[1] if cached is not None else None
        if engine is None:
            engine = engine_class(meta.mime_type)(self.settings)
        before = resident_bytes()
        engine.load(self.directory.code(meta.id, version), _spec(meta, version))
        charge = max(0, resident_bytes() - before) + sum(map(resident_bytes, engine.processes()))
        with self._lock:
            self._engines[meta.id] = (version, engine, charge)
            self._engines.move_to_end(meta.id)
            evicted = self._evict()
        for old in evicted:  # outside the lock: closing may wait for calls in flight
            old.close()
        notify("engines", meta, len(self))
        notify("sandboxes", meta, self.processes())
        return engine, False

    def _load(self, meta: WorkerMeta, version: int) -> Engine:
        engine = engine_class(meta.mime_type)(self.settings)
        engine.load(self.directory.code(meta.id, version), _spec(meta, version))
        return engine

    def _evict(self) -> list[Engine]:
        """The least recently used engines beyond the budget, taken out of the cache."""
        evicted = []
        total = self.charged_bytes
        while total > self.budget_bytes and len(self._engines) > 1:
            worker_id, (_, engine, charge) = self._engines.popitem(last=False)
            logger.info("unloading worker %s: engines over WM_ENGINE_CACHE_MB", worker_id)
            evicted.append(engine)
            total -= charge
        return evicted

    def loaded(self, worker_id: str) -> Engine | None:
        with self._lock:
            cached = self._engines.get(worker_id)
        return cached[1] if cached is not None else None

    def drop(self, worker_id: str) -> Engine | None:
        """Take the worker's engine out of the cache (the caller closes it)."""
        with self._lock:
            cached = self._engines.pop(worker_id, None)
        return cached[1] if cached is not None else None

    def close(self) -> None:
        with self._lock:
            for _, engine, _ in self._engines.values():
                engine.close()
            self._engines.clear()


def cache_budget_bytes(settings: Settings) -> int:
    """``WM_ENGINE_CACHE_MB``, or half the machine's memory shared by the node's processes."""
    if settings.engine_cache_mb > 0:
        return settings.engine_cache_mb << 20
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    processes = settings.node_concurrency or os.cpu_count() or 1
    return physical // 2 // processes


def _spec(meta: WorkerMeta, version: int) -> WorkerSpec:
    return WorkerSpec(meta.id, meta.topic, meta.group, version, meta.sha256, None, meta.settings)
