"""Native workers end to end: zips built by native_abi's Makefile, created with the CLI, run
by real prefork Celery nodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import drain, eventually, wm_cli
from wm import DeadLetters, Settings, WorkManager, make_event
from wm.events import LIFECYCLE_TOPIC, LIFECYCLE_TYPE_PREFIX

NATIVE = "application/x-native-dll"


@pytest.mark.slow
def test_c_and_cpp_workers_created_from_the_cli_run_on_prefork_nodes(
    pg_settings: Settings, start_node: Any, native_zips: dict[str, Path], gateway_port: int
) -> None:
    fast = pg_settings.replace(reconcile_interval_s=1.0, gateway_allowed_hosts=("127.0.0.1",))
    manager = WorkManager(fast)
    done = manager.subscribe("orders.processed", "sink")
    errors = manager.subscribe("orders.error", "sink")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    c_worker = wm_cli(
        fast,
        *("worker", "create", "--topic", "orders", "--mime-type", NATIVE),
        *("--file", str(native_zips["c-example"]), "--group", "c"),
        *("--setting", "api_host=127.0.0.1", "--setting", f"api_port={gateway_port}"),
    )
    cpp_worker = wm_cli(
        fast,
        *("worker", "create", "--topic", "orders", "--mime-type", NATIVE),
        *("--file", str(native_zips["cpp-example"])),
    )
    node = start_node(fast)
    node.consuming(f"orders::{c_worker['id']}")
    node.consuming(f"orders::{cpp_worker['id']}")

    manager.publish(
        make_event("orders", "/tests", {"item": "book"}, extensions={"correlationid": "corr-n"})
    )
    outputs = drain(fast, done, 2)
    assert {o["engine"] for o in outputs} == {"c", "cpp"}
    assert {o["workerid"] for o in outputs} == {c_worker["id"], cpp_worker["id"]}
    for output in outputs:
        assert output["data"] == {"ITEM": "BOOK"} and output["correlationid"] == "corr-n"

    manager.publish(make_event("orders", "/tests", {"q": 1}, subject="gateway"))
    answers = drain(fast, done, 1) + drain(fast, errors, 1)
    by_engine = {a.get("engine", "error"): a for a in answers}
    assert by_engine["c"]["data"] == {"path": "/echo/ping", "got": {"q": 1}}
    # the C++ worker has no api_host: its answer is an error response, and worker.error
    assert "gateway call failed" in by_engine["error"]["data"]["error"]
    reported = [
        e
        for e in drain(fast, lifecycle, 50, timeout_s=5)
        if e["type"] == LIFECYCLE_TYPE_PREFIX + "error"
    ]
    assert [e["data"]["worker_id"] for e in reported] == [cpp_worker["id"]]
    assert reported[0]["data"]["error_type"] == "WorkerAnswer"
    assert DeadLetters(fast).list() == []


@pytest.mark.slow
def test_failures_retry_then_dead_letter_and_a_crash_in_isolation_spares_the_node(
    pg_settings: Settings, start_node: Any, native_zips: dict[str, Path]
) -> None:
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    done = manager.subscribe("crashy.processed", "sink")
    settings = {
        "max_retries": 1,
        "retry_base_delay_ms": 20,
        "isolation": "subprocess",
    }
    crashy = manager.create_worker(
        code=native_zips["misbehave"].read_bytes(),
        mime_type=NATIVE,
        topic="crashy",
        settings=settings,
    )
    failing = manager.create_worker(
        code=native_zips["c-example"].read_bytes(),
        mime_type=NATIVE,
        topic="failing",
        settings={"max_retries": 1, "retry_base_delay_ms": 20},
    )
    node = start_node(fast, concurrency=1)
    node.consuming(f"crashy::{crashy.id}")
    node.consuming(f"failing::{failing.id}")

    manager.publish(make_event("crashy", "/tests", {}, subject="crash"))
    manager.publish(make_event("failing", "/tests", {}, subject="rc"))
    letters = eventually(lambda: len(DeadLetters(fast).list()) == 2 and DeadLetters(fast).list())
    by_topic = {letter.topic: letter for letter in letters}
    assert by_topic["crashy"].attempts == 2
    assert "killed by SIGSEGV" in by_topic["crashy"].error_message
    assert by_topic["failing"].error_type == "NativeCallFailed"
    assert "2 (VIRTUFIN_ERR_INTERNAL)" in by_topic["failing"].error_message

    manager.publish(make_event("crashy", "/tests", {"after": "crash"}))
    [after] = drain(fast, done, 1)
    assert after["data"] == {"AFTER": "CRASH"}
    assert node.proc.poll() is None


@pytest.mark.slow
def test_an_event_that_keeps_crashing_in_process_code_is_parked(
    pg_settings: Settings, start_node: Any, native_zips: dict[str, Path]
) -> None:
    """In-process, a segfault kills the pool process and Celery redelivers the message: such
    redeliveries are counted, and past the worker's attempts the event is parked."""
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    done = manager.subscribe("inproc.processed", "sink")
    worker = manager.create_worker(
        code=native_zips["misbehave"].read_bytes(),
        mime_type=NATIVE,
        topic="inproc",
        settings={"max_retries": 1},  # two crashes: degraded, not paused (health_min_deliveries)
    )
    node = start_node(fast)
    node.consuming(f"inproc::{worker.id}")

    manager.publish(make_event("inproc", "/tests", {}, subject="crash"))
    [letter] = eventually(lambda: DeadLetters(fast).list(), timeout_s=90)
    assert letter.error_type == "WorkerCrashed"
    assert "died 2 times before finishing it" in letter.error_message
    assert node.log.read_text().count("SIGSEGV") >= 2

    manager.publish(make_event("inproc", "/tests", {"after": "crashes"}))
    [after] = drain(fast, done, 1)
    assert after["data"] == {"AFTER": "CRASHES"}
    assert node.proc.poll() is None
