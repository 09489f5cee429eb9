"""The cluster's transition metrics from the audit trail, on SQLite and PostgreSQL: the first
read adds up the whole trail, later ones only the rows recorded since, and each move's time
lands in the right bucket of the state it left (the queue depth needs a broker and a node:
``tests/test_ops_metrics.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import fresh_schema, make_settings
from wm import Settings, store
from wm.ops import clustermetrics
from wm.ops.clustermetrics import TransitionsCollector
from wm.store.models import Worker, WorkerTransition


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'wm.db'}"
    else:
        url = fresh_schema(request.getfixturevalue("pg_url"))
    result = make_settings(url)
    store.upgrade(result)
    yield result
    store.dispose_engines()


def _record(
    settings: Settings, moves: list[tuple[str | None, str, int | None]], ago_s: float = 10
) -> None:
    with store.session_scope(settings) as session:
        worker = Worker(
            id=uuid.uuid4(), topic="t", mime_type="m", status="running", current_version=1
        )
        session.add(worker)
        session.flush()
        for source, target, ms in moves:
            session.add(
                WorkerTransition(
                    worker_id=worker.id,
                    from_status=source,
                    to_status=target,
                    reason="test",
                    duration_ms=ms,
                    at=datetime.now(UTC) - timedelta(seconds=ago_s),
                )
            )


def _samples(collector: TransitionsCollector) -> dict[tuple[str, tuple[Any, ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_transitions_count_every_move_once_and_time_the_state_left(
    db: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    _record(
        db,
        [
            (None, "created", None),
            ("created", "starting", 500),  # 0.5 s: the 1 s bucket
            ("starting", "running", 2_000),  # 2 s: the 10 s bucket
            ("running", "running", None),  # a new version, same state: counted, not timed
        ],
    )
    collector = TransitionsCollector(db)
    first = _samples(collector)
    created = (("from_state", ""), ("to_state", "created"))
    assert first[("wm_worker_transitions_total", created)] == 1
    same = (("from_state", "running"), ("to_state", "running"))
    assert first[("wm_worker_transitions_total", same)] == 1
    assert first[("wm_worker_state_seconds_bucket", (("le", "1"), ("state", "created")))] == 1
    assert first[("wm_worker_state_seconds_bucket", (("le", "1"), ("state", "starting")))] == 0
    assert first[("wm_worker_state_seconds_bucket", (("le", "10"), ("state", "starting")))] == 1
    assert first[("wm_worker_state_seconds_sum", (("state", "starting"),))] == 2.0
    assert ("wm_worker_state_seconds_count", (("state", "running"),)) not in first

    _record(db, [("created", "starting", 90_000), ("running", "stopped", 10**9)])
    _record(db, [("stopped", "deleted", 1)], ago_s=0)  # its transaction may not have committed
    again = _samples(collector)  # the new rows only, added to what it had
    starting = (("from_state", "created"), ("to_state", "starting"))
    assert again[("wm_worker_transitions_total", starting)] == 2
    assert again[("wm_worker_transitions_total", created)] == 1
    assert again[("wm_worker_state_seconds_count", (("state", "created"),))] == 2
    assert again[("wm_worker_state_seconds_sum", (("state", "created"),))] == 90.5
    assert again[("wm_worker_state_seconds_bucket", (("le", "60"), ("state", "created")))] == 1
    assert again[("wm_worker_state_seconds_bucket", (("le", "300"), ("state", "created")))] == 2
    running = (("le", "+Inf"), ("state", "running"))  # past a week: only +Inf
    assert again[("wm_worker_state_seconds_bucket", running)] == 1
    assert again[("wm_worker_state_seconds_bucket", (("le", "604800"), ("state", "running")))] == 0
    assert _samples(collector) == again  # nothing new: nothing counted twice
    deleted = (("from_state", "stopped"), ("to_state", "deleted"))
    assert ("wm_worker_transitions_total", deleted) not in again
    monkeypatch.setattr(clustermetrics, "SETTLE_S", 0.0)  # its time to commit has passed
    assert _samples(collector)[("wm_worker_transitions_total", deleted)] == 1
