"""``wm bench --round-trips N``: the round-trip phase. One event at a time, the clock runs
from the publish until the answer is read from a plain queue, then the next is sent:
latency with nothing queued, the path a request/response caller waits on.

- Bare Celery: ``wm.echo`` (``wm.dataplane.tasks``) is sent the encoded event and publishes
  it to a reply queue on a pooled producer.
- WorkManager: the event is published to a stub worker's topic; the worker answers with one
  output, whose topic feeds a plain subscription (``manager.subscribe``). Likewise a
  sandboxed Python worker and, when ``wm bench`` is given one, the native worker, each
  answering with ``<topic>.processed``.

Both run on the same node (same pool, prefetch, late acks, task-events setting: the node is
asked and the report says so), both answers are read the same way (a kombu consumer on the
reply queue, acknowledging each), and each answer is matched to its event by correlation
id. The sides alternate in blocks of N (bare, WorkManager, bare, …): p50 and p99 over all
blocks, each block's p50, and the spread of the per-block ratios are printed.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wm.bench.rig import EngineWorker, Rig, percentile
from wm.config import Settings
from wm.dataplane.queues import subscription_queue
from wm.events import encode, make_event

#: Untimed round trips per side before the first block: consumers up, engine loaded.
WARM_UP = 20
#: Seconds one answer may take before the bench gives up.
ANSWER_TIMEOUT_S = 30.0
#: Target from issue 12: WorkManager's p50 at most this many times bare Celery's.
TARGET_RATIO = 2.0
#: The side of the stub worker, which the target is for.
WORKMANAGER = "workmanager"


@dataclass
class Side:
    """One side's blocks of round-trip times, in ms."""

    name: str
    blocks: list[list[float]] = field(default_factory=list)
    commands: list[float] = field(default_factory=list)

    @property
    def samples(self) -> list[float]:
        return [sample for block in self.blocks for sample in block]

    @property
    def p50(self) -> float:
        return percentile(self.samples, 50)

    @property
    def p99(self) -> float:
        return percentile(self.samples, 99)


class Caller:
    """Sends one event of one side and waits for its answer on the side's reply queue."""

    def __init__(self, rig: Rig, reply_queue: str, send: Callable[[str, str], None]) -> None:
        self.rig, self.reply_queue, self.send = rig, reply_queue, send
        self.sequence = 0
        self._replies: Any = None

    def open(self, connection: Any) -> None:
        self._replies = connection.SimpleQueue(subscription_queue(self.reply_queue))

    def close(self) -> None:
        if self._replies is not None:
            self._replies.close()

    def call(self) -> float:
        """One round trip, in ms."""
        self.sequence += 1
        correlation = f"{self.rig.prefix}-{self.sequence}"
        started = time.perf_counter()
        self.send(correlation, str(self.sequence))
        deadline = started + ANSWER_TIMEOUT_S
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise RuntimeError(f"no answer on {self.reply_queue} in {ANSWER_TIMEOUT_S} s")
            try:
                message = self._replies.get(timeout=remaining)
            except self._replies.Empty as exc:
                raise RuntimeError(
                    f"no answer on {self.reply_queue} in {ANSWER_TIMEOUT_S} s"
                ) from exc
            elapsed = time.perf_counter() - started
            message.ack()
            if json.loads(message.body).get("correlationid") == correlation:
                return elapsed * 1000


def run(
    settings: Settings,
    home: Path,
    round_trips: int,
    repeats: int,
    concurrency: int,
    engines: Sequence[EngineWorker] = (),
) -> None:
    """Time ``round_trips`` round trips per side, in ``repeats`` interleaved blocks; print."""
    with Rig(settings) as rig:
        header, sides = measure(rig, home, round_trips, repeats, concurrency, engines)
    report(sides, header, round_trips, repeats, concurrency, rig)


