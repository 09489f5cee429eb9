"""``wm bench --drain-repeats R``: the drain phase. Each scenario's queue is filled while
nothing consumes it, then consuming starts and the clock runs until every message is done:
throughput without the publisher competing, and Redis commands per event, for a bare Celery
task and WorkManager on the same node, with the same pool, prefetch, acks and task-events
setting (the node is asked, and the report says so). The scenarios: stub workers (no group,
group, one output) and workers on real engines (a sandboxed Python worker, and the native
and .NET workers ``wm bench`` is given), each answering every event with one output. They
run interleaved (bare, no group, group, one output, Python worker, …, bare, …) so a slow
stretch of the machine hits them all; the spread of the repetitions is printed.

Done means no message of the queue is ready and none is unacknowledged (acks are late, so a
message is acknowledged once its task finished). How that is known depends on the broker:

- Redis: kombu's keys say it all. The queue is one list per priority step (the app's
  ``priority_steps`` transport option, kombu's four by default) and every unacknowledged
  message is in the ``unacked`` hash: one LLEN per list and an HLEN, in one pipeline.
- RabbitMQ: a passive ``queue.declare`` counts the ready messages, but AMQP has no count of
  unacknowledged ones, and the management API's are samples taken every few seconds (where
  it is enabled at all). So the node counts: it answers how many tasks it finished with
  success, one per task id (``wm.bench.benchnode``), recorded in the same step that sends
  the message's ack. Once the queue has no ready message, the node is asked until the count
  has grown by the number of events queued. A retry (a group member waiting for its lock)
  keeps its task id and succeeds once, so the count is exact with retries too.

Redis commands are counted on the servers of broker and state store (``INFO
commandstats`` around the drain, minus the bench's own polling); on RabbitMQ, on the state
store's alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kombu.transport.redis import PRIORITY_STEPS, Channel

from wm.bench.rig import STUB, EngineWorker, Rig
from wm.config import Settings
from wm.dataplane.queues import subscription_queue, worker_queue_name
from wm.events import make_event
from wm.manager import WorkManager
from wm.state.connection import pooled_client

#: Seconds between two checks for the end of a drain.
POLL_S = 0.02
#: Seconds a drain may take before the bench gives up on it.
DRAIN_TIMEOUT_S = 600.0
#: Seconds for a prefetched message of the last run to be acknowledged after a pause.
SETTLE_S = 0.5
#: Seconds the node has to consume every queue and load every engine before timing.
WARM_UP_S = 5.0
#: Targets from issue 12, as ratios of bare Celery's drain rate.
TARGETS = {"no group": 1.0, "group": 0.7, "one output": 0.8}


@dataclass
class Drain:
    """One scenario's repetitions: events/s and Redis commands per event."""

    name: str
    rates: list[float] = field(default_factory=list)
    commands: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)


class Scenario:
    """A queue to fill while paused and to drain once resumed."""

    def __init__(
        self,
        name: str,
        queue: str,
        fill: Callable[[int], None],
        pause: Callable[[], object],
        resume: Callable[[], object],
    ) -> None:
        self.name, self.queue, self.fill = name, queue, fill
        self.pause, self.resume = pause, resume


class RedisProbe:
    """The end of a drain on a Redis broker: the queue's lists and kombu's unacked hash are
    empty."""

    def __init__(self, rig: Rig) -> None:
        options = rig.app.conf.broker_transport_options
        self.steps = list(options.get("priority_steps", PRIORITY_STEPS))
        self.unacked = str(options.get("unacked_key", "unacked"))
        self.client = pooled_client(rig.settings.broker_url)
        #: Redis commands one :meth:`done` costs.
        self.poll_commands = len(self.steps) + 1

    def mark(self) -> None:
        """Nothing to remember: the broker's keys tell the end."""

    def keys(self, queue: str) -> list[str]:
        """The queue's lists, one per priority step: name, name<sep>3, …"""
        return [queue if not step else f"{queue}{Channel.sep}{step}" for step in self.steps]

    def done(self, queue: str, events: int) -> bool:
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys(queue):
            pipe.llen(key)
        pipe.hlen(self.unacked)
        return not any(pipe.execute())


class AmqpProbe:
    """The end of a drain on RabbitMQ: no message ready, and the node has finished as many
    tasks with success since :meth:`mark` as events were queued."""

    poll_commands = 0

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.base = 0

    def mark(self) -> None:
        self.base = self.rig.succeeded()

    def ready(self, queue: str) -> int:
        with self.rig.app.connection_or_acquire() as connection:
            bound = subscription_queue(queue).bind(connection.default_channel)
            return int(bound.queue_declare(passive=True).message_count)

    def done(self, queue: str, events: int) -> bool:
        return not self.ready(queue) and self.rig.succeeded() - self.base >= events


Probe = RedisProbe | AmqpProbe


def probe_for(rig: Rig) -> Probe:
    return RedisProbe(rig) if rig.redis_broker else AmqpProbe(rig)


def run(
    settings: Settings,
    home: Path,
    events: int,
    repeats: int,
    concurrency: int,
    engines: Sequence[EngineWorker] = (),
) -> None:
    """Time the drain of ``events`` messages per scenario, ``repeats`` times, and print it."""
    with Rig(settings) as rig:
        header, results = measure(rig, home, events, repeats, concurrency, engines)
    report(results, header, events, repeats, concurrency, rig)


