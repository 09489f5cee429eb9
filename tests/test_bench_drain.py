"""The bench's drain and round-trip phases on real nodes, on Redis and on RabbitMQ: every
scenario timed and counted against a plain Celery reference in a process tree of its own,
the end of a drain exact on both sides, the bench's names its own and gone afterwards (small
numbers: this checks the tool, not the speed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from amqp.exceptions import NotFound
from kombu.connection import Connection
from kombu.transport.redis import PRIORITY_STEPS

from tests.conftest import AMQP_URL, need
from wm import Settings
from wm.bench import drain, roundtrip
from wm.bench.drainclock import RedisProbe, time_drain
from wm.bench.dramatiqnodes import DRAMATIQ, DramatiqNode
from wm.bench.plainnodes import PLAIN_DIR, PlainNodes
from wm.bench.rig import PYTHON_ANSWER, EngineWorker, Rig, mismatches, task_options
from wm.dataplane.app import make_app
from wm.dataplane.queues import plain_queue_name
from wm.engine import child_pids
from wm.state.connection import pooled_client

#: Keys of a worker's state that a deleted worker must not leave for long.
WORKER_STATE = (
    "wm:outcome:",
    "wm:published:",
    "wm:worker-generation:",
    "wm:health-state:",
    "wm:health-since:",
)
#: Busy time of each event of the slow stub worker (ms), and how many it is sent.
SLOW_MS, SLOW_EVENTS = 200, 8


@pytest.fixture(params=["redis", "amqp"])
def bench_settings(
    request: pytest.FixtureRequest, pg_settings: Settings, own_redis: tuple[int, object]
) -> Settings:
    """A Redis of the test's own (so the command counts are the bench's alone) as the state
    store, and as the broker or beside RabbitMQ."""
    server = f"redis://127.0.0.1:{own_redis[0]}"
    settings = pg_settings.replace(broker_url=f"{server}/0", redis_url=f"{server}/1")
    if request.param == "amqp":
        try:
            with Connection(AMQP_URL, connect_timeout=3) as connection:
                connection.connect()
        except OSError as exc:
            need("RabbitMQ", exc)
        settings = settings.replace(broker_url=AMQP_URL)
    return settings


@pytest.fixture
def rig(bench_settings: Settings) -> Iterator[Rig]:
    with Rig(bench_settings) as made:
        yield made
    _assert_gone(made)


def _assert_gone(rig: Rig) -> None:
    """Nothing the bench made is left: no key of the test's own Redis names the bench or a
    worker's state (outcomes, the markers of outputs published, cache generations, kept
    health verdicts), nor on RabbitMQ a queue or exchange of the bench's."""
    for url in {rig.settings.redis_url, rig.settings.broker_url} - {AMQP_URL}:
        keys = [key.decode() for key in pooled_client(url).scan_iter()]
        left = [key for key in keys if rig.prefix in key or key.startswith(WORKER_STATE)]
        assert not left, f"{url}: {left[:10]}"
    if rig.redis_broker:
        return
    assert rig.queues
    with Connection(AMQP_URL) as connection:
        for queue in rig.queues:
            with pytest.raises(NotFound):
                connection.channel().queue_declare(queue, passive=True)
        for exchange in rig.exchanges:
            with pytest.raises(NotFound):
                connection.channel().exchange_declare(exchange, "direct", passive=True)


@pytest.fixture
def engines(native_zips: dict[str, Path]) -> list[EngineWorker]:
    """A sandboxed Python worker and the native C example, both answering every event."""
    return [
        EngineWorker("python worker", "python", "text/x-python", PYTHON_ANSWER),
        EngineWorker(
            "native worker",
            "native",
            "application/x-native-dll",
            native_zips["c-example"].read_bytes(),
        ),
    ]


