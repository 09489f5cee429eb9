"""Lifecycle events many at a time, on SQLite and on PostgreSQL: workers that change health
together are written in one transaction and their events leave the outbox in one flush;
flushes that race send each event once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from tests.helpers import STUB, drain, queue_empty, stub
from wm import WorkManager
from wm.dataplane import outbox, workerhealth
from wm.events import LIFECYCLE_TOPIC
from wm.state.health import HEALTHY, Tally
from wm.store import records


@contextmanager
def commits() -> Iterator[list[int]]:
    """Counts the transactions committed meanwhile (one entry each)."""
    seen: list[int] = []

    def count(session: Session) -> None:
        seen.append(1)

    event.listen(Session, "after_commit", count)
    try:
        yield seen
    finally:
        event.remove(Session, "after_commit", count)


def test_workers_changing_health_together_take_one_transaction_and_are_all_told(
    manager: WorkManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workerhealth, "LOCKED_PER_QUERY", 16)  # three queries lock them
    queue = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    workers = [
        manager.create_worker(code=stub(), mime_type=STUB, topic=f"hc.t{n}") for n in range(40)
    ]
    drain(manager.settings, queue, 200, timeout_s=1)  # their creation's events
    before = {w.id: manager.get_worker(w.id).updated_at for w in workers}
    tally = Tally()
    for worker in workers:
        tally.add(str(worker.id), ok=True)
    tally.flush_if_due(manager.settings)

    with commits() as committed:
        changed = workerhealth.judge_all(manager.settings, manager.bus)
    assert changed == 40
    # the read, the write and the flush (a write per worker made 42)
    assert len(committed) <= 3, f"{len(committed)} transactions for 40 changes"
    told = drain(manager.settings, queue, 40, timeout_s=10)
    assert sorted(e["subject"] for e in told) == sorted(str(w.id) for w in workers)
    assert {e["data"]["to_health"] for e in told} == {HEALTHY}
    assert queue_empty(manager.settings, queue, 0.5)
    assert all(manager.get_worker(w.id).updated_at > before[w.id] for w in workers)
    assert workerhealth.judge_all(manager.settings, manager.bus) == 0  # nothing new to tell


def test_racing_flushes_send_every_event_once(manager: WorkManager) -> None:
    queue = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="race")
    drain(manager.settings, queue, 10, timeout_s=1)

    def write(session: Session) -> Any:
        row = records.lock_worker(session, worker.id)
        for n in range(120):
            records.add_outbox(session, "health_changed", row, {"n": n}, reason="race")

    records.transaction(manager.settings, write)
    sent: list[int] = []
    flushers = [
        threading.Thread(target=lambda: sent.append(outbox.flush(manager.settings, manager.bus)))
        for _ in range(4)
    ]
    for flusher in flushers:
        flusher.start()
    for flusher in flushers:
        flusher.join()
    assert sum(sent) == 120, sent
    told = [e["data"]["n"] for e in drain(manager.settings, queue, 120, timeout_s=10)]
    assert sorted(told) == list(range(120))
    assert queue_empty(manager.settings, queue, 0.5)
    assert outbox.flush(manager.settings, manager.bus) == 0
