"""``wm bench --pools EVENTS``: the pool phase, more consumers per machine (issue 12).

A node's consumers are its pool's processes (prefork, Celery's default and WorkManager's) or
threads (``-P threads``), and a machine may run several nodes. For an engine that waits on
I/O (a gateway call, a database), more consumers mean more deliveries at once; for one that
computes, the cores bound it whatever the count. The phase drains ``EVENTS`` queued events
of one worker per workload (a stub waiting 20 ms per event, a stub not waiting, a sandboxed
Python worker waiting 20 ms) under each variant: the default (one node, prefork, 2
processes), prefork with 8 processes, threads with 8 and with 16, and four nodes of 2
processes (eight consumers, as prefork 8; 16 threads is what prefork's memory would not
afford). It reports deliveries/s from the first delivery served to the last (the nodes'
start of consuming, a broadcast away, is left out), the ratio to the default, and the
resident memory of the variant's nodes (main and pool processes), interleaved over
``--pool-repeats`` rounds.

A delivery counts once its outcome is recorded (the pending ledger holds it until then, as
in the scale phase), so the end is read the same way on both brokers and with several
nodes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from wm.bench import drain
from wm.bench.nodes import Nodes
from wm.bench.rig import STUB, Rig
from wm.config import Settings
from wm.state.ledger import Ledger
from wm.views import WorkerInfo

#: Seconds between two looks at the pending ledger.
POLL_S = 0.01
#: Seconds a drain may take before the bench gives up on it.
DRAIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Variant:
    """How a machine's consumers run: ``nodes`` nodes of Celery's ``pool`` × ``concurrency``."""

    name: str
    pool: str
    concurrency: int
    nodes: int = 1


VARIANTS = (
    Variant("prefork 2 (default)", "prefork", 2),
    Variant("prefork 8", "prefork", 8),
    Variant("threads 8", "threads", 8),
    Variant("threads 16", "threads", 16),
    Variant("4 nodes x prefork 2", "prefork", 2, nodes=4),
)
#: A sandboxed Python worker that waits 20 ms per event (as for a backend's answer).
PYTHON_WAIT = b"""import time


def process(event):
    time.sleep(0.02)
"""
#: Each workload's worker: MIME type and code.
WORKLOADS = {
    "stub, 20 ms wait": (STUB, b'{"sleep_ms": 20}'),
    "stub, no wait": (STUB, b"{}"),
    "Python, 20 ms wait": ("text/x-python", PYTHON_WAIT),
}


@dataclass
class Result:
    """One variant's drain rates per workload, and its nodes' memory, per round."""

    variant: Variant
    rates: dict[str, list[float]] = field(default_factory=dict)
    rss: list[int] = field(default_factory=list)
    described: str = ""

    def rate(self, workload: str) -> float:
        return statistics.median(self.rates[workload])


def run(settings: Settings, home: Path, events: int, repeats: int) -> list[Result]:
    """Drain ``events`` events per workload under every variant, ``repeats`` rounds; print."""
    with Rig(settings) as rig:
        results = measure(rig, home, events, repeats)
    report(results, events, repeats, rig)
    return results


def measure(rig: Rig, home: Path, events: int, repeats: int) -> list[Result]:
    workers = {
        workload: rig.worker(f"pools.{n}", code, mime_type=mime_type)
        for n, (workload, (mime_type, code)) in enumerate(WORKLOADS.items())
    }
    idle = rig.queue("pools.idle")
    results = [Result(variant) for variant in VARIANTS]
    for round_ in range(repeats):
        for result in results:
            variant = result.variant
            for worker in workers.values():  # queued while the nodes start
                rig.manager.stop_worker(worker.id)
            place = home / f"pools-{round_}-{VARIANTS.index(variant)}"
            place.mkdir(parents=True, exist_ok=True)
            with Nodes(rig, place, variant.nodes, variant.concurrency, idle, variant.pool) as nodes:
                nodes.wait_up()
                result.described = result.described or nodes.describe()
                for workload, worker in workers.items():
                    rate = time_drain(rig, worker, events)
                    result.rates.setdefault(workload, []).append(rate)
                result.rss.append(sum(nodes.rss()))
    return results


def time_drain(rig: Rig, worker: WorkerInfo, events: int) -> float:
    """Queue ``events`` to a stopped worker, start it, and time from its first served
    delivery to its last (the nodes' start of consuming, a broadcast away, left out); leaves
    it stopped. Events/s."""
    ledger, worker_id = Ledger(rig.settings), str(worker.id)
    drain.publish(rig.manager, worker.topic, events)
    rig.manager.start_worker(worker.id)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    first = None
    while left := ledger.pending(worker_id):
        if first is None and left < events:
            first, served = time.monotonic(), events - left
        if time.monotonic() > deadline:
            raise SystemExit(f"wm bench: pools: not drained after {DRAIN_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)
    last = time.monotonic()
    rig.manager.stop_worker(worker.id)
    if first is None:  # all served between two looks
        raise SystemExit(f"wm bench: pools: {events} events are too few to time; send more")
    return (events - served) / (last - first)


def report(results: list[Result], events: int, repeats: int, rig: Rig) -> None:
    broker = "Redis" if rig.redis_broker else "RabbitMQ"
    print(
        f"\nPools on {broker}: {events} queued events per workload, {repeats} "
        "round(s) interleaved; events/s from the first delivery served to the last (median, "
        "rounds) and the ratio to the default"
    )
    for result in results:
        print(f"  {result.variant.name}: {result.described}")
    default = results[0]
    heading = "".join(f"{workload:<30}" for workload in WORKLOADS)
    print(f"\n{'variant':<22}{heading}memory")
    for result in results:
        cells = ""
        for workload in WORKLOADS:
            runs = " ".join(f"{rate:.0f}" for rate in result.rates[workload])
            ratio = result.rate(workload) / default.rate(workload)
            cells += f"{f'{result.rate(workload):.0f} ({runs}) {ratio:.2f}×':<30}"
        memory = statistics.median(result.rss) / 2**20
        print(f"{result.variant.name:<22}{cells}{memory:.0f} MiB")