#: A row of the drain's table: name, full drain and window (events/s, ratio, spread),
#: Redis commands and CPU milliseconds per event, and the target's verdict if it has one.
ROW = re.compile(
    r"^(?P<name>[a-z.,# ]+?)\s+(?P<full>\d+)\s+(?P<full_ratio>[\d.]+)× \[[\d.]+–[\d.]+\]"
    r"\s+(?P<window>\d+)\s+[\d.]+× \[[\d.]+–[\d.]+\]\s+(?P<commands>[\d.]+)\s+"
    r"(?P<cpu>[\d.]+)(?P<verdict>  target ≥ [\d.]+×: full (met|MISSED \([\d.]+×\)), "
    r"window (met|MISSED \([\d.]+×\)))?$",
    flags=re.MULTILINE,
)


@pytest.mark.slow
def test_the_drain_phase_times_every_scenario_against_the_plain_reference(
    rig: Rig, tmp_path: Path, capsys: pytest.CaptureFixture[str], engines: list[EngineWorker]
) -> None:
    header, results, notes = drain.measure(rig, tmp_path, 30, 2, 2, engines)
    drain.report(results, header, notes, 30, 2, rig)
    out = capsys.readouterr().out
    broker = "Redis" if rig.redis_broker else "RabbitMQ"
    assert f"Drain on {broker}: 30 queued events per scenario, 2 repetitions" in out
    assert "task events off" in out
    assert "plain celery " in out and "acks late True, serializer json, log level WARNING" in out
    assert "no module of wm loaded" in out
    assert "prefork:TaskPool, 2 processes, prefetch 8 (multiplier 4)" in out
    assert "wm.noop, wm.echo configured like wm.deliver (acks_late=True" in out
    rows = {match["name"].strip(): match for match in ROW.finditer(out)}
    batched = ["batched"] if rig.redis_broker else []
    workers = ["no output", "one output", *batched, "group", "python worker", "native worker"]
    dramatiq = [DRAMATIQ] if rig.redis_broker else []
    assert list(rows) == [drain.PLAIN, *workers, drain.WM_NOOP, *dramatiq], out
    if not batched:
        assert "batched: on a Redis broker only" in out
        assert f"{DRAMATIQ}: on a Redis broker only" in out
    else:
        assert "plain dramatiq: 2 processes × 8 threads, prefetch 32 per process" in out
        assert re.search(rf"batched / {DRAMATIQ}, window: [\d.]+× \(target: ahead", out), out
    assert all(int(row["full"]) > 0 for row in rows.values())
    # Node CPU is the kernel's count in clock ticks (10 ms a process): a fast scenario's
    # 30 events may not reach one, the table's do.
    assert sum(float(row["cpu"]) for row in rows.values()) > 0, out
    assert rows[drain.PLAIN]["full_ratio"] == "1.00"
    assert [name for name, row in rows.items() if row["verdict"]] == [
        "no output",
        "one output",
        *batched,
        "group",
    ]
    # WorkManager adds its own Redis work to what Celery does for a plain task; on RabbitMQ
    # the state store sees nothing of a plain task, only the idle node's own ticks (heartbeat,
    # supervision), which every row counts and a slow machine stretches over more of them
    plain_commands = float(rows[drain.PLAIN]["commands"])
    assert all(float(rows[name]["commands"]) > plain_commands for name in workers)
    if not rig.redis_broker:
        assert plain_commands < float(rows["no output"]["commands"]) / 2, out
    figures = drain.figures(results, notes, 30, 2, 2)
    assert [row["scenario"] for row in figures["scenarios"]] == list(rows)
    assert set(figures["batched_vs_dramatiq"]) == ({"full", "window"} if batched else set())


def test_the_dramatiq_reference_holds_what_is_filled_while_paused_and_drains_it(
    own_redis: tuple[int, object], tmp_path: Path
) -> None:
    url = f"redis://127.0.0.1:{own_redis[0]}/0"
    with DramatiqNode(url, "wmtest-dq", tmp_path, 2) as node:
        node.pause()
        node.fill(40)
        time.sleep(1.5)  # an idle node polls at least once a second: it would have taken them
        assert node.left(node.queue) == 40
        side = drain.dramatiq_side(_CountingRig(url), node)
        timing = time_drain(side, 200)
        assert node.left(node.queue) == 0
        assert timing.full_rate > 0 and timing.cpu_ms > 0
        assert node.client.llen(node.aside) == 0
    assert not list(node.client.scan_iter(match="wmtest-dq-dramatiq:*"))
    # its module, imported as the node imports it, loads nothing of WorkManager
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(PLAIN_DIR)!r}); "
         "import plaindramatiq; print(sorted(m for m in sys.modules if m.split('.')[0] == 'wm'))"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert loaded.stdout.strip() == "[]"


