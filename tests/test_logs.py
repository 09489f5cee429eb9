"""Logs name what they are about: lines logged during a delivery carry its worker, event id
and correlation id (JSON fields with WM_LOG_FORMAT=json, a ``[worker=… event=…]`` tail in
text), on real nodes and for the ``wm`` command."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, env_of
from tests.helpers import STUB, drain, eventually, stub
from wm import Settings, WorkManager, make_event
from wm.dataplane import logcontext
from wm.ops import logs

CORRELATION = "corr-logs"
#: The trace of the test's event (its ``traceparent``; tracing itself is off on the node).
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _deliver_once_after_a_failure(
    settings: Settings, start_node: Any, tmp_path: Path, log_format: str
) -> tuple[str, str, str]:
    """A worker ``shout`` that fails its event's first run, on a node logging ``log_format``:
    returns (worker id, event id, what the node logged)."""
    manager = WorkManager(settings)
    sink = manager.subscribe("logs.done", "sink")
    runs = str(tmp_path / "runs.jsonl")
    code = stub(fail="boom", fail_runs=1, trace=runs, output_type="logs.done")
    worker = manager.create_worker(
        code=code,
        mime_type=STUB,
        topic="logs.in",
        name="shout",
        settings={"retry_base_delay_ms": 20},
    )
    node = start_node(settings, concurrency=1, WM_LOG_FORMAT=log_format)
    node.consuming(f"logs.in::{worker.id}")
    event = make_event(
        "logs.in",
        "/tests",
        {"n": 1},
        extensions={"correlationid": CORRELATION, "traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"},
    )
    manager.publish(event)
    assert len(drain(settings, sink, 1)) == 1
    eventually(lambda: any(_succeeded(line) for line in node.log.read_text().splitlines()))
    return str(worker.id), event.get_id(), node.log.read_text()


def _succeeded(line: str) -> bool:
    """Celery's line about the delivery task's success (logged after the output's publish)."""
    return "shout[" in line and "succeeded in" in line


def _json_lines(output: str) -> list[dict[str, Any]]:
    """Every line from the node's ``ready.`` on (before it, Celery prints its banner and
    start-up warnings, which precede its logging), each parsed as one JSON object."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "ready." in line)
    records = [json.loads(line) for line in lines[start:] if line.strip()]
    assert all(isinstance(r, dict) for r in records)
    return records


@pytest.mark.slow
def test_node_logs_json_lines_with_the_delivery_fields(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    worker_id, event_id, output = _deliver_once_after_a_failure(
        settings, start_node, tmp_path, "json"
    )
    records = _json_lines(output)
    for record in records:
        assert {"time", "level", "logger", "process", "message"} <= set(record)
    about = [r for r in records if r.get("event_id") == event_id]
    expected = {
        "worker": "shout",
        "worker_id": worker_id,
        "correlation_id": CORRELATION,
        "trace_id": TRACE,
        "topic": "logs.in",
    }
    for record in about:
        assert {key: record[key] for key in expected} == expected, record
    [retrying] = [r for r in about if r["logger"] == "wm.dataplane.features.retries"]
    assert retrying["level"] == "WARNING" and retrying["attempt"] == 1
    assert retrying["message"].endswith("(attempt 1 of 6): boom")
    assert retrying["task_name"] == "wm.deliver" and retrying["task_id"]
    # Celery's lines, logged during the delivery, carry the fields too.
    celery = [r for r in about if r["logger"] == "celery.app.trace"]
    assert [r["attempt"] for r in celery] == [1, 2]
    assert " retry: " in celery[0]["message"] and "succeeded in" in celery[1]["message"]
    # Lines about no delivery have no delivery fields.
    ready = next(r for r in records if r["message"].endswith("ready."))
    assert not set(logcontext.FIELDS) & set(ready)


@pytest.mark.slow
def test_node_text_lines_are_celerys_with_the_delivery_fields(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    _, event_id, output = _deliver_once_after_a_failure(settings, start_node, tmp_path, "text")
    fields = f"[worker=shout event={event_id} correlation={CORRELATION} trace={TRACE} attempt=1]"
    [retrying] = [line for line in output.splitlines() if "retrying event" in line]
    assert retrying.startswith("[") and "WARNING/ForkPoolWorker-" in retrying
    assert retrying.endswith(f"boom {fields}")
    [retried] = [line for line in output.splitlines() if " retry: Retry in " in line]
    assert retried.endswith(fields)
    ready = next(line for line in output.splitlines() if "ready." in line)
    assert ready.endswith("ready.")


def _wm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wm.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_wm_logs_json_to_stderr(pg_settings: Settings) -> None:
    env = env_of(pg_settings, WM_LOG_FORMAT="json", WM_LOG_LEVEL="INFO")
    args = ("worker", "create", "--topic", "t", "--name", "n", "--mime-type", STUB, "--base64")
    result = _wm(env, *args, "e30=")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines()]
    created = [r for r in records if r["message"].startswith("created worker ")]
    assert len(created) == 1
    assert created[0]["level"] == "INFO" and created[0]["logger"] == "wm.control.lifecycle"
    assert created[0]["time"].endswith("+00:00")
    # every transition is a line of its own, once its transaction committed (seed 004)
    moved = [r for r in records if r["logger"] == "wm.store.records"]
    assert [r["message"].split(": ", 1)[1].split(" by ")[0] for r in moved] == [
        "new → created",
        "created → starting",
        "starting → running",
    ], moved


def test_a_bad_log_format_is_one_error_line() -> None:
    result = _wm(env_of(Settings.from_env({}), WM_LOG_FORMAT="xml"), "worker", "list")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "wm: error: WM_LOG_FORMAT='xml' is malformed: expected text or json"
    ]


def test_settings_read_the_log_format() -> None:
    assert Settings.from_env({}).log_format == "text"
    assert Settings.from_env({"WM_LOG_FORMAT": " JSON "}).log_format == "json"


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_fields_reach_every_record_only_inside_a_delivery() -> None:
    """In-process: the filter copies the bound fields onto any logger's record, an explicit
    ``extra`` wins, and nothing is left bound after the scope."""
    handler = Collect()
    handler.addFilter(logs.DeliveryFields())
    library = logging.getLogger("some.library")
    library.addHandler(handler)
    # Whatever level an earlier test left on the root logger, these records are emitted.
    library.setLevel(logging.DEBUG)
    try:
        logcontext.bind(worker="nowhere")  # no scope: ignored
        with logcontext.scope(worker_id="w-1"):
            logcontext.bind(event_id="e-1", correlation_id=None, attempt=2)
            library.warning("inside")
            library.warning("explicit", extra={"event_id": "mine"})
        library.warning("outside")
    finally:
        library.removeHandler(handler)
        library.setLevel(logging.NOTSET)
    inside, explicit, outside = (vars(record) for record in handler.records)
    assert {name: inside.get(name) for name in logcontext.FIELDS} == {
        "worker": None,
        "worker_id": "w-1",
        "event_id": "e-1",
        "correlation_id": None,
        "trace_id": None,
        "topic": None,
        "attempt": 2,
        "tenant": None,
    }
    assert explicit["event_id"] == "mine"
    assert not set(logcontext.FIELDS) & set(outside)


def test_text_fields_follow_the_first_line() -> None:
    formatter = logs.TextFields(logging.Formatter("%(levelname)s %(message)s"))
    try:
        raise ValueError("bad")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    record.worker, record.event_id = "shout", "e-1"
    head, *rest = formatter.format(record).splitlines()
    assert head == "ERROR failed [worker=shout event=e-1]"
    assert rest[0].startswith("Traceback") and rest[-1] == "ValueError: bad"


def test_the_task_scope_outlives_the_delivery_block() -> None:
    """On a node the scope is the task's (Celery's line about the task's end comes after
    the delivery's own block): a delivery joins it, and its end drops the fields."""
    logcontext.begin_task("t-1")
    with logcontext.scope(worker_id="w-1"):
        logcontext.bind(attempt=1)
    assert logcontext.current() == {"worker_id": "w-1", "attempt": 1}
    logcontext.end_task("t-1")
    assert logcontext.current() == {}