def measure(
    rig: Rig,
    home: Path,
    round_trips: int,
    repeats: int,
    concurrency: int,
    engines: Sequence[EngineWorker] = (),
) -> tuple[str, list[Side]]:
    """The node's description, and the blocks of bare Celery, WorkManager's stub worker and
    each engine worker of ``engines`` (answering with ``<topic>.processed``)."""
    callers = _callers(rig)
    for engine in engines:
        callers[engine.name] = _engine_caller(rig, engine)
    sides = [Side(name) for name in callers]
    with rig.node(home, concurrency, [rig.name("rt.bare")]):
        header = rig.describe_node()
        with rig.app.connection_for_read() as connection:
            for caller in callers.values():
                caller.open(connection)
            try:
                for caller in callers.values():
                    for _ in range(WARM_UP):
                        caller.call()
                for _ in range(repeats):
                    for side, caller in zip(sides, callers.values(), strict=True):
                        before = rig.redis_commands()
                        side.blocks.append([caller.call() for _ in range(round_trips)])
                        spent = rig.redis_commands() - before - rig.info_calls
                        side.commands.append(spent / round_trips)
            finally:
                for caller in callers.values():
                    caller.close()
    return header, sides


def _callers(rig: Rig) -> dict[str, Caller]:
    app, manager = rig.app, rig.manager
    bare_queue = subscription_queue(rig.queue("rt.bare"))
    bare_reply = rig.queue("rt.bare.reply")
    answers = rig.subscribe("rt.out", "answers")
    worker = rig.worker("rt.in", f'{{"output_type": "{rig.name("rt.out")}"}}'.encode())

    def bare(correlation: str, n: str) -> None:
        payload = encode(_event(worker.topic, correlation, n))
        with app.producer_or_acquire() as producer:
            app.send_task(
                "wm.echo", args=[bare_reply, payload], queue=bare_queue, producer=producer
            )

    def workmanager(correlation: str, n: str) -> None:
        manager.publish(_event(worker.topic, correlation, n))

    return {
        "bare celery": Caller(rig, bare_reply, bare),
        WORKMANAGER: Caller(rig, answers, workmanager),
    }


def _engine_caller(rig: Rig, engine: EngineWorker) -> Caller:
    suffix = f"rt.{engine.suffix}"
    answers = rig.subscribe(f"{suffix}.processed", "answers")
    worker = rig.worker(suffix, engine.code, mime_type=engine.mime_type)

    def send(correlation: str, n: str) -> None:
        rig.manager.publish(_event(worker.topic, correlation, n))

    return Caller(rig, answers, send)


def _event(topic: str, correlation: str, n: str) -> Any:
    return make_event(topic, "/bench", {"n": n}, extensions={"correlationid": correlation})


def report(
    sides: list[Side], header: str, round_trips: int, repeats: int, concurrency: int, rig: Rig
) -> None:
    bare = sides[0]
    broker = "Redis" if rig.redis_broker else "RabbitMQ"
    events_on = "on" if rig.settings.task_events else "off"
    print(
        f"\nRound trips on {broker}: one event at a time, publish → answer received; "
        f"{round_trips} per side in each of {repeats} interleaved blocks, concurrency "
        f"{concurrency}, task events {events_on}\n{header}\n"
    )
    print(
        f"{'side':<15}{'p50 ms (blocks)':<30}{'p99 ms':>8}{'ratio p50':>11}  "
        f"{rig.counted}/round trip"
    )
    for side in sides:
        spread = [
            percentile(mine, 50) / percentile(theirs, 50)
            for mine, theirs in zip(side.blocks, bare.blocks, strict=True)
        ]
        blocks = " ".join(f"{percentile(block, 50):.2f}" for block in side.blocks)
        ratio = side.p50 / bare.p50 if bare.p50 else 0.0
        commands = statistics.median(side.commands)
        if side is bare:
            tail = f"{'1.00×':>11}  {commands:.1f}"
        else:
            tail = (
                f"{ratio:>10.2f}× [{min(spread):.2f}–{max(spread):.2f}]  {commands:.1f} "
                f"(+{commands - statistics.median(bare.commands):.1f} over bare)"
            )
        if side.name == WORKMANAGER:
            tail += f"  target ≤ {TARGET_RATIO:g}× " + (
                "met" if ratio <= TARGET_RATIO else "MISSED"
            )
        print(
            f"{side.name:<15}{side.p50:>6.2f} ({blocks}){'':<{max(0, 21 - len(blocks))}}"
            f"{side.p99:>8.2f}{tail}"
        )
