"""``wm bench --scale-workers W``: W stub workers (each with code of its own) over T topics on
N nodes, against one worker on the same N nodes, in one run (issue 12's case is 1,000
workers, 100 topics, 3 nodes).

The N nodes are bench nodes (``wm.bench.nodes``, ``celery -A wm.bench.benchnode``), launched
at once and told apart by their names (``<prefix>@<host>.0``, ``.1``, …); they share the
phase's exchanges and, on Redis, its ready list. A delivery is *served* once its outcome is
recorded: the pending ledger (``wm.state.ledger``) holds every delivery from its publish
until then, one sorted set per worker, so the bench counts what is left of each worker's
deliveries (one ZCARD per worker not done, one pipeline per look) and knows exactly when
each worker had its first delivery served and when all were. In order:

1. **Memory, no worker.** The nodes are launched with none of the phase's workers running
   and, once each consumes its queues, the resident memory of each node (its main process
   and its pool's processes, ``/proc``) is read.
2. **Memory, W idle workers; served after publish.** The W workers are created (running)
   and the nodes launched again; once every node consumes all W queues their memory is read
   again: the growth per worker shows whether an idle worker costs a node memory. Then one
   event per worker is published (one per topic) and the clock runs until every worker has
   been served; memory is read a third time (each worker's engine now loaded).
3. **Served after start.** One event per worker is queued while no node runs, the nodes are
   launched and the clock runs from the launch until every worker has been served (Celery's
   boot and the nodes' start-up work included); when every node answered a ping is shown
   too.
4. **Throughput, many against one.** The same number of deliveries (``--scale-deliveries``
   per worker) go to the W workers (spread evenly: the same count of events to every topic)
   or to one worker while the W are stopped (so the nodes consume one worker queue). The
   queues are filled while no node runs, the nodes are launched, and deliveries/s are
   counted between 20 % and 80 % of the deliveries (boot and tail left out). Sides alternate
   (one, many, one, many, …) and each repetition's ratio is printed. In the same window the
   bench counts Redis commands (``INFO commandstats``, minus its own polling) and Redis CPU
   (``INFO cpu``, user + system, minus what its polling was measured to cost) per delivery;
   on RabbitMQ, those of the state store's Redis.

Everything the phase made (workers, queues, on RabbitMQ the exchanges) is deleted at its end.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from wm.bench.nodes import Nodes
from wm.bench.rig import Rig
from wm.config import Settings
from wm.dataplane.app import redis_broker
from wm.events import make_event
from wm.state.connection import pooled_client
from wm.state.ledger import Ledger

#: Seconds between two looks at the workers' pending deliveries.
POLL_S = 0.1
#: Seconds one run (nodes launched until every delivery served) may take.
RUN_TIMEOUT_S = 900.0
#: Looks at the ledger that measure what the bench's own polling costs Redis.
CALIBRATION_POLLS = 30
#: The share of the deliveries left at which the throughput window opens and closes.
WINDOW = (0.8, 0.2)
#: Targets from issue 12: every worker served this soon after start; many ≥ this × one;
#: idle memory of a node with W workers at most this much above the one with none.
SERVED_TARGET_S = 10.0
RATIO_TARGET = 0.9
FLAT_TARGET = 0.10


@dataclass
class Mark:
    """What the bench saw at one look: seconds since launch, deliveries left, and the Redis
    counters then (commands, CPU seconds, commands the bench's polling had sent so far)."""

    at: float
    left: int
    commands: int
    cpu_s: float
    polled: int


@dataclass
class Follow:
    """One run followed to its end: when the first and the last worker had their first
    delivery served, and the marks the throughput window is cut from."""

    first_served_s: float
    all_served_s: float
    marks: dict[float, Mark] = field(default_factory=dict)


@dataclass
class Drain:
    """One throughput run: deliveries/s, Redis commands and Redis CPU seconds per delivery."""

    rate: float
    commands: float
    cpu_s: float


@dataclass
class Side:
    name: str
    runs: list[Drain] = field(default_factory=list)

    def median(self, attribute: str) -> float:
        return float(statistics.median(getattr(run, attribute) for run in self.runs))


@dataclass
class Report:
    """Every figure of the phase."""

    workers: int
    empty_rss: list[int] = field(default_factory=list)
    idle_rss: list[int] = field(default_factory=list)
    loaded_rss: list[int] = field(default_factory=list)
    served_after_publish_s: float = 0.0
    served_after_start_s: float = 0.0
    first_served_after_start_s: float = 0.0
    empty_up_s: float = 0.0
    nodes_up_s: float = 0.0
    sides: list[Side] = field(default_factory=list)


class Counters:
    """The Redis servers the phase counts (broker and state store on Redis, the state store
    on RabbitMQ): commands, CPU, and what the bench's own ledger polling costs."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        urls = [rig.settings.redis_url] + ([rig.settings.broker_url] if rig.redis_broker else [])
        servers = {urlsplit(url)._replace(path="").geturl(): url for url in urls}
        self.urls = list(servers.values())
        #: CPU seconds one ZCARD of the bench's polling costs Redis (:meth:`calibrate`).
        self.cpu_per_poll = 0.0

    def mark(self, at: float, left: int, polled: int) -> Mark:
        commands = self.rig.redis_commands()
        return Mark(at, left, commands, self.cpu_s(), polled)

    def cpu_s(self) -> float:
        total = 0.0
        for url in self.urls:
            info = pooled_client(url).info("cpu")
            total += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return total

    @property
    def per_mark(self) -> int:
        """Commands one :meth:`mark` sends (INFO commandstats and INFO cpu per server)."""
        return 2 * len(self.urls)

    def calibrate(self, ledger: Ledger, ids: list[str]) -> None:
        """Measure the Redis CPU of the bench's own polling (``ids`` ZCARDs a look)."""
        before = self.cpu_s()
        for _ in range(CALIBRATION_POLLS):
            ledger.pending_of(ids)
        spent = self.cpu_s() - before
        self.cpu_per_poll = max(spent, 0.0) / (CALIBRATION_POLLS * len(ids))


def run(
    settings: Settings,
    home: Path,
    workers: int,
    topics: int,
    nodes: int,
    per_worker: int,
    repeats: int,
    concurrency: int,
) -> None:
    """The scale phase, printed."""
    broker = "Redis" if settings.broker_url.startswith("redis") else "RabbitMQ"
    print(
        f"\nScale on {broker}: {workers} stub workers over {topics} topics against one, "
        f"{nodes} nodes of {concurrency} processes, {per_worker * workers} deliveries per "
        f"throughput run, {repeats} interleaved repetitions, {_placement(settings)}",
        flush=True,
    )
    with Rig(settings) as rig:
        report = measure(rig, home, workers, topics, nodes, per_worker, repeats, concurrency)
        started = time.monotonic()
    print(f"  cleaned up in {time.monotonic() - started:.0f} s", flush=True)
    print_report(report, rig.counted, broker)


def _placement(settings: Settings) -> str:
    """How the nodes share the workers (``wm.dataplane.placement``)."""
    if not redis_broker(settings.broker_url) or not settings.ready_list:
        return "every node serving every worker"
    if not settings.placement_spill:
        return "placement off (WM_PLACEMENT_SPILL=0): every node serving every worker"
    return (
        "each worker placed on one node, on every node past "
        f"{settings.placement_spill} queued (WM_PLACEMENT_SPILL)"
    )


def measure(
    rig: Rig,
    home: Path,
    workers: int,
    topics: int,
    nodes: int,
    per_worker: int,
    repeats: int,
    concurrency: int,
) -> Report:
    """Every figure of the phase (``rig`` is closed by the caller), step by step."""
    phase = _Phase(
        rig,
        home,
        nodes,
        concurrency,
        topics,
        Report(workers),
        Ledger(rig.settings),
        Counters(rig),
        rig.queue("scale.nodes"),  # the nodes' -Q queue: the phase's own, not the default
    )
    phase.memory_with_no_worker()
    phase.create_workers()
    phase.served_after_publish()
    phase.served_after_start()
    phase.throughput(per_worker, repeats)
    return phase.report


@dataclass
class _Phase:
    """What the steps of one scale phase share: the nodes they launch, the counters and the
    ledger they read, the W workers (``many``) and the one, and the figures found so far."""

    rig: Rig
    home: Path
    nodes: int
    concurrency: int
    topics: int
    report: Report
    ledger: Ledger
    counters: Counters
    queue: str
    many: list[str] = field(default_factory=list)
    one: str = ""

    def launch(self) -> Nodes:
        return Nodes(self.rig, self.home, self.nodes, self.concurrency, self.queue)

    def spread(self, count: int) -> None:
        """``count`` events to every topic of the W workers."""
        for n in range(count):
            for t in range(self.topics):
                self.rig.manager.publish(make_event(self.rig.name(f"t{t}"), "/bench", {"n": n}))

    def memory_with_no_worker(self) -> None:
        """Step 1: the nodes' memory once they consume their own queue."""
        report = self.report
        with self.launch() as group:
            report.empty_up_s = group.wait_up()
            group.wait_consuming(1)
            report.empty_rss = group.rss()
            _say(group.describe())
        _say(
            f"memory with no worker: {_mib(report.empty_rss)} per node (all answered a ping "
            f"{report.empty_up_s:.1f} s after their launch)"
        )

    def create_workers(self) -> None:
        """The W workers, running, and the one, stopped; then the cost of the bench's own
        polling is measured."""
        workers, clock = self.report.workers, time.monotonic()
        # each with code of its own, as in a deployment: no cache of code shared by content
        # serves one worker's loads with another's
        self.many = [
            str(self.rig.worker(f"t{n % self.topics}", _code(f"worker {n}")).id)
            for n in range(workers)
        ]
        self.one = str(self.rig.worker("one", _code("one")).id)
        self.rig.manager.stop_worker(self.one)
        _say(f"{workers} workers created in {time.monotonic() - clock:.0f} s")
        self.counters.calibrate(self.ledger, self.many)

    def served_after_publish(self) -> None:
        """Step 2: memory with W idle workers, every worker served after one publish each,
        and memory again."""
        report = self.report
        with self.launch() as group:
            group.wait_consuming(report.workers + 1)
            report.idle_rss = group.rss()
            published = time.monotonic()
            self.spread(1)
            served = _follow(
                self.ledger, self.counters, dict.fromkeys(self.many, 1), group, published
            )
            report.served_after_publish_s = served.all_served_s
            report.loaded_rss = group.rss()
        _say(
            f"memory with {report.workers} idle workers: {_mib(report.idle_rss)}, after serving "
            f"each once: {_mib(report.loaded_rss)}; every worker served "
            f"{report.served_after_publish_s:.1f} s after the publish"
        )

    def served_after_start(self) -> None:
        """Step 3: one event per worker queued while no node runs, served after the launch."""
        report = self.report
        self.spread(1)
        with self.launch() as group:
            initial = dict.fromkeys(self.many, 1)
            cold = _follow(self.ledger, self.counters, initial, group, group.launched)
            report.nodes_up_s = group.wait_up()
        report.served_after_start_s = cold.all_served_s
        report.first_served_after_start_s = cold.first_served_s
        _say(
            f"every worker served {cold.all_served_s:.1f} s after the nodes' launch, the first "
            f"{cold.first_served_s:.1f} s after it (all nodes answered a ping after "
            f"{report.nodes_up_s:.1f} s)"
        )

    def throughput(self, per_worker: int, repeats: int) -> None:
        """Step 4: the same deliveries to the one worker or spread over the W, alternating."""
        workers = self.report.workers
        total = per_worker * workers
        sides = [
            (Side("one worker"), {self.one: total}, lambda: _publish(self.rig, "one", total)),
            (
                Side(f"{workers} workers"),
                dict.fromkeys(self.many, per_worker),
                lambda: self.spread(per_worker),
            ),
        ]
        self.report.sides = [side for side, _, _ in sides]
        running: list[str] = self.many
        for _ in range(repeats):
            for side, sent, fill in sides:
                running = _switch(self.rig, running, list(sent))
                fill()
                drain = self.drain(sent)
                side.runs.append(drain)
                _say(
                    f"{side.name}: {drain.rate:.0f} deliveries/s, {drain.commands:.1f} commands "
                    f"and {drain.cpu_s * 1e3:.2f} ms Redis CPU per delivery"
                )

    def drain(self, sent: dict[str, int]) -> Drain:
        """One throughput run: the queues filled, the nodes launched and followed to the end."""
        with self.launch() as group:
            followed = _follow(self.ledger, self.counters, sent, group, group.launched)
        return _drain(followed, self.counters)


def _publish(rig: Rig, suffix: str, count: int) -> None:
    topic = rig.name(suffix)
    for n in range(count):
        rig.manager.publish(make_event(topic, "/bench", {"n": n}))


def _switch(rig: Rig, running: list[str], wanted: list[str]) -> list[str]:
    """Stop the workers of ``running`` not in ``wanted``, start the others of ``wanted``."""
    keep, was = set(wanted), set(running)
    for worker_id in running:
        if worker_id not in keep:
            rig.manager.stop_worker(worker_id)
    for worker_id in wanted:
        if worker_id not in was:
            rig.manager.start_worker(worker_id)
    return wanted


def _follow(
    ledger: Ledger, counters: Counters, initial: dict[str, int], group: Nodes, started: float
) -> Follow:
    """Look at the workers' pending deliveries (``initial``: worker id → deliveries sent,
    nothing else pending) until none is left; marks are taken at the first progress, at each
    share of :data:`WINDOW` and at the end; seconds count from ``started``. Stops if a node
    of ``group`` fails."""
    total = sum(initial.values())
    remaining = [w for w, n in initial.items() if n]
    unserved, polled = set(remaining), 0
    follow = Follow(0.0, 0.0)
    shares = [1.0, *WINDOW, 0.0]
    while remaining:
        if time.monotonic() - started > RUN_TIMEOUT_S:
            raise SystemExit(f"wm bench: a scale run did not finish in {RUN_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)
        group.check()
        counts = ledger.pending_of(remaining)
        polled += len(remaining)
        now = time.monotonic() - started
        for worker_id, count in counts.items():
            if worker_id in unserved and count < initial[worker_id]:
                follow.first_served_s = follow.first_served_s or now
                unserved.discard(worker_id)
                follow.all_served_s = now
        remaining = [w for w, n in counts.items() if n]
        left = sum(counts.values())
        reached = []
        while shares and (left < total if shares[0] == 1.0 else left <= shares[0] * total):
            reached.append(shares.pop(0))
        if reached:
            mark = counters.mark(now, left, polled)
            follow.marks.update(dict.fromkeys(reached, mark))
    return follow


def _drain(follow: Follow, counters: Counters) -> Drain:
    """Deliveries/s and Redis cost per delivery between the marks of :data:`WINDOW` (from
    the first progress to the end when a run is too short to tell those apart)."""
    first, last = (follow.marks[share] for share in WINDOW)
    if last.at <= first.at:
        first, last = follow.marks[1.0], follow.marks[0.0]
    delivered = first.left - last.left
    if delivered <= 0 or last.at <= first.at:
        return Drain(0.0, 0.0, 0.0)
    polled = last.polled - first.polled
    commands = last.commands - first.commands - polled - counters.per_mark
    cpu = last.cpu_s - first.cpu_s - polled * counters.cpu_per_poll
    return Drain(delivered / (last.at - first.at), commands / delivered, cpu / delivered)


def print_report(report: Report, counted: str, broker: str) -> None:
    print(f"\nScale on {broker}, {report.workers} workers against one:")
    _print_served(report)
    _print_sides(report, counted)
    _print_memory(report)


def _print_served(report: Report) -> None:
    served = [
        ("after the nodes' launch", report.served_after_start_s),
        ("after the publish", report.served_after_publish_s),
    ]
    for what, seconds in served:
        print(
            f"  every worker served {what}: {seconds:.1f} s"
            f"{_verdict(seconds < SERVED_TARGET_S, f'< {SERVED_TARGET_S:.0f} s')}"
        )
    print(
        f"  (after their launch, the first worker was served after "
        f"{report.first_served_after_start_s:.1f} s; the nodes answered a ping after "
        f"{report.nodes_up_s:.1f} s, {report.empty_up_s:.1f} s when launched with no worker)"
    )


def _print_sides(report: Report, counted: str) -> None:
    print(f"\n  {'side':<16}{'deliveries/s (median, runs)':<32}{counted}/delivery  Redis CPU")
    for side in report.sides:
        runs = " ".join(f"{run.rate:.0f}" for run in side.runs)
        print(
            f"  {side.name:<16}{side.median('rate'):>6.0f} ({runs}){'':<{max(0, 23 - len(runs))}}"
            f"{side.median('commands'):>8.1f}{'':<{max(0, len(counted) + 3)}}"
            f"{side.median('cpu_s') * 1e3:.3f} ms"
        )
    if len(report.sides) == 2:
        _print_ratio(*report.sides)


def _print_ratio(one: Side, many: Side) -> None:
    """Many workers' throughput against one's, per repetition and their median."""
    pairs = list(zip(one.runs, many.runs, strict=True))
    ratios = [m.rate / o.rate for o, m in pairs if o.rate and m.rate]
    median = statistics.median(ratios) if ratios else 0.0
    print(
        f"  many/one: {median:.2f}× (per repetition {' '.join(f'{r:.2f}×' for r in ratios)})"
        f"{_verdict(median >= RATIO_TARGET, f'≥ {RATIO_TARGET}×')}"
    )
    if len(ratios) < len(pairs):  # served between two looks: no rate to tell (0 above)
        print(
            f"  ({len(pairs) - len(ratios)} repetition(s) too short to time: "
            "raise --scale-deliveries)"
        )


def _print_memory(report: Report) -> None:
    workers = report.workers
    empty, idle, loaded = (
        _mean(report.empty_rss),
        _mean(report.idle_rss),
        _mean(report.loaded_rss),
    )
    growth = (idle - empty) / empty if empty else 0.0
    print(
        f"\n  memory per node (main process + pool, mean of the nodes): {empty / 2**20:.1f} MiB "
        f"with no worker, {idle / 2**20:.1f} MiB with {workers} idle workers "
        f"({growth * 100:+.1f} %, {(idle - empty) / workers / 1024:+.1f} KiB per worker)"
        f"{_verdict(growth <= FLAT_TARGET, f'flat (≤ +{FLAT_TARGET * 100:.0f} %)')}"
    )
    print(
        f"  after serving each worker once: {loaded / 2**20:.1f} MiB "
        f"({(loaded - idle) / 2**20:+.1f} MiB, {(loaded - idle) / workers / 1024:+.1f} KiB per "
        "worker served, the first delivery's imports included)"
    )


def _mean(values: Sequence[int]) -> float:
    return float(statistics.mean(values)) if values else 0.0


def _mib(sizes: Sequence[int]) -> str:
    return " ".join(f"{size / 2**20:.1f}" for size in sizes) + " MiB"


def _say(text: str) -> None:
    print(f"  {text}", flush=True)


def _verdict(met: bool, target: str) -> str:
    return f"  target {target} " + ("met" if met else "MISSED")


def _code(label: str) -> bytes:
    """A stub worker's code that does nothing, distinct by its ``label``."""
    return json.dumps({"label": label}).encode()
