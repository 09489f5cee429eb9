"""``wm bench``'s last phase, the engine round trips: each engine's ``process`` timed in this
process, message after message. The Python engine's is the host's side of a sandboxed worker
(framing, two pipe hops, the worker call: host → sandboxed child → host) for two trivial
workers; with ``--native-zip`` the native engine's in-process round trip (encode, the C call,
decode) is timed too, and likewise with ``--dotnet-package`` and ``--csharp-file`` a .NET
command worker's (``engines/dotnet/examples/CommandWorker.cs``, or a nupkg of it). Each
median is set against issue 26's goal; the Python engine's batch path
(``Engine.process_batch``: one frame for the batch, one answer per event) is timed per event.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from wm.bench.rig import NATIVE, PYTHON, Begin, percentile
from wm.config import Settings
from wm.engine import WorkerSpec, engine_class
from wm.events import make_event

#: Trivial Python workers whose engine round trip is timed.
ENGINE_WORKERS = {
    "returns None": b"def process(event):\n    return None\n",
    "returns one event": (
        b"from wm.devkit import make_event\n\ndef process(event):\n"
        b"    return make_event('bench.out', '/bench', event.get_data())\n"
    ),
}
#: Issue 26's goals for a median round trip, in µs, by MIME type (.NET: both engines).
GOALS_US = {PYTHON: 100.0, NATIVE: 20.0}
DOTNET_GOAL_US = 10.0
#: Events per ``process_batch`` call when a batch path is timed.
BATCH_EVENTS = 100


def run(
    messages: int, native_zip: Path | None, dotnet: Sequence[tuple[str, Path]], begin: Begin
) -> list[dict[str, Any]]:
    """Each engine's round trip in this process: the Python engine's, then the native
    engine's (``native_zip``) and the .NET engines' (``dotnet``: MIME type, code); their
    figures (in µs) for the JSON answer."""
    found = _engine_round_trip(messages, begin)
    in_process = messages * 10
    if native_zip:  # encode, the C call, decode, FreeResult
        payload = {"n": 1, "text": "a small payload"}
        code = native_zip.read_bytes()
        begin(f"{NATIVE} round trip")
        found.append(_in_process_round_trip(NATIVE, code, in_process, payload, 1000))
    for mime_type, path in dotnet:
        # the event as UTF-8 bytes, ProcessAsync (JSON parsed and written in .NET), the
        # answer as a CloudEvent; CoreCLR's tiered JIT runs the first ~35,000 calls (~2 s) on
        # quickly compiled code before it optimizes them: the steady state is timed
        payload = {"command": "upper", "text": "a small payload"}
        begin(f"{mime_type} round trip")
        found.append(
            _in_process_round_trip(mime_type, path.read_bytes(), in_process, payload, 60000)
        )
    return found


def _engine_round_trip(messages: int, begin: Begin) -> list[dict[str, Any]]:
    """Time ``PythonEngine.process`` on the host (framing, two pipe hops, the worker call),
    then ``process_batch`` per event."""
    settings = Settings.from_env()
    engine = engine_class(PYTHON)(settings)
    event = make_event("bench.in", "/bench", {"n": 1, "text": "a small payload"})
    print(
        f"\nPython engine round trip, {messages} messages (goal: median ≤ "
        f"{_goal(PYTHON) / 1e3:g} ms; batch: per event, {BATCH_EVENTS} events a call; "
        f"both sides poll {settings.engine_spin_us} µs before they sleep, WM_ENGINE_SPIN_US)\n"
    )
    found = []
    batch = [event] * BATCH_EVENTS
    try:
        for name, code in ENGINE_WORKERS.items():
            begin(f"{PYTHON} round trip: {name}")
            engine.load(code, WorkerSpec(worker_id="bench", topic="bench"))
            median, p99 = _time_calls(lambda: engine.process(event, timeout_s=5), messages, 200)
            calls = max(1, messages // BATCH_EVENTS)
            per_batch, _ = _time_calls(lambda: engine.process_batch(batch, 5), calls, 2)
            row = _round_trip(PYTHON, name, messages, median, p99)
            row["batch_median_us"] = round(per_batch / BATCH_EVENTS, 2)
            row["spin_us"] = settings.engine_spin_us
            print(
                f"{name:<18} median {median / 1e3:.3f} ms  p99 {p99 / 1e3:.3f} ms  "
                f"{_verdict(row)}  batch {row['batch_median_us'] / 1e3:.3f} ms per event"
            )
            found.append(row)
    finally:
        engine.close()
    return found


def _in_process_round_trip(
    mime_type: str, code: bytes, messages: int, data: dict[str, Any], warm_up: int
) -> dict[str, Any]:
    """Time an in-process engine's ``process`` on one event carrying ``data``."""
    engine = engine_class(mime_type)(Settings.from_env())
    event = make_event("bench.in", "/bench", data, extensions={"correlationid": "c"})
    goal = _goal(mime_type)
    print(f"\n{mime_type} engine round trip, {messages} messages (goal: median ≤ {goal:g} µs)\n")
    try:
        engine.load(code, WorkerSpec(worker_id="bench", topic="bench"))
        median, p99 = _time_calls(lambda: engine.process(event, timeout_s=5), messages, warm_up)
    finally:
        engine.close()
    row = _round_trip(mime_type, "in-process", messages, median, p99)
    print(f"{'in-process':<18} median {median:.1f} µs  p99 {p99:.1f} µs  {_verdict(row)}")
    return row


def _goal(mime_type: str) -> float:
    return GOALS_US.get(mime_type, DOTNET_GOAL_US)


def _verdict(row: dict[str, Any]) -> str:
    return f"goal ≤ {row['goal_us']:g} µs {'met' if row['met'] else 'NOT met'}"


def _round_trip(
    mime_type: str, worker: str, messages: int, median_us: float, p99_us: float
) -> dict[str, Any]:
    return {
        "engine": mime_type,
        "worker": worker,
        "messages": messages,
        "median_us": round(median_us, 2),
        "p99_us": round(p99_us, 2),
        "goal_us": _goal(mime_type),
        "met": median_us <= _goal(mime_type),
    }


def _time_calls(call: Callable[[], object], count: int, warm_up: int) -> tuple[float, float]:
    """Median and p99 of ``count`` timed calls after ``warm_up`` untimed ones, in µs."""
    for _ in range(warm_up):
        call()
    samples = []
    for _ in range(count):
        started = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - started) / 1e3)
    return (statistics.median(samples) if samples else 0.0), percentile(samples, 99)
