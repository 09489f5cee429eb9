"""The per-process engine cache: sized by memory, not by a count."""

from __future__ import annotations

import os
from typing import Any

import pytest

from engines.python.isolation import BOOTSTRAP
from tests.helpers import STUB, drain, stub
from tests.workers import child_pids, code
from wm import Settings, WorkManager, make_event
from wm.dataplane.enginecache import EngineCache, cache_budget_bytes
from wm.engine import resident_bytes
from wm.state.directory import Directory, WorkerMeta, code_key

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


#: A worker that keeps what each event asks it to allocate, as a leaking worker would.
GROWING = b"""
from wm.devkit import make_event

HELD = []


def process(event):
    grow_mb = event.get_data()["grow_mb"]
    HELD.append(b"x" * (grow_mb << 20))
    return make_event("grown", "/workers/growing", {"held_mb": len(HELD) * grow_mb})
"""
#: MiB each growing worker allocates per event, workers, and the node's engine budget: the
#: sandboxes as loaded fit the budget together, grown they hold several times it.
GROW_MB, GROWING_WORKERS, BUDGET_MB = 100, 8, 256


@pytest.mark.slow
def test_engines_that_grow_are_charged_what_they_hold_and_unloaded_beyond_the_budget(
    pg_settings: Settings, start_node: Any
) -> None:
    """Finding 7: 8 workers grown to 350 MB each under a 512 MB budget held 2,949 MiB, as
    each was charged what it used when loaded. Now each sandbox is charged its resident
    memory as sampled, the least recently used are unloaded, and their next delivery loads
    them again."""
    settings = pg_settings.replace(reconcile_interval_s=1.0, engine_cache_mb=BUDGET_MB)
    manager = WorkManager(settings)
    sink = manager.subscribe("grown", "sink")
    topics = [f"grow{n}" for n in range(GROWING_WORKERS)]
    for topic in topics:
        manager.create_worker(code=GROWING, mime_type=PYTHON, topic=topic)
    node = start_node(settings, concurrency=1)  # one process: one cache holds them all
    for topic in topics:
        node.consuming(topic)
    for round_ in (1, 2):  # the second round reloads what the first unloaded
        for topic in topics:
            manager.publish(make_event(topic, "/tests", {"grow_mb": GROW_MB}))
            [grown] = drain(settings, sink, 1, timeout_s=60)
            assert grown["data"]["held_mb"] in (GROW_MB, 2 * GROW_MB)
            held = _sandbox_mb(node.proc.pid)
            assert held <= BUDGET_MB + GROW_MB + 96, f"round {round_}, {topic}: {held} MiB"
    log = node.log.read_text(errors="replace")
    assert log.count("engines over WM_ENGINE_CACHE_MB") >= GROWING_WORKERS


def _sandbox_mb(ancestor: int) -> int:
    """MiB resident in the Python sandboxes below ``ancestor``."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _below(int(entry), ancestor) and _is_sandbox(int(entry)):
            total += resident_bytes(int(entry))
    return total >> 20


def _below(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
                pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


def _is_sandbox(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return BOOTSTRAP.encode() in handle.read().split(b"\0")
    except OSError:
        return False


def test_a_first_load_takes_the_code_the_delivery_read_beside_the_facts(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code a delivery's MGET found (its process had not loaded the worker) is loaded
    without another trip; an entry that is not the facts' code is replaced by the stored one."""
    directory, source = Directory(settings), stub(output_type="read.out")
    [meta, other] = _metas(settings, 2, STUB, source)
    entry = meta.sha256.encode() + source
    asked: list[str] = []
    stored = directory.stored_code

    def from_database(worker_id: str, version: int, sha256: str | None = None) -> bytes:
        asked.append(worker_id)
        return stored(worker_id, version, sha256)

    monkeypatch.setattr(directory, "code", lambda *args: pytest.fail("read the cache again"))
    monkeypatch.setattr(directory, "stored_code", from_database)
    cache = EngineCache(settings, directory)
    engine, _ = cache.engine(meta, meta.version, {code_key(meta.id): entry})
    assert asked == [] and cache.loaded(meta.id) is engine
    cache.engine(other, other.version, {code_key(other.id): other.sha256.encode() + b"{}"})
    assert asked == [other.id]
    cache.close()


def test_a_process_reads_its_own_resident_memory_after_a_fork() -> None:
    """Each process keeps its own ``/proc/self/statm`` open; a forked child that grows
    must not read its parent's through the descriptor it inherited."""
    assert abs(resident_bytes() - resident_bytes(os.getpid())) < 4 << 20  # opened here
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        page = os.sysconf("SC_PAGE_SIZE")
        grown = bytearray(256 << 20)
        grown[::page] = b"x" * len(grown[::page])
        os.write(write, f"{resident_bytes()} {resident_bytes(os.getpid())}".encode())
        os._exit(0)
    os.close(write)
    kept, by_path = map(int, os.read(read, 100).split())
    os.waitpid(child, 0)
    assert by_path > 256 << 20 and abs(kept - by_path) < 16 << 20, (kept, by_path)
