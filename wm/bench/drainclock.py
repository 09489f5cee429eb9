"""One drain timed: a queue filled while nothing consumes it, consuming resumed, the clock
run until every message is acknowledged. Two rates come of it: the full drain (from the
resume, so a node's ramp-up and its last, half-idle moments count) and the steady-state
window (from when 80 % of the queue is left until 20 % is left), with Redis commands and
node CPU time (its whole process tree, from ``/proc``) per event.

Done means no message is ready and none is unacknowledged (acks are late). How that is known
depends on the broker:

- Redis: kombu's keys say it all: one list per priority step of the queue, and the
  ``unacked`` hash. What is left is their sum (LLENs and an HLEN in one pipeline).
- RabbitMQ: a passive ``queue.declare`` counts the ready messages, but AMQP has no count of
  unacknowledged ones. So the nodes count the tasks they finished with success (one per task
  id, recorded in the step that sends the ack); once the queue is empty, the drain is over
  when that count has grown by the number of events queued. The window is read from the
  ready count alone (off by at most the messages prefetched).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kombu.connection import Connection
from kombu.transport.redis import Channel

from wm.bench.cputime import tree_cpu_s
from wm.dataplane.queues import subscription_queue
from wm.state.connection import pooled_client

#: Seconds between two checks of what is left of a drain.
POLL_S = 0.02
#: Seconds a drain may take before the bench gives up on it.
DRAIN_TIMEOUT_S = 600.0
#: Seconds for a prefetched message of the last run to be acknowledged after a pause.
SETTLE_S = 0.5
#: The steady-state window: from this share of the queue left to that one.
WINDOW = (0.8, 0.2)


class RedisProbe:
    """What is left of a drain on a Redis broker: the queue's lists and the unacked hash."""

    def __init__(self, broker_url: str, steps: Sequence[int], unacked: str = "unacked") -> None:
        self.steps, self.unacked = list(steps), unacked
        self.client = pooled_client(broker_url)
        #: Redis commands one :meth:`left` costs.
        self.poll_commands = len(self.steps) + 1

    def mark(self) -> None:
        """Nothing to remember: the broker's keys tell the end."""

    def keys(self, queue: str) -> list[str]:
        """The queue's lists, one per priority step: name, name<sep>3, …"""
        return [queue if not step else f"{queue}{Channel.sep}{step}" for step in self.steps]

    def left(self, queue: str) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys(queue):
            pipe.llen(key)
        pipe.hlen(self.unacked)
        return sum(pipe.execute())

    def done(self, queue: str, events: int, left: int) -> bool:
        return not left


class AmqpProbe:
    """What is left of a drain on RabbitMQ: the ready messages; the end: none ready, and the
    nodes have finished as many tasks with success since :meth:`mark` as events were queued."""

    poll_commands = 0

    def __init__(self, broker_url: str, succeeded: Callable[[], int]) -> None:
        self.broker_url, self.succeeded = broker_url, succeeded
        self.base = 0
        self.connection = Connection(broker_url)

    def mark(self) -> None:
        self.base = self.succeeded()

    def left(self, queue: str) -> int:
        bound = subscription_queue(queue).bind(self.connection.default_channel)
        return int(bound.queue_declare(passive=True).message_count)

    def done(self, queue: str, events: int, left: int) -> bool:
        return not left and self.succeeded() - self.base >= events


class Probe(Protocol):
    """What is left of a drain, and whether it is over (a broker's or a reference's own)."""

    #: Redis commands one :meth:`left` costs.
    poll_commands: int

    def mark(self) -> None: ...
    def left(self, queue: str) -> int: ...
    def done(self, queue: str, events: int, left: int) -> bool: ...


@dataclass
class Side:
    """A queue to fill while paused and to drain once resumed, the probe of its end, the
    node processes that do the work and a counter of the Redis commands run so far."""

    name: str
    queue: str
    fill: Callable[[int], None]
    pause: Callable[[], object]
    resume: Callable[[], object]
    probe: Probe
    pids: Callable[[], list[int]]
    commands: Callable[[], int]
    #: Redis commands one call of ``commands`` costs.
    info_calls: int = 1


@dataclass(frozen=True)
class Timing:
    """One drain: events/s over the full drain and the window (None: crossed in one poll),
    Redis commands and node CPU milliseconds per event."""

    full_rate: float
    window_rate: float | None
    commands: float
    cpu_ms: float


@dataclass
class Runs:
    """A scenario's repetitions."""

    name: str
    timings: list[Timing] = field(default_factory=list)

    @property
    def full(self) -> list[float]:
        return [t.full_rate for t in self.timings]

    @property
    def window(self) -> list[float]:
        """The window's rates; a drain too short to time its window (crossed within one
        poll) counts its full drain's rate rather than none: a rate of 0 would make every
        ratio and scaling efficiency built on it 0 by chance."""
        return [t.window_rate or t.full_rate for t in self.timings]

    def median(self, what: str) -> float:
        return statistics.median(getattr(t, what) or 0.0 for t in self.timings)


def time_drain(side: Side, events: int) -> Timing:
    """Fill while paused, resume, watch what is left until done."""
    side.pause()
    time.sleep(SETTLE_S)
    side.fill(events)
    side.probe.mark()
    commands, cpu = side.commands(), tree_cpu_s(side.pids())
    started = time.monotonic()
    side.resume()
    window, polls = _Window(events, started), 0
    while True:
        left = side.probe.left(side.queue)
        polls += 1
        now = time.monotonic()
        window.see(left, now)
        if side.probe.done(side.queue, events, left):
            break
        if now - started > DRAIN_TIMEOUT_S:
            raise RuntimeError(
                f"{side.name}: not drained after {DRAIN_TIMEOUT_S:.0f} s "
                f"({left} of {events} events still queued)"
            )
        time.sleep(POLL_S)
    elapsed = time.monotonic() - started
    cpu = tree_cpu_s(side.pids()) - cpu
    spent = side.commands() - commands - polls * side.probe.poll_commands - side.info_calls
    return Timing(events / elapsed, window.rate(), spent / events, 1000 * cpu / events)


class _Window:
    """The first moments at which 80 % and 20 % of the queue were left."""

    def __init__(self, events: int, started: float) -> None:
        self.marks = [share * events for share in WINDOW]
        self.seen: list[tuple[int, float]] = []

    def see(self, left: int, now: float) -> None:
        if len(self.seen) < len(self.marks) and left <= self.marks[len(self.seen)]:
            self.seen.append((left, now))

    def rate(self) -> float | None:
        if len(self.seen) < 2 or self.seen[1][1] <= self.seen[0][1]:
            return None
        (first, at), (last, until) = self.seen
        return (first - last) / (until - at)
