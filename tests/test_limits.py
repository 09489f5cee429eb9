"""Time, output and memory limits of code that runs inside a node's pool process (issue 25,
finding 5), on real prefork nodes: a call that never returns is taken over at its limit (a
``WorkerTimeout``, ``worker.error``, a retry or dead letter) and its pool process replaced; a
.NET task still spinning after its limit has its process replaced too; one output cap for
every engine; ``max_memory_mb`` replaces a pool process that grew past it, losing nothing."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import drain, eventually
from wm import DeadLetters, Settings, WorkManager, make_event
from wm.events import LIFECYCLE_TOPIC, LIFECYCLE_TYPE_PREFIX

NATIVE = "application/x-native-dll"
SOURCE = "text/x-csharp"
WORKER_ERROR = LIFECYCLE_TYPE_PREFIX + "error"


def pool_pids(node: Any) -> set[int]:
    """The node's pool processes (the children of its main process)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == node.proc.pid:
                pids.add(int(entry))
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def worker_errors(settings: Settings, queue: str, count: int, timeout_s: float = 60) -> list[Any]:
    seen: list[dict[str, Any]] = []

    def enough() -> list[dict[str, Any]] | None:
        seen.extend(e for e in drain(settings, queue, 100, timeout_s=0.5) if e["type"] == WORKER_ERROR)
        return seen if len(seen) >= count else None

    return list(eventually(enough, timeout_s=timeout_s))


def csharp(body: str) -> str:
    usings = "using System;\nusing System.Threading.Tasks;\nusing Virtufin.Worker.DevKit;\n"
    return usings + textwrap.dedent(body)


@pytest.mark.slow
def test_a_native_call_that_never_returns_ends_at_its_limit_and_its_process_is_replaced(
    pg_settings: Settings, start_node: Any, native_zips: dict[str, Path]
) -> None:
    """Every setting at its default but the worker's timeout_s: the hang is retried with
    WM_MAX_RETRIES, each attempt ends with worker.error at its limit, then the dead letter."""
    manager = WorkManager(pg_settings)
    done = manager.subscribe("inproc.processed", "sink")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(
        code=native_zips["misbehave"].read_bytes(),
        mime_type=NATIVE,
        topic="inproc",
        settings={"timeout_s": 1},
    )
    node = start_node(pg_settings, concurrency=1)
    node.consuming(f"inproc::{worker.id}")
    manager.publish(make_event("inproc", "/tests", {"before": "hang"}))
    assert drain(pg_settings, done, 1)[0]["data"] == {"BEFORE": "HANG"}
    [first_pool] = pool_pids(node)

    started = time.monotonic()
    manager.publish(make_event("inproc", "/tests", {}, subject="hang"))
    [first] = worker_errors(pg_settings, lifecycle, 1)
    assert time.monotonic() - started < 15
    assert first["data"]["error_type"] == "WorkerTimeout" and first["data"]["attempt"] == 1
    assert "did not return within 1 s" in first["data"]["error_message"]
    eventually(lambda: not alive(first_pool))

    manager.publish(make_event("inproc", "/tests", {"after": "hang"}))  # served between retries
    [after] = drain(pg_settings, done, 1, timeout_s=60)
    assert after["data"] == {"AFTER": "HANG"}

    retries = pg_settings.max_retries
    [letter] = eventually(lambda: DeadLetters(pg_settings).list(), timeout_s=180)
    assert letter.error_type == "WorkerTimeout" and letter.attempts == retries + 1
    reported = worker_errors(pg_settings, lifecycle, retries, timeout_s=10)
    assert [e["data"]["attempt"] for e in [first, *reported]] == list(range(1, retries + 2))
    assert node.proc.poll() is None
    assert first_pool not in pool_pids(node) and len(pool_pids(node)) == 1
    time.sleep(3)  # the messages the replaced processes held come back: each is only acked
    assert len(DeadLetters(pg_settings).list()) == 1
    assert drain(pg_settings, done, 10, timeout_s=1) == []
