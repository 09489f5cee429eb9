"""The Python engine's batch path: one BATCH frame for N events, one answer per event, each
event timed alone; an event that fails, outlives its limit or ends the sandbox fails alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import wm  # noqa: F401 - import the platform before engines
from engines.python import PythonEngine
from engines.python.engine import PythonWorkerError
from engines.python.protocol import answer_event
from tests.workers import child_pids
from wm.config import Settings
from wm.engine import WorkerSpec
from wm.errors import EventDecodeError, WorkerExecutionError, WorkerTimeout
from wm.events import CloudEvent, decode, make_event

#: Echoes ``n``; n == 2 raises, n == 4 ends the sandbox (SystemExit), n == 6 outlives any
#: limit, n == 8 answers with no output.
SELECTIVE = b"""
import time
from wm.devkit import make_event

SANDBOX = time.time_ns()  # which sandbox answered: its module body ran once

def process(event):
    n = event.get_data()["n"]
    if n == 2:
        raise ValueError("two is refused")
    if n == 4:
        raise SystemExit(4)
    if n == 6:
        time.sleep(60)
    if n == 8:
        return None
    return make_event("batch.out", "/workers/batch", {"n": n, "sandbox": SANDBOX})
"""


@pytest.fixture
def engine() -> Iterator[PythonEngine]:
    before = child_pids()
    instance = PythonEngine(Settings())
    instance.load(SELECTIVE, WorkerSpec(worker_id="w-batch", topic="batch"))
    yield instance
    instance.close()
    assert child_pids() <= before, "the engine left a child process behind"


def events(*numbers: int) -> list[CloudEvent]:
    return [make_event("batch.in", "/tests", {"n": n}) for n in numbers]


def answered(result: list[CloudEvent] | Exception) -> dict[str, Any]:
    assert not isinstance(result, Exception), result
    [output] = result
    data = output.get_data()
    assert isinstance(data, dict)
    return data


def test_a_batch_answers_each_event_in_order_like_process(engine: PythonEngine) -> None:
    batch = events(0, 1, 3, 8, 5)

    results = engine.process_batch(batch, timeout_s=5)

    assert [answered(r)["n"] for r in results[:3]] == [0, 1, 3]
    assert results[3] == []
    assert answered(results[4])["n"] == 5
    single = engine.process(batch[0], timeout_s=5)
    assert single[0].get_data() == answered(results[0])  # the same sandbox, the same answer
    assert engine.process_batch([], timeout_s=5) == []


def test_a_failing_event_fails_alone_and_the_sandbox_goes_on(engine: PythonEngine) -> None:
    pid_before = engine.pid
    results = engine.process_batch(events(1, 2, 3), timeout_s=5)

    assert isinstance(results[1], PythonWorkerError)
    assert "ValueError: two is refused" in str(results[1])
    assert results[1].error_type == "ValueError"
    assert answered(results[0])["sandbox"] == answered(results[2])["sandbox"]
    assert engine.pid == pid_before


def test_an_event_that_ends_the_sandbox_fails_alone(engine: PythonEngine) -> None:
    first_pid = engine.pid

    results = engine.process_batch(events(1, 4, 3, 5), timeout_s=5)

    first = answered(results[0])["sandbox"]
    assert isinstance(results[1], PythonWorkerError)
    assert "SystemExit" in str(results[1])
    later = {answered(r)["sandbox"] for r in results[2:]}
    assert [answered(r)["n"] for r in results[2:]] == [3, 5]
    assert len(later) == 1 and first not in later  # one fresh sandbox took the rest
    assert engine.pid != first_pid


def test_an_event_over_its_limit_fails_alone_and_is_timed_alone(engine: PythonEngine) -> None:
    first_pid = engine.pid

    batch = events(1, 6, 3)
    results = engine.process_batch(batch, timeout_s=1.0)

    first = answered(results[0])["sandbox"]
    assert isinstance(results[1], WorkerTimeout)
    assert f"did not finish event {batch[1].get_id()}" in str(results[1])
    assert "within 1 s" in str(results[1])
    assert answered(results[2])["n"] == 3
    assert answered(results[2])["sandbox"] != first
    assert engine.pid != first_pid


def test_a_batch_before_load_fails_every_event() -> None:
    engine = PythonEngine(Settings())
    try:
        results = engine.process_batch(events(1, 2), timeout_s=5)
    finally:
        engine.close()
    assert len(results) == 2
    assert all(isinstance(r, WorkerExecutionError) for r in results)
    assert "before load()" in str(results[0])


@pytest.mark.parametrize(
    "answer",
    [
        {"id": "1", "source": "/s", "type": "t", "specversion": "1.0"},
        {"id": "1", "source": "/s", "type": "t", "specversion": "1.0", "data": {"a": [1]}},
        {"id": "1", "source": "/s", "type": "t", "specversion": "1.0", "data_base64": "AAE="},
        {
            "id": "1",
            "source": "/s",
            "type": "t",
            "specversion": "1.0",
            "time": "2026-01-02T03:04:05.5Z",
        },
        {
            "id": "1",
            "source": "/s",
            "type": "t",
            "specversion": "1.0",
            "time": "2026-01-02T03:04:05+02:00",
        },
        {
            "id": "1",
            "source": "/s",
            "type": "t",
            "specversion": "1.0",
            "time": "2026-01-02T03:04:05",
        },
        {"id": "1", "source": "/s", "type": "t", "specversion": "1.0", "time": "20260102T030405Z"},
        {"id": "1", "source": "/s", "type": "t", "specversion": "1.0", "time": "yesterday"},
        {"id": "1", "source": "/s", "type": "t", "specversion": "1.0", "correlationid": "c"},
        {"source": "/s", "type": "t", "specversion": "1.0"},
        {"id": "1", "source": "/s", "type": "t", "specversion": "0.3"},
        {"id": "1", "source": "/s", "type": "t", "specversion": "1.0", "Bad-Name": "x"},
        ["not", "an", "object"],
    ],
)
def test_an_answers_events_read_as_wm_events_decode_reads_them(answer: Any) -> None:
    """The host's reader of a sandbox's output events reads them from the frame's one JSON
    parse; what it reads, and every error it raises, are :func:`wm.events.decode`'s of the
    answer's text."""
    expected: CloudEvent | str
    try:
        expected = decode(json.dumps(answer))  # the answer's text, as the sandbox wrote it
    except EventDecodeError as exc:
        expected = str(exc)
    try:
        read: CloudEvent | str = answer_event(answer)
    except EventDecodeError as exc:
        read = str(exc)
    if isinstance(expected, str):
        assert read == expected
    else:
        assert isinstance(read, CloudEvent)
        ours, theirs = read.get_attributes(), expected.get_attributes()
        if "time" not in answer:  # the SDK's constructor stamps the time it runs
            assert abs((ours.pop("time") - theirs.pop("time")).total_seconds()) < 60
        assert ours == theirs
        assert read.get_data() == expected.get_data()