def measure(
    rig: Rig,
    home: Path,
    events: int,
    repeats: int,
    concurrency: int,
    engines: Sequence[EngineWorker] = (),
) -> tuple[str, list[Drain]]:
    """The node's description and each scenario's repetitions: the stub workers', then one
    per engine worker of ``engines``."""
    scenarios = _scenarios(rig) + [
        worker_scenario(rig, e.name, f"drain.{e.suffix}", e.code, mime_type=e.mime_type)
        for e in engines
    ]
    probe = probe_for(rig)
    results = {scenario.name: Drain(scenario.name) for scenario in scenarios}
    with rig.node(home, concurrency, [scenarios[0].queue]):
        header = rig.describe_node()
        for scenario in scenarios:  # warm: consumers up, engines loaded
            scenario.fill(5)
        time.sleep(WARM_UP_S)
        for _ in range(repeats):
            for scenario in scenarios:
                rate, commands = time_drain(rig, probe, scenario, events)
                results[scenario.name].rates.append(rate)
                results[scenario.name].commands.append(commands)
    return header, list(results.values())


def _scenarios(rig: Rig) -> list[Scenario]:
    bare = rig.queue("drain.bare")
    out = rig.name("drain.out")
    rig.subscribe("drain.out", "sink")
    return [
        Scenario(
            "bare celery",
            bare,
            lambda count: send_bare(rig, bare, count),
            lambda: rig.pause(bare),
            lambda: rig.resume(bare),
        ),
        worker_scenario(rig, "no group", "drain.nogroup", b"{}"),
        worker_scenario(rig, "group", "drain.group", b"{}", group="drain"),
        worker_scenario(rig, "one output", "drain.output", f'{{"output_type": "{out}"}}'.encode()),
    ]


def worker_scenario(
    rig: Rig,
    name: str,
    suffix: str,
    code: bytes,
    group: str | None = None,
    mime_type: str = STUB,
) -> Scenario:
    """A worker's queue (a stub's by default), paused by stopping the worker."""
    info = rig.worker(suffix, code, group, mime_type)
    manager = rig.manager
    return Scenario(
        name,
        worker_queue_name(info.topic, str(info.id)),
        lambda count: publish(manager, info.topic, count),
        lambda: manager.stop_worker(info.id),
        lambda: manager.start_worker(info.id),
    )


def publish(manager: WorkManager, topic: str, count: int) -> None:
    """``count`` events to ``topic`` (the .NET bench worker's command included)."""
    for n in range(count):
        manager.publish(make_event(topic, "/bench", {"n": n, "command": "echo"}))


def send_bare(rig: Rig, queue_name: str, count: int) -> None:
    """``count`` bare Celery tasks that do nothing, to ``queue_name``."""
    queue = subscription_queue(queue_name)
    with rig.app.producer_or_acquire() as producer:
        for _ in range(count):
            rig.app.send_task("wm.noop", queue=queue, producer=producer)


def time_drain(rig: Rig, probe: Probe, scenario: Scenario, events: int) -> tuple[float, float]:
    """Fill while paused, resume, wait until done: (events/s, Redis commands per event)."""
    scenario.pause()
    time.sleep(SETTLE_S)
    scenario.fill(events)
    probe.mark()
    before = rig.redis_commands()
    started = time.monotonic()
    scenario.resume()
    polls = 0
    while not probe.done(scenario.queue, events):
        polls += 1
        if time.monotonic() - started > DRAIN_TIMEOUT_S:
            raise RuntimeError(f"{scenario.name}: not drained after {DRAIN_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)
    elapsed = time.monotonic() - started
    spent = rig.redis_commands() - before - (polls + 1) * probe.poll_commands - rig.info_calls
    return events / elapsed, spent / events


def report(
    results: list[Drain], header: str, events: int, repeats: int, concurrency: int, rig: Rig
) -> None:
    bare = results[0]
    broker = "Redis" if rig.redis_broker else "RabbitMQ"
    events_on = "on" if rig.settings.task_events else "off"
    print(
        f"\nDrain on {broker}: {events} queued events per scenario, {repeats} repetitions "
        f"interleaved, concurrency {concurrency}, task events {events_on}\n{header}\n"
    )
    print(f"{'scenario':<16}{'events/s (median, runs)':<34}{'ratio':>7}  {rig.counted}/event")
    for result in results:
        runs = " ".join(f"{rate:.0f}" for rate in result.rates)
        ratio = result.rate / bare.rate if bare.rate else 0.0
        spread = [
            rate / bare_rate for rate, bare_rate in zip(result.rates, bare.rates, strict=True)
        ]
        commands = statistics.median(result.commands)
        added = commands - statistics.median(bare.commands)
        extra = "" if result is bare else f" (+{added:.1f} over bare)"
        target = TARGETS.get(result.name)
        verdict = "" if target is None else _verdict(ratio >= target, f"≥ {target}×")
        print(
            f"{result.name:<16}{result.rate:>6.0f} ({runs}){'':<{max(0, 26 - len(runs))}}"
            f"{ratio:>6.2f}× [{min(spread):.2f}–{max(spread):.2f}]  {commands:.1f}{extra}"
            f"{verdict}"
        )


def _verdict(met: bool, target: str) -> str:
    return f"  target {target} " + ("met" if met else "MISSED")
