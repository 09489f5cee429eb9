"""The bench's pool phase on real nodes: every variant (prefork, threads, several nodes)
serves every queued event of every workload exactly once, and the report shows each (small
numbers: this checks the tool and that each pool delivers, not the speed); and the threads
of a ``-P threads`` pool, which share their process's engine cache, load a worker once."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from tests.workers import code
from wm import Settings, WorkManager
from wm.bench import pools
from wm.bench.rig import STUB, Rig
from wm.dataplane.enginecache import EngineCache
from wm.state.directory import Directory
from wm.state.ledger import Ledger

EVENTS = 60


@pytest.mark.slow
def test_every_variant_serves_every_event_and_is_reported(
    pg_settings: Settings,
    own_redis: tuple[int, object],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = f"redis://127.0.0.1:{own_redis[0]}"
    settings = pg_settings.replace(broker_url=f"{server}/0", redis_url=f"{server}/1")
    # the stubs append each execution begun to a trace: every event runs once, no more
    traces = {w: tmp_path / f"trace{n}.jsonl" for n, w in enumerate(pools.WORKLOADS)}
    workloads = {
        workload: (mime, _traced(source, traces[workload]) if mime == STUB else source)
        for workload, (mime, source) in pools.WORKLOADS.items()
    }
    monkeypatch.setattr(pools, "WORKLOADS", workloads)
    with Rig(settings) as rig:
        results = pools.measure(rig, tmp_path, EVENTS, repeats=1)
        # a drain ends when the ledger is empty: every event of every run was served
        workers = [queue.rpartition("::")[2] for queue in rig.queues if "::" in queue]
        assert len(workers) == len(pools.WORKLOADS)
        assert all(Ledger(settings).pending(worker) == 0 for worker in workers)
        pools.report(results, EVENTS, 1, rig)
    for workload, (mime, _) in workloads.items():
        if mime == STUB:
            runs = [
                json.loads(line)["event_id"] for line in traces[workload].read_text().splitlines()
            ]
            assert len(runs) == len(set(runs)) == EVENTS * len(pools.VARIANTS), workload
    out = capsys.readouterr().out
    assert [r.variant for r in results] == list(pools.VARIANTS)
    for result in results:
        assert all(len(result.rates[w]) == 1 and result.rate(w) > 0 for w in pools.WORKLOADS)
        assert result.rss and result.rss[0] > 0
        assert re.search(rf"^{re.escape(result.variant.name)}\s+\d+ \(\d+\) [\d.]+×", out, re.M)
    assert "celery.concurrency.thread:TaskPool" in out
    assert re.search(r"4 nodes x prefork 2: nodes (\S+@\S+\.\d, ){3}\S+@\S+\.3:", out)


def _traced(stub_code: bytes, trace: Path) -> bytes:
    return json.dumps(json.loads(stub_code) | {"trace": str(trace)}).encode()


def test_threads_of_one_process_load_a_worker_once(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A threads pool's consumers share the process's engine cache: a burst of first
    deliveries to one Python worker loads it once (one sandbox), and all of them get it."""
    directory = Directory(settings)
    worker_id = (
        WorkManager(settings)
        .create_worker(code=code("echo"), mime_type="text/x-python", topic="t")
        .id
    )
    meta = directory.get(str(worker_id))
    assert meta is not None
    loads: list[int] = []
    read = directory.code

    def code_of(worker: str, version: int, sha256: str | None = None) -> bytes:
        loads.append(version)
        return read(worker, version, sha256)

    monkeypatch.setattr(directory, "code", code_of)
    cache = EngineCache(settings, directory)
    start, loaded, done = threading.Barrier(8), threading.Barrier(9), threading.Event()
    got: list[object] = []

    def first_delivery() -> None:
        start.wait()
        got.append(cache.engine(meta, meta.version)[0])
        loaded.wait()
        done.wait()  # a pool's threads live on (a sandbox dies with the thread that made it)

    threads = [threading.Thread(target=first_delivery) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        loaded.wait(timeout=120)
        assert len(got) == 8 and len({id(engine) for engine in got}) == 1
        assert loads == [meta.version] and cache.processes() == 1  # no sandbox left unowned
    finally:
        done.set()
        for thread in threads:
            thread.join()
        cache.close()
