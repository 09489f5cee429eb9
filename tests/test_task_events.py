"""Celery task events: off by default (each costs a broker publish), on with WM_TASK_EVENTS,
and switched on at run time by Flower's ``enable_events`` broadcast."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.helpers import STUB, drain, stub
from wm import Settings, WorkManager, make_event
from wm.dataplane.app import celery_settings, make_app


def test_task_events_are_off_unless_asked_for() -> None:
    off = celery_settings(Settings.from_env({}))
    assert (off["worker_send_task_events"], off["task_send_sent_event"]) == (False, False)
    on = celery_settings(Settings.from_env({"WM_TASK_EVENTS": "true"}))
    assert (on["worker_send_task_events"], on["task_send_sent_event"]) == (True, True)


class Watcher:
    """Collects the names of the task events a node sends."""

    def __init__(self, settings: Settings) -> None:
        self.app = make_app(settings)
        self.seen: list[str] = []
        self._receiver: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the event receiver did not start"

    def _run(self) -> None:
        with self.app.connection() as connection:
            self._receiver = self.app.events.Receiver(
                connection, handlers={"*": lambda event: self.seen.append(event["type"])}
            )
            self._ready.set()
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def task_events(self) -> list[str]:
        return [name for name in self.seen if name.startswith("task-")]

    def stop(self) -> None:
        self._receiver.should_stop = True
        self._thread.join(timeout=10)


@pytest.mark.slow
def test_a_node_sends_task_events_only_once_flower_enables_them(
    pg_settings: Settings, start_node: Any
) -> None:
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="orders")
    node = start_node(fast)
    node.consuming(f"orders::{worker.id}")
    watcher = Watcher(fast)
    try:
        time.sleep(1.0)  # the receiver's queue is bound
        manager.publish(make_event("orders", "/tests", {"n": 1}))
        assert len(drain(fast, sink, 1)) == 1
        time.sleep(1.0)
        assert watcher.task_events() == []

        make_app(fast).control.enable_events()  # what Flower broadcasts while it watches
        time.sleep(1.0)
        manager.publish(make_event("orders", "/tests", {"n": 2}))
        assert len(drain(fast, sink, 1)) == 1
        deadline = time.monotonic() + 10
        while "task-succeeded" not in watcher.task_events() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "task-succeeded" in watcher.task_events()
    finally:
        watcher.stop()
