"""The worker cache nodes read: a read that raced a committed change is never cached."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
import redis

from tests.helpers import STUB, stub
from wm import Settings, WorkManager
from wm.state import directory as directory_module
from wm.state.directory import Directory, WorkerMeta, cached_code, code_key


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


def test_code_is_read_once_from_the_database_then_from_redis_and_never_wrong(
    settings: Settings,
) -> None:
    """The pool processes after the first read the current version's code from Redis, beside
    the worker's facts; an entry that is not the code of the facts' SHA-256 (tampered with,
    or an older version's) is not used, and code over the cap is never cached."""
    manager = WorkManager(settings)
    code = stub(output_type="cached.out")
    worker = manager.create_worker(code=code, mime_type=STUB, topic="t")
    wid, sha256 = str(worker.id), hashlib.sha256(code).hexdigest()
    state, directory = redis.Redis.from_url(settings.redis_url), Directory(settings)
    key = code_key(wid)
    assert key == f"wm:worker:{{{wid}}}:code"  # the worker's hash tag: one MGET with its facts
    assert state.get(key) is None
    assert directory.code(wid, 1, sha256) == code
    assert state.get(key) == sha256.encode() + code and 0 < state.ttl(key) <= 600

    def no_database() -> None:
        raise AssertionError("the database was read")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(directory_module.store, "session_scope", no_database)
        assert Directory(settings).code(wid, 1, sha256) == code  # from Redis alone

    for wrong in (sha256.encode() + b"not this code", b"0" * 64 + code, b"short"):
        state.set(key, wrong)  # the database answers, and mends the entry
        assert cached_code(wrong, sha256) is None
        assert directory.code(wid, 1, sha256) == code
        assert state.get(key) == sha256.encode() + code

    big = stub(output_type="x" * (1 << 20))
    version = manager.load_code_from_content(wid, big).current_version
    big_sha = hashlib.sha256(big).hexdigest()
    assert directory.code(wid, version, big_sha) == big
    assert state.get(key) == sha256.encode() + code  # left as it was: never used again


def test_warming_caches_the_facts_and_code_of_many_workers_in_a_few_queries(
    settings: Settings,
) -> None:
    """A starting node caches what the first deliveries to each worker would read: every
    worker's facts (what a miss would read, one query per chunk, not per worker) and its
    code; an entry a change was announced over meanwhile is not written."""
    manager = WorkManager(settings)
    codes = [stub(output_type=f"warm.{n}") for n in range(12)]
    ids = [
        str(manager.create_worker(code=code, mime_type=STUB, topic=f"warm{n}").id)
        for n, code in enumerate(codes)
    ]
    state, directory = redis.Redis.from_url(settings.redis_url), Directory(settings)
    expected = {wid: directory.load(wid) for wid in ids}
    for wid in ids:  # the facts the creations cached, and the generation bumped once more
        state.delete(f"wm:worker:{{{wid}}}")
    state.incr(f"wm:worker-generation:{{{ids[0]}}}")
    cached, raced = ids[1], ids[2]
    directory.get(cached)  # cached already: not read again

    queries: list[str] = []
    reading = directory_module.store.session_scope

    def counted(*args: object, **kwargs: object) -> object:
        queries.append("session")
        return reading(*args, **kwargs)  # type: ignore[arg-type]

    warm_code = directory_module.Directory._warm_code

    def change_announced(self: Directory, session: object, metas: list[WorkerMeta]) -> None:
        state.incr(f"wm:worker-generation:{{{raced}}}")  # a change committed meanwhile
        warm_code(self, session, metas)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(directory_module.store, "session_scope", counted)
        patch.setattr(directory_module.Directory, "_warm_code", change_announced)
        assert directory.warm([*ids, str(uuid.uuid4())]) == len(ids) - 1
    assert queries == ["session"]
    for wid, code in zip(ids, codes, strict=True):
        facts = state.get(f"wm:worker:{{{wid}}}")
        assert facts is None if wid == raced else WorkerMeta(**json.loads(facts)) == expected[wid]
        entry = hashlib.sha256(code).hexdigest().encode() + code
        warmed = state.get(code_key(wid))
        assert warmed == (None if wid == cached else entry)  # its facts cached: left alone
    assert directory.warm(ids) == 1  # only the one not cached
