"""Per-message round trip of the Python engine (a benchmark, not a test).

    python bench/python_engine.py [MESSAGES]

Loads two trivial workers — one returning nothing, one echoing the input as a new event —
in a real sandboxed child and times ``engine.process`` on the host for each message: frame
encode, two pipe hops, the worker call, output decode. Prints median, p90, p99 and max.
"""

from __future__ import annotations

import statistics
import sys
import time

import wm  # noqa: F401 - import the platform before engines (engines.base needs wm first)
from engines.base import WorkerSpec
from engines.python import PythonEngine
from wm.config import Settings
from wm.events import make_event

DEFAULT_MESSAGES = 5000
WARMUP_MESSAGES = 200

WORKERS = {
    "noop (returns None)": b"def process(event):\n    return None\n",
    "echo (returns one event)": (
        b"from wm.devkit import make_event\n"
        b"def process(event):\n"
        b"    return make_event('bench.out', '/bench', event.get_data())\n"
    ),
}


def measure(engine: PythonEngine, messages: int) -> list[float]:
    """Milliseconds per ``process`` call, one sample per message."""
    event = make_event("bench.in", "/bench", {"n": 1, "text": "a small payload"})
    for _ in range(WARMUP_MESSAGES):
        engine.process(event, timeout_s=5)
    samples = []
    for _ in range(messages):
        started = time.perf_counter_ns()
        engine.process(event, timeout_s=5)
        samples.append((time.perf_counter_ns() - started) / 1e6)
    return samples


def report(name: str, samples: list[float]) -> None:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    print(
        f"{name:26} n={len(samples)}  median {statistics.median(samples):.3f} ms  "
        f"p90 {pick(0.90):.3f} ms  p99 {pick(0.99):.3f} ms  max {ordered[-1]:.3f} ms  "
        f"({len(samples) / (sum(samples) / 1000):,.0f} msg/s)"
    )


def main() -> None:
    messages = int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MESSAGES
    engine = PythonEngine(Settings())
    print(f"isolation layers: {', '.join(engine.isolation_layers) or 'none'}")
    try:
        for name, code in WORKERS.items():
            engine.load(code, WorkerSpec(worker_id="bench", topic="bench"))
            report(name, measure(engine, messages))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
