"""The per-process engine cache: sized by memory, not by a count."""

from __future__ import annotations

import os

from tests.helpers import STUB, stub
from tests.workers import child_pids, code
from wm import Settings, WorkManager
from wm.dataplane.enginecache import EngineCache, cache_budget_bytes
from wm.state.directory import Directory, WorkerMeta

PYTHON = "text/x-python"


def _metas(settings: Settings, count: int, mime_type: str, source: bytes) -> list[WorkerMeta]:
    manager, directory = WorkManager(settings), Directory(settings)
    ids = [
        str(manager.create_worker(code=source, mime_type=mime_type, topic=f"t{n}").id)
        for n in range(count)
    ]
    metas = [directory.get(wid) for wid in ids]
    assert all(meta is not None for meta in metas)
    return metas  # type: ignore[return-value]


def test_every_worker_a_process_serves_stays_loaded_while_memory_allows(
    settings: Settings,
) -> None:
    """Once a fixed 64: a process serving ~333 workers re-read code from the database."""
    cache = EngineCache(settings, Directory(settings))
    metas = _metas(settings, 100, STUB, stub())
    engines = [cache.engine(meta, meta.version)[0] for meta in metas]
    assert len(cache) == 100
    again = [cache.engine(meta, meta.version) for meta in metas]
    assert [engine for engine, _ in again] == engines  # each one served from the cache
    cache.close()


def test_beyond_the_budget_the_least_recently_used_are_unloaded(settings: Settings) -> None:
    """Each Python worker keeps a sandboxed interpreter: its memory is charged, and the
    sandboxes of unloaded workers end."""
    before = child_pids()
    cache = EngineCache(settings.replace(engine_cache_mb=1), Directory(settings))
    metas = _metas(settings, 3, PYTHON, code("echo"))
    first, _ = cache.engine(metas[0], metas[0].version)
    [sandbox] = first.processes()
    assert cache.charged_bytes > 1 << 20  # an interpreter is more than 1 MB
    cache.engine(metas[1], metas[1].version)
    assert len(cache) == 1  # the one just used stays, however large
    assert not os.path.exists(f"/proc/{sandbox}/stat") or _zombie(sandbox)
    roomy = EngineCache(settings.replace(engine_cache_mb=4096), Directory(settings))
    for meta in metas:
        roomy.engine(meta, meta.version)
    assert len(roomy) == 3
    cache.close()
    roomy.close()
    assert child_pids() <= before


def test_the_default_budget_is_half_the_memory_shared_by_the_node_processes(
    settings: Settings,
) -> None:
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert cache_budget_bytes(settings.replace(node_concurrency=4)) == physical // 2 // 4
    assert cache_budget_bytes(settings.replace(engine_cache_mb=300)) == 300 << 20


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] in {"Z", "X"}