class _CountingRig:
    """What :func:`drain.dramatiq_side` asks of a rig: the Redis command count."""

    info_calls = 1

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def redis_commands(self) -> int:
        stats = self.client.info("commandstats")
        return sum(int(v["calls"]) for v in stats.values())


@pytest.mark.slow
def test_a_drain_declared_over_has_every_message_acknowledged_on_both_sides(
    rig: Rig, tmp_path: Path
) -> None:
    # prefetch (8 per node) takes the whole queue at once: the queue is empty long before
    # the last message is done; each event's output is published before its ack
    outputs = rig.subscribe("slow.out", "outputs")
    code = f'{{"sleep_ms": {SLOW_MS}, "output_type": "{rig.name("slow.out")}"}}'.encode()
    with (
        rig.node(tmp_path, 2, [rig.queue("idle")]) as node,
        PlainNodes(rig.settings.broker_url, rig.prefix, tmp_path, 1, 2) as plain,
    ):
        slow = drain.worker_side(rig, [node.pid], "slow", "slow", code)
        # the bench's node hears the bench's broadcasts only, not a default app's
        default = make_app(rig.settings)
        assert default.control.ping(destination=[rig.node_name]) == []
        default.close()
        assert rig.control("ping") == {"ok": "pong"}
        before = rig.succeeded()
        timing = time_drain(slow, SLOW_EVENTS)
        assert rig.succeeded() - before == SLOW_EVENTS
        assert _ready(rig, outputs) == SLOW_EVENTS
        # at most two run at once: the drain took at least four sleeps
        assert timing.full_rate <= 2 / (SLOW_MS / 1000)
        reference = drain.plain_side(rig, plain, rig.name("plain"))
        before = plain.succeeded()
        time_drain(reference, 40)
        assert plain.succeeded() - before == 40
        assert _ready(rig, reference.queue) == 0
        assert _unacked(rig) == 0
    # both sides log at WARNING: no line per task (Celery's INFO has two)
    for log in (tmp_path / "node.log", tmp_path / "plain-0" / "node.log"):
        text = log.read_text()
        assert "] received" not in text and "] succeeded in " not in text, text[-2000:]


@pytest.mark.slow
def test_the_reference_is_a_process_tree_of_its_own_that_loads_nothing_of_wm(
    rig: Rig, tmp_path: Path
) -> None:
    with (
        rig.node(tmp_path, 2, [rig.queue("idle")]) as node,
        PlainNodes(rig.settings.broker_url, rig.prefix, tmp_path, 1, 2) as plain,
    ):
        assert plain.wm_modules() == []
        [root] = plain.pids
        pool = child_pids(root)
        assert len(pool) == 2  # -c 2, prefork
        wm_tree = {node.pid, *child_pids(node.pid)}
        assert not {root, *pool} & wm_tree
        assert os.getsid(root) == root != os.getsid(node.pid)
        command = Path(f"/proc/{root}/cmdline").read_bytes().split(b"\0")
        assert b"plaincelery" in command and b"--loglevel=WARNING" in command
        environ = dict(
            item.split(b"=", 1)
            for item in Path(f"/proc/{root}/environ").read_bytes().split(b"\0")
            if item
        )
        assert environ[b"PYTHONPATH"] == str(PLAIN_DIR).encode()
        # nothing else to import on its path but the other reference (Dramatiq's)
        names = {path.name for path in PLAIN_DIR.glob("*.py")}
        assert names == {"__init__.py", "plaincelery.py", "plaindramatiq.py"}
    # the probe can fail: WorkManager's own package, imported the same way, is seen
    seen = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(PLAIN_DIR)!r}); "
         "import plaincelery, wm; print(sorted(m for m in sys.modules if m == 'wm'))"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert seen.stdout.strip() == "['wm']"


