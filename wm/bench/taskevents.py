"""``wm bench``'s first phase, the task-event phase: WorkManager delivery against a bare
Celery task, on the same node, broker and concurrency. Prints events/s, p50/p99 publish→done
latency and the ratio to bare Celery for stub workers (no group, group) and workers on real
engines (a sandboxed Python worker, and the native and .NET workers ``wm bench`` is given,
whose every event is ``{"command": "echo", ...}``), then the Redis round trips of one group
lock acquire+release.

Both delivery sides are timed the same way, from Celery's own task events: ``task-sent``
(stamped by the publisher) to ``task-succeeded`` (stamped by the node), so task events are on
for this phase. It runs on the embedded Redis (or on ``WM_BROKER_URL`` and ``WM_REDIS_URL``
when set), with names, a node and exchanges of its own (``wm.bench.rig``) deleted when it
ends.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery

from wm.bench import drain
from wm.bench.rig import Begin, EngineWorker, Rig, percentile
from wm.config import Settings
from wm.state.connection import redis_for
from wm.state.locks import GroupLocks
from wm.views import WorkerInfo

#: Targets from the issues, as ratios of bare Celery throughput.
TARGETS = {
    "no group": 0.7,
    "group": 0.5,
    "python worker": 0.5,
    "native worker": 0.7,
}


@dataclass
class Result:
    name: str
    count: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0

    @property
    def p50(self) -> float:
        return percentile(self.latencies_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.latencies_ms, 99)


class TaskClock:
    """Collects task-sent and task-succeeded events of one task name, by task id."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.sent: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.failed = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._capture, daemon=True)
        self._receiver: Any = None

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the event receiver did not start")

    def _capture(self) -> None:
        with self.app.connection() as conn:
            self._receiver = self.app.events.Receiver(
                conn,
                handlers={
                    "task-sent": lambda e: self.sent.__setitem__(e["uuid"], e["timestamp"]),
                    "task-succeeded": lambda e: self.done.__setitem__(e["uuid"], e["timestamp"]),
                    "task-failed": lambda e: setattr(self, "failed", self.failed + 1),
                },
            )
            self._ready.set()
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(timeout=10)

    def measure(self, name: str, count: int, send: Callable[[], None], timeout_s: float) -> Result:
        self.sent.clear()
        self.done.clear()
        send()
        deadline = time.monotonic() + timeout_s
        while len(self.done) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        if len(self.done) < count:
            raise RuntimeError(f"{name}: only {len(self.done)} of {count} finished in time")
        time.sleep(0.5)  # late task-sent events
        first = min(self.sent.values())
        last = max(self.done.values())
        latencies = [(self.done[t] - s) * 1000 for t, s in self.sent.items() if t in self.done]
        return Result(name, count, last - first, latencies)


def run(
    settings: Settings,
    home: Path,
    events: int,
    concurrency: int,
    timeout_s: float,
    engines: Sequence[EngineWorker],
    begin: Begin,
) -> dict[str, Any]:
    """Time ``events`` events per scenario (the stub workers', then one per engine worker of
    ``engines``) and print them; the figures for the JSON answer. Task events must be on
    in ``settings``."""
    results, node = _measure(settings, home, events, concurrency, timeout_s, engines, begin)
    lock_round_trips = _lock_round_trips(settings)
    print(f"lock acquire+release: {lock_round_trips} Redis round trips")
    return {
        "events": events,
        "concurrency": concurrency,
        "node": node,
        "scenarios": _report(results, events, concurrency),
        "lock_round_trips": lock_round_trips,
    }


def _measure(
    settings: Settings,
    home: Path,
    events: int,
    concurrency: int,
    timeout_s: float,
    engines: Sequence[EngineWorker],
    begin: Begin,
) -> tuple[list[Result], str]:
    """Each scenario timed from task events; and how the node runs them."""
    with Rig(settings) as rig:
        begin("task events: bare celery")
        workers = _workers(rig, engines)
        bare = rig.queue("bare")
        clock = TaskClock(rig.app)
        clock.start()
        results = []
        try:
            with rig.node(home, concurrency, [bare]):
                node = rig.describe_node()
                print(node)
                _warm_up(rig, bare, workers)
                send_bare = functools.partial(drain.send_bare, rig, bare, events)
                results.append(clock.measure("bare celery", events, send_bare, timeout_s))
                for name, worker in workers.items():
                    begin(f"task events: {name}")
                    send = functools.partial(drain.publish, rig.manager, worker.topic, events)
                    results.append(clock.measure(name, events, send, timeout_s))
        finally:
            clock.stop()
    return results, node


def _workers(rig: Rig, engines: Sequence[EngineWorker]) -> dict[str, WorkerInfo]:
    workers = {
        "no group": rig.worker("nogroup", b"{}"),
        "group": rig.worker("group", b"{}", group="bench"),
    }
    for engine in engines:
        workers[engine.name] = rig.worker(engine.suffix, engine.code, mime_type=engine.mime_type)
    return workers


def _warm_up(rig: Rig, bare: str, workers: dict[str, WorkerInfo]) -> None:
    """Let the node consume every queue and load every engine before timing anything."""
    for worker in workers.values():
        drain.publish(rig.manager, worker.topic, 5)
    drain.send_bare(rig, bare, 5)
    time.sleep(drain.WARM_UP_S)


def _lock_round_trips(settings: Settings) -> int:
    """EVALSHA calls the server saw for one acquire+release (one round trip each)."""
    client = redis_for(settings)
    locks = GroupLocks(settings, prefix="wm:bench:lock:")
    locks.release(locks.acquire("warm", "bench"))
    before = int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    locks.release(locks.acquire("probe", "bench"))
    after = int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    return after - before


def _report(results: list[Result], events: int, concurrency: int) -> list[dict[str, Any]]:
    """The task-event phase's table; its rows for the JSON answer."""
    bare = results[0].rate
    print(
        f"\n{events} events per scenario, concurrency {concurrency}, on Redis, timed "
        "from task events (on for this phase)\n"
    )
    print(f"{'scenario':<15}{'events/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'ratio':>8}  target")
    rows = []
    for result in results:
        ratio = result.rate / bare if bare else 0.0
        target = TARGETS.get(result.name)
        met = None if target is None else ratio >= target
        verdict = "" if target is None else f"≥ {target}× " + ("met" if met else "MISSED")
        print(
            f"{result.name:<15}{result.rate:>10.0f}{result.p50:>9.1f}"
            f"{result.p99:>9.1f}{ratio:>7.2f}×  {verdict}"
        )
        rows.append(
            {
                "scenario": result.name,
                "events_per_s": round(result.rate, 1),
                "p50_ms": round(result.p50, 2),
                "p99_ms": round(result.p99, 2),
                "ratio": round(ratio, 3),
                "target": target,
                "met": met,
            }
        )
    return rows
