"""The worker cache nodes read: a read that raced a committed change is never cached."""

from __future__ import annotations

import redis

from tests.helpers import STUB, stub
from wm import Settings, WorkManager
from wm.state.directory import Directory, WorkerMeta


def test_a_read_that_raced_a_change_is_not_cached(settings: Settings) -> None:
    manager = WorkManager(settings)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="t")
    wid = str(worker.id)
    state = redis.Redis.from_url(settings.redis_url)
    directory = Directory(settings)
    read_from_database = directory.load

    def load_while_the_worker_stops(worker_id: str) -> WorkerMeta | None:
        meta = read_from_database(worker_id)  # reads "running"...
        manager.stop_worker(worker_id)  # ...then a change commits and is announced
        return meta

    directory.load = load_while_the_worker_stops  # type: ignore[method-assign]
    assert directory.get(wid).status == "running"  # type: ignore[union-attr]
    assert state.get(f"wm:worker:{{{wid}}}") is None  # the stale read was not cached
    directory.load = read_from_database  # type: ignore[method-assign]
    assert directory.get(wid).status == "stopped"  # type: ignore[union-attr]
    assert state.get(f"wm:worker:{{{wid}}}") is not None
