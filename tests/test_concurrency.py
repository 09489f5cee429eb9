"""Concurrent updates of one worker from two real processes never lose an update."""

from __future__ import annotations

import multiprocessing as mp

from tests.helpers import STUB, stub
from wm import Settings, WorkManager

UPDATES_PER_PROCESS = 15


def _update_many(settings: Settings, worker_id: str, tag: str) -> None:
    manager = WorkManager(settings)
    for n in range(UPDATES_PER_PROCESS):
        manager.load_code_from_content(worker_id, stub(output_type=f"{tag}-{n}"))
        if n % 5 == 0:
            manager.stop_worker(worker_id)
            manager.start_worker(worker_id)


def test_two_processes_updating_one_worker(settings: Settings) -> None:
    manager = WorkManager(settings)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_update_many, args=(settings, str(worker.id), tag)) for tag in ("a", "b")
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)
        assert proc.exitcode == 0
    history = manager.get_worker_history(worker.id)
    assert [v.version for v in history] == list(range(1, 2 * UPDATES_PER_PROCESS + 2))
    codes = {manager.get_code(worker.id, v.version) for v in history[1:]}
    expected = {stub(output_type=f"{tag}-{n}") for tag in "ab" for n in range(UPDATES_PER_PROCESS)}
    assert codes == expected
    final = manager.get_worker(worker.id)
    assert final.current_version == 2 * UPDATES_PER_PROCESS + 1
    assert final.status == "running"
    code_updates = [
        t for t in manager.get_worker_transitions(worker.id) if t.reason.startswith("code updated")
    ]
    assert len(code_updates) == 2 * UPDATES_PER_PROCESS