def _ready(rig: Rig, queue: str) -> int:
    probe = drain.wm_probe(rig)
    if isinstance(probe, RedisProbe):
        return sum(probe.client.llen(key) for key in probe.keys(queue))
    return probe.left(queue)


def _unacked(rig: Rig) -> int:
    probe = drain.wm_probe(rig)
    if isinstance(probe, RedisProbe):
        return int(probe.client.hlen(probe.unacked))
    return 0  # AMQP counts none: the successes above are the check


@pytest.mark.slow
def test_the_round_trip_phase_times_every_side_one_event_at_a_time(
    rig: Rig, tmp_path: Path, capsys: pytest.CaptureFixture[str], engines: list[EngineWorker]
) -> None:
    header, sides = roundtrip.measure(rig, tmp_path, 15, 2, 2, engines)
    roundtrip.report(sides, header, 15, 2, 2, rig)
    out = capsys.readouterr().out
    assert "15 per side in each of 2 interleaved blocks" in out
    assert "configured like wm.deliver" in out
    assert [side.name for side in sides] == [
        "bare celery",
        "workmanager",
        "python worker",
        "native worker",
    ]
    assert [len(block) for side in sides for block in side.blocks] == [15] * 8
    assert all(0 < side.p50 <= side.p99 for side in sides)
    for name in ("workmanager", "python worker", "native worker"):
        assert re.search(rf"^{name}\s+[\d.]+ \([\d.]+ [\d.]+\)\s+[\d.]+\s+[\d.]+× \[", out, re.M)
    assert out.count("target ≤ 2×") == 1  # the target is the stub worker's
    # every answer was read: nothing is left on any reply queue
    replies = [rig.name("rt.bare.reply"), plain_queue_name(rig.name("rt.out"), "answers")]
    replies += [
        plain_queue_name(rig.name(f"rt.{e}.processed"), "answers") for e in ("python", "native")
    ]
    for queue in replies:
        assert _ready(rig, queue) == 0


def test_the_redis_done_check_reads_every_priority_list_the_transport_uses(
    pg_settings: Settings, own_redis: tuple[int, object]
) -> None:
    server = f"redis://127.0.0.1:{own_redis[0]}"
    settings = pg_settings.replace(broker_url=f"{server}/0", redis_url=f"{server}/1")
    for steps, lists in ((PRIORITY_STEPS, 4), ([0], 1)):
        with Rig(settings) as rig:
            options = dict(rig.app.conf.broker_transport_options, priority_steps=steps)
            rig.app.conf.broker_transport_options = options
            probe = drain.wm_probe(rig)
            assert isinstance(probe, RedisProbe)
            queue = rig.queue("priorities")
            assert len(probe.keys(queue)) == lists
            assert probe.left(queue) == 0 and probe.done(queue, 0, 0)
            with rig.app.producer_or_acquire() as producer:
                producer.publish({}, routing_key=queue, exchange="wm", priority=9)
            assert probe.left(queue) == 1
            assert sum(probe.client.llen(key) for key in probe.keys(queue)) == 1


def test_a_reference_task_configured_unlike_the_consumer_task_is_refused() -> None:
    registered = [
        "wm.deliver [acks_late=True reject_on_worker_lost=True serializer=json]",
        "wm.noop [acks_late=True reject_on_worker_lost=True serializer=json]",
        "wm.echo [acks_late=False serializer=json]",
    ]
    assert mismatches(task_options(registered)) == [
        "wm.echo acks_late=False, wm.deliver True",
        "wm.echo reject_on_worker_lost=None, wm.deliver True",
    ]
    assert mismatches(task_options(registered[:2])) == ["the node does not run wm.echo"]
    assert mismatches(task_options([*registered[:2], registered[1].replace("noop", "echo")])) == []
