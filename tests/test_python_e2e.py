"""Python workers end to end: created with the CLI, run by real Celery nodes in the sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import drain, eventually, wm_cli
from wm import DeadLetters, Settings, WorkManager, make_event

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.slow
def test_cli_created_python_workers_process_events(settings: Settings, start_node: Any) -> None:
    fast = settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    echo_sink = manager.subscribe("echo.out", "sink")
    orders_sink = manager.subscribe("orders.result", "sink")
    errors_sink = manager.subscribe("orders.result.error", "sink")
    echo = wm_cli(
        fast,
        "worker",
        "create",
        "--topic",
        "in",
        "--mime-type",
        "text/x-python",
        "--file",
        str(WORKERS / "echo.py"),
    )
    orders = wm_cli(
        fast,
        "worker",
        "create",
        "--topic",
        "orders",
        "--mime-type",
        "text/x-python",
        "--file",
        "-",
        stdin=(WORKERS / "orders.py").read_text(),
    )
    node = start_node(fast)
    node.consuming(f"in::{echo['id']}")
    node.consuming(f"orders::{orders['id']}")

    manager.publish(
        make_event("in", "/tests", {"hello": "world"}, extensions={"correlationid": "corr-py"})
    )
    manager.publish(
        make_event(
            "orders",
            "/tests",
            {"command": "CREATE", "item": "book"},
            extensions={"correlationid": "corr-order"},
        )
    )
    manager.publish(make_event("orders", "/tests", {"command": "refund"}))

    [echoed] = drain(fast, echo_sink, 1)
    assert echoed["data"] == {"input": {"hello": "world"}}
    assert echoed["correlationid"] == "corr-py"
    [created] = drain(fast, orders_sink, 1)
    assert created["data"] == {"created": "book"} and created["correlationid"] == "corr-order"
    [refused] = drain(fast, errors_sink, 1)  # an output goes to the topic of its type
    assert refused["type"] == "orders.result.error"
    assert refused["data"] == {"error": "Unknown command: refund"}
    assert "correlationid" not in refused


@pytest.mark.slow
def test_python_timeout_retries_then_dead_letters(settings: Settings, start_node: Any) -> None:
    fast = settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    worker = manager.create_worker(
        code="def process(event):\n    while True:\n        pass\n",
        mime_type="text/x-python",
        topic="slow",
        settings={"timeout_s": 1, "max_retries": 1, "retry_base_delay_ms": 20},
    )
    node = start_node(fast)
    node.consuming(f"slow::{worker.id}")
    manager.publish(make_event("slow", "/tests", {}))
    [letter] = eventually(lambda: DeadLetters(fast).list(), timeout_s=60)
    assert letter.error_type == "WorkerTimeout" and letter.attempts == 2


@pytest.mark.slow
def test_python_hot_reload_through_a_running_node(settings: Settings, start_node: Any) -> None:
    fast = settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    sink = manager.subscribe("v", "sink")
    code = (
        "from wm.devkit import make_event\n\n"
        "def process(event):\n    return make_event('v', '/t', {{'v': {n}}})\n"
    )
    worker = manager.create_worker(code=code.format(n=1), mime_type="text/x-python", topic="in")
    node = start_node(fast)
    node.consuming(f"in::{worker.id}")
    manager.publish(make_event("in", "/tests", {}))
    assert drain(fast, sink, 1)[0]["data"] == {"v": 1}
    manager.load_code_from_content(worker.id, code.format(n=2))
    manager.publish(make_event("in", "/tests", {}))
    assert drain(fast, sink, 1)[0]["data"] == {"v": 2}


@pytest.mark.slow
def test_code_a_node_cannot_load_fails_the_worker_and_keeps_the_message(
    settings: Settings, start_node: Any
) -> None:
    """The admin allows numpy, the node does not: the worker goes to failed, its message waits
    in its queue, and a repaired worker processes it."""
    fast = settings.replace(reconcile_interval_s=1.0)
    admin = WorkManager(fast.replace(python_allowed_packages=("numpy",)))
    sink = admin.subscribe("out", "sink")
    code = (
        "import numpy\nfrom wm.devkit import make_event\n\ndef process(event):\n"
        "    return make_event('out', '/t', {})\n"
    )
    worker = admin.create_worker(code=code, mime_type="text/x-python", topic="in")
    node = start_node(fast)
    node.consuming(f"in::{worker.id}")
    admin.publish(make_event("in", "/tests", {}))
    eventually(lambda: admin.get_worker(worker.id).status == "failed")
    node.wait_for(f"Canceling queue in::{worker.id}")
    eventually(lambda: admin.bus.queue_depth(f"in::{worker.id}") == 1)
    assert DeadLetters(fast).list() == []
    last = admin.get_worker_transitions(worker.id)[-1]
    assert last.to_status == "failed" and "numpy" in last.reason

    admin.load_code_from_content(worker.id, code.replace("import numpy\n", ""))
    admin.start_worker(worker.id)
    assert len(drain(fast, sink, 1)) == 1
