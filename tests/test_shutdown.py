"""Stopping a node (SIGTERM) with real processes: deliveries that finish within
WM_SHUTDOWN_GRACE_S are let finish; one that does not is ended when the grace runs out,
delivered again to another node, and its output arrives once: nothing lost."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import STUB, drain, eventually, queue_empty, stub
from wm import Settings, WorkManager, make_event
from wm.state.ledger import Ledger


def _runs(trace: Path) -> int:
    return len(trace.read_text().splitlines()) if trace.exists() else 0


def _stop(node: Any) -> float:
    """SIGTERM to the node's main process, as a service manager sends it; seconds to exit."""
    started = time.monotonic()
    os.kill(node.proc.pid, signal.SIGTERM)
    node.proc.wait(timeout=60)
    return time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_a_delivery_past_the_grace_is_ended_and_delivered_again_once(
    broker: str, pg_settings: Settings, start_node: Any, tmp_path: Path, request: Any
) -> None:
    settings = pg_settings if broker == "redis" else request.getfixturevalue("amqp_settings")
    settings = settings.replace(shutdown_grace_s=1.0)
    trace = tmp_path / "runs.jsonl"
    manager = WorkManager(settings)
    topic, done = f"slow.{tmp_path.name}", f"slow.done.{tmp_path.name}"
    sink = manager.subscribe(done, "sink")
    worker = manager.create_worker(
        code=stub(output_type=done, sleep_ms=5000, trace=str(trace)),
        mime_type=STUB,
        topic=topic,
    )
    first = start_node(settings, name="stopping")
    first.consuming(f"{topic}::{worker.id}")
    manager.publish(make_event(topic, "/tests", {"n": 1}))
    eventually(lambda: _runs(trace) == 1, timeout_s=20, interval_s=0.05)

    took_s = _stop(first)
    assert took_s < 4.5, took_s  # ended after the grace, long before its 5 s run would end
    assert "WM_SHUTDOWN_GRACE_S" in first.log.read_text()
    assert drain(settings, sink, 1, timeout_s=0.5) == []  # the run was cut: no output

    second = start_node(settings, name="taking-over")
    second.consuming(f"{topic}::{worker.id}")
    [output] = drain(settings, sink, 1, timeout_s=30)
    assert output["data"]["input"] == {"n": 1}
    assert queue_empty(settings, sink, wait_s=2.0)
    assert _runs(trace) == 2
    eventually(lambda: Ledger(settings).pending(str(worker.id)) == 0, timeout_s=10)
    manager.delete_worker(worker.id)
    manager.unsubscribe(done, "sink")


@pytest.mark.slow
def test_a_delivery_within_the_grace_finishes_before_the_node_exits(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    settings = pg_settings.replace(shutdown_grace_s=10.0)
    trace = tmp_path / "runs.jsonl"
    manager = WorkManager(settings)
    sink = manager.subscribe("brief.done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="brief.done", sleep_ms=1500, trace=str(trace)),
        mime_type=STUB,
        topic="brief",
    )
    node = start_node(settings, name="finishing")
    node.consuming(f"brief::{worker.id}")
    manager.publish(make_event("brief", "/tests", {"n": 1}))
    eventually(lambda: _runs(trace) == 1, timeout_s=20, interval_s=0.05)

    took_s = _stop(node)
    assert took_s < 10.0, took_s  # the grace is a limit, not a wait
    [output] = drain(settings, sink, 1, timeout_s=5)
    assert output["data"]["input"] == {"n": 1}
    assert _runs(trace) == 1
    assert "WM_SHUTDOWN_GRACE_S" not in node.log.read_text()
    assert Ledger(settings).pending(str(worker.id)) == 0
