"""``wm bench --drain-repeats R``: the drain phase. Each scenario's queue is filled while
nothing consumes it, then consuming starts and the clock runs until every message is done:
throughput without the publisher competing, and Redis commands per event, for a bare Celery
task and WorkManager on the same node, with the same pool, prefetch, acks and task-events
setting. Scenarios run interleaved (bare, no group, group, one output, bare, …) so a slow
stretch of the machine hits them all; the spread of the repetitions is printed.

Done means the queue is empty and no message is unacknowledged (acks are late, so a message
is acknowledged once its task finished). Redis only: the check reads kombu's Redis keys.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from celery import Celery
from kombu.transport.redis import PRIORITY_STEPS, Channel

from wm.config import Settings
from wm.dataplane.app import make_app, redis_broker
from wm.dataplane.queues import subscription_queue, worker_queue_name
from wm.events import make_event
from wm.local.up import celery_node
from wm.manager import WorkManager
from wm.state.connection import pooled_client

BARE_QUEUE = "wm.bench.drain.bare"
STUB = "application/x-wm-stub"
#: Seconds between two checks for the end of a drain.
POLL_S = 0.02
#: Redis commands each check costs (a length per priority step, the unacked count).
POLL_COMMANDS = len(PRIORITY_STEPS) + 1


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


def run(settings: Settings, home: Path, events: int, repeats: int, concurrency: int) -> None:
    """Time the drain of ``events`` messages per scenario, ``repeats`` times, and print it."""
    if not redis_broker(settings.broker_url):
        raise SystemExit("wm bench: the drain phase reads Redis queues; use a Redis broker")
    app = make_app(settings)
    manager = WorkManager(settings)
    scenarios = _scenarios(app, manager)
    client = pooled_client(settings.broker_url)  # the server of broker and state
    declare_queue(app, BARE_QUEUE)
    results = {scenario.name: Drain(scenario.name) for scenario in scenarios}
    with celery_node(home, settings, concurrency, extra_queues=[BARE_QUEUE]):
        for scenario in scenarios:  # warm: consumers up, engines loaded
            scenario.fill(5)
        time.sleep(5)
        for _ in range(repeats):
            for scenario in scenarios:
                rate, commands = _drain(scenario, events, client)
                results[scenario.name].rates.append(rate)
                results[scenario.name].commands.append(commands)
    _report(list(results.values()), events, repeats, concurrency, settings.task_events)


def _scenarios(app: Celery, manager: WorkManager) -> list[Scenario]:
    def worker(name: str, topic: str, code: bytes, group: str | None = None) -> Scenario:
        info = manager.create_worker(code=code, mime_type=STUB, topic=topic, group=group)
        return Scenario(
            name,
            worker_queue_name(topic, str(info.id)),
            lambda count: publish(manager, topic, count),
            lambda: manager.stop_worker(info.id),
            lambda: manager.start_worker(info.id),
        )

    manager.subscribe("drain.out", "sink")
    return [
        Scenario(
            "bare celery",
            BARE_QUEUE,
            lambda count: send_bare(app, BARE_QUEUE, count),
            lambda: app.control.cancel_consumer(BARE_QUEUE, reply=True),
            lambda: app.control.add_consumer(BARE_QUEUE, reply=True),
        ),
        worker("no group", "drain.nogroup", b"{}"),
        worker("group", "drain.group", b"{}", group="drain"),
        worker("one output", "drain.output", b'{"output_type": "drain.out"}'),
    ]


def publish(manager: WorkManager, topic: str, count: int) -> None:
    """``count`` events to ``topic`` (the .NET bench worker's command included)."""
    for n in range(count):
        manager.publish(make_event(topic, "/bench", {"n": n, "command": "echo"}))


def declare_queue(app: Celery, queue_name: str) -> None:
    """Declare the bare Celery reference's queue, which no worker owns."""
    with app.connection_for_write() as connection:
        subscription_queue(queue_name).bind(connection.default_channel).declare()


def send_bare(app: Celery, queue_name: str, count: int) -> None:
    """``count`` bare Celery tasks that do nothing, to ``queue_name``."""
    queue = subscription_queue(queue_name)
    with app.producer_or_acquire() as producer:
        for _ in range(count):
            app.send_task("wm.noop", queue=queue, producer=producer)


def _drain(scenario: Scenario, events: int, client: redis.Redis) -> tuple[float, float]:
    """Fill while paused, resume, wait until done: (events/s, Redis commands per event)."""
    scenario.pause()
    time.sleep(0.5)  # a prefetched message of the last run is acknowledged
    scenario.fill(events)
    # kombu's Redis transport keeps one list per priority step: name, name<sep>3, …
    keys = [scenario.queue] + [
        f"{scenario.queue}{Channel.sep}{step}" for step in PRIORITY_STEPS[1:]
    ]
    before = _commands(client)
    started = time.monotonic()
    scenario.resume()
    polls = 0
    while True:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.llen(key)
        pipe.hlen("unacked")
        polls += 1
        if not any(pipe.execute()):
            break
        time.sleep(POLL_S)
    elapsed = time.monotonic() - started
    spent = _commands(client) - before - polls * POLL_COMMANDS - 1  # the INFO itself
    return events / elapsed, spent / events


def _commands(server: redis.Redis) -> int:
    return sum(int(stat["calls"]) for stat in server.info("commandstats").values())


def _report(
    results: list[Drain], events: int, repeats: int, concurrency: int, task_events: bool
) -> None:
    bare = results[0]
    print(
        f"\nDrain: {events} queued events per scenario, {repeats} repetitions interleaved, "
        f"concurrency {concurrency}, task events {'on' if task_events else 'off'}\n"
    )
    print(f"{'scenario':<14}{'events/s (median, runs)':<34}{'ratio':>7}  Redis commands/event")
    for result in results:
        runs = " ".join(f"{rate:.0f}" for rate in result.rates)
        ratio = result.rate / bare.rate if bare.rate else 0.0
        spread = [
            rate / bare_rate for rate, bare_rate in zip(result.rates, bare.rates, strict=True)
        ]
        commands = statistics.median(result.commands)
        added = commands - statistics.median(bare.commands)
        extra = "" if result is bare else f" (+{added:.1f} over bare)"
        print(
            f"{result.name:<14}{result.rate:>6.0f} ({runs}){'':<{max(0, 26 - len(runs))}}"
            f"{ratio:>6.2f}× [{min(spread):.2f}–{max(spread):.2f}]  {commands:.1f}{extra}"
        )
