"""A deterministic engine for tests and demos (MIME ``application/x-wm-stub``).

The code is a JSON object::

    {"output_type": "orders.done",  # emit one event of this type (omit for no output)
     "sleep_ms": 0,                  # busy time per event
     "fail": "boom",                 # raise a WorkerExecutionError with this message
     "fail_if_data_has": "poison",   # ...only for events whose data contains this key
     "fail_runs": 2,                 # ...only an event's first 2 runs (counted in "trace")
     "outputs": 1,                   # how many output events per input
     "trace": "/tmp/runs.jsonl",     # append one line per execution begun to this file
     "sick_while": "/tmp/sick",      # while this file exists, deliveries fail and the
                                     # health probe fails (the code has a probe only then)
     "label": "worker 17"}           # ignored: tells workers' code apart (a benchmark's
                                     # thousand workers, each with code of its own)

Each output's data records the input data, the worker version and the process id and
start/end times (outside the default tenant also the worker's tenant and the event's), so
tests can check who ran what, when and on which code. The trace also counts executions whose
outputs were never published (a process killed, a write refused).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from wm.engine import Engine, WorkerSpec
from wm.errors import InvalidCode, WorkerExecutionError
from wm.events import TENANT_EXTENSION, CloudEvent, make_event
from wm.names import DEFAULT_TENANT

_KEYS = {
    "output_type": str,
    "sleep_ms": int,
    "fail": str,
    "fail_if_data_has": str,
    "fail_runs": int,
    "outputs": int,
    "trace": str,
    "sick_while": str,
    "label": str,
}


def parse_stub_code(code: bytes) -> dict[str, Any]:
    """Parse and check stub code; raise :class:`InvalidCode` naming the defect."""
    try:
        spec = json.loads(code.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidCode(f"stub code must be a JSON object: {exc}") from exc
    if not isinstance(spec, dict):
        raise InvalidCode("stub code must be a JSON object")
    for key, value in spec.items():
        expected = _KEYS.get(key)
        if expected is None:
            raise InvalidCode(f"stub code has unknown key {key!r}; known: {', '.join(_KEYS)}")
        if not isinstance(value, expected) or isinstance(value, bool):
            raise InvalidCode(f"stub code key {key!r} must be {expected.__name__}")
    return spec


class StubEngine(Engine):
    """Runs stub code in-process."""

    mime_type = "application/x-wm-stub"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._spec: dict[str, Any] = {}
        self._worker: WorkerSpec | None = None

    def load(self, code: bytes, worker: WorkerSpec) -> None:
        self._spec = parse_stub_code(code)
        if "fail_runs" in self._spec and "trace" not in self._spec:
            raise InvalidCode("stub code key 'fail_runs' counts runs in 'trace': give both")
        self._worker = worker

    def process(self, event: CloudEvent, timeout_s: float) -> list[CloudEvent]:
        assert self._worker is not None, "load() first"
        return self._run(event)

    def probe(self, timeout_s: float) -> bool | None:
        """With ``sick_while``: fails while its file exists, else passes. Without: no probe."""
        sick = self._spec.get("sick_while")
        if sick is None:
            return None
        if os.path.exists(sick):
            raise WorkerExecutionError(f"{sick} exists: the stub is sick")
        return True

    def process_batch(
        self, events: Sequence[CloudEvent], timeout_s: float
    ) -> list[list[CloudEvent] | Exception]:
        """The stub's batch entry point: one call, each event run in turn (its trace line
        written as it begins), each failure its own event's alone."""
        assert self._worker is not None, "load() first"
        results: list[list[CloudEvent] | Exception] = []
        for event in events:
            try:
                results.append(self._run(event))
            except Exception as exc:  # that event's alone
                results.append(exc)
        return results

    def _run(self, event: CloudEvent) -> list[CloudEvent]:
        assert self._worker is not None
        started = time.time()
        if "trace" in self._spec:
            _trace(self._spec["trace"], event.get_id(), started)
        sleep_s = self._spec.get("sleep_ms", 0) / 1000
        if sleep_s:
            time.sleep(sleep_s)
        sick = self._spec.get("sick_while")
        if sick is not None and os.path.exists(sick):
            raise WorkerExecutionError(f"{sick} exists: the stub is sick")
        data = event.get_data()
        poison = self._spec.get("fail_if_data_has")
        if "fail" in self._spec and (poison is None or (isinstance(data, dict) and poison in data)):
            runs = self._spec.get("fail_runs")
            if runs is None or _runs_of(self._spec["trace"], event.get_id()) <= runs:
                raise WorkerExecutionError(self._spec["fail"])
        output_type = self._spec.get("output_type")
        if not output_type:
            return []
        body = {
            "input": data if not isinstance(data, bytes) else data.decode("latin-1"),
            "version": self._worker.version,
            "pid": os.getpid(),
            "started_at": started,
            "finished_at": time.time(),
        }
        if self._worker.tenant != DEFAULT_TENANT:  # the default tenant's output is as before
            body["tenant"] = self._worker.tenant
            body["event_tenant"] = event.get_extension(TENANT_EXTENSION)
        return [
            make_event(output_type, f"/workers/{self._worker.worker_id}", dict(body, index=i))
            for i in range(self._spec.get("outputs", 1))
        ]


def _trace(path: str, event_id: str, started: float) -> None:
    """One line per execution begun; a single append of one short line is not interleaved."""
    line = json.dumps({"event_id": event_id, "pid": os.getpid(), "started_at": started})
    with open(path, "a", encoding="utf-8") as trace:
        trace.write(line + "\n")


def _runs_of(path: str, event_id: str) -> int:
    """Executions of ``event_id`` begun, this one included (the trace is written first)."""
    with open(path, encoding="utf-8") as trace:
        return sum(json.loads(line)["event_id"] == event_id for line in trace if line.strip())
