"""The bench's drain and round-trip phases on a real node, on Redis and on RabbitMQ: every
scenario timed and counted, the end of a drain exact, the bench's names its own and gone
afterwards (small numbers: this checks the tool, not the speed)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from amqp.exceptions import NotFound
from kombu.connection import Connection
from kombu.transport.redis import PRIORITY_STEPS

from tests.conftest import AMQP_URL, need
from wm import Settings
from wm.bench import drain, roundtrip
from wm.bench.rig import PYTHON_ANSWER, EngineWorker, Rig, mismatches, task_options
from wm.dataplane.app import make_app
from wm.dataplane.queues import plain_queue_name

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
    """Nothing the bench made is left on RabbitMQ (a Redis of the test's own goes anyway)."""
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


@pytest.mark.slow
def test_the_drain_phase_times_every_scenario_and_counts_redis_commands(
    rig: Rig, tmp_path: Path, capsys: pytest.CaptureFixture[str], engines: list[EngineWorker]
) -> None:
    header, results = drain.measure(rig, tmp_path, 30, 2, 2, engines)
    drain.report(results, header, 30, 2, 2, rig)
    out = capsys.readouterr().out
    broker = "Redis" if rig.redis_broker else "RabbitMQ"
    assert f"Drain on {broker}: 30 queued events per scenario, 2 repetitions" in out
    assert "task events off" in out
    assert "prefork:TaskPool, 2 processes, prefetch 8" in out
    assert "wm.noop, wm.echo configured like wm.deliver (acks_late=True" in out
    rows = {
        match["name"].strip(): (float(match["rate"]), float(match["commands"]))
        for match in re.finditer(
            r"^(?P<name>[a-z ]+?)\s+(?P<rate>\d+) \(\d+ \d+\)\s+[\d.]+× \[[\d.–]+\]\s+"
            r"(?P<commands>[\d.]+)",
            out,
            flags=re.MULTILINE,
        )
    }
    workers = {"no group", "group", "one output", "python worker", "native worker"}
    assert set(rows) == {"bare celery", *workers}, out
    assert all(rate > 0 for rate, _ in rows.values())
    # WorkManager adds its own Redis work to what Celery does for a bare task; on RabbitMQ
    # the state store sees nothing of a bare task
    bare_commands = rows["bare celery"][1]
    assert all(rows[name][1] > bare_commands for name in workers)
    if not rig.redis_broker:
        assert bare_commands < 1, out


@pytest.mark.slow
def test_a_drain_ends_when_the_last_message_is_acknowledged_not_when_the_queue_is_empty(
    rig: Rig, tmp_path: Path
) -> None:
    # the node prefetches all eight at once: the queue is empty long before they are done;
    # each event's output is published before its message is acknowledged
    outputs = rig.subscribe("slow.out", "outputs")
    code = f'{{"sleep_ms": {SLOW_MS}, "output_type": "{rig.name("slow.out")}"}}'.encode()
    scenario = drain.worker_scenario(rig, "slow", "slow", code)
    probe = drain.probe_for(rig)
    with rig.node(tmp_path, 2, [rig.queue("idle")]):
        # the bench's node hears the bench's broadcasts only, not a default app's
        default = make_app(rig.settings)
        assert default.control.ping(destination=[rig.node_name]) == []
        default.close()
        assert rig.control("ping") == {"ok": "pong"}
        drain.time_drain(rig, probe, scenario, SLOW_EVENTS)
        assert _ready(probe, outputs) == SLOW_EVENTS


def _ready(probe: drain.Probe, queue: str) -> int:
    if isinstance(probe, drain.RedisProbe):
        return sum(probe.client.llen(key) for key in probe.keys(queue))
    return probe.ready(queue)


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
    probe = drain.probe_for(rig)
    replies = [rig.name("rt.bare.reply"), plain_queue_name(rig.name("rt.out"), "answers")]
    replies += [
        plain_queue_name(rig.name(f"rt.{e}.processed"), "answers") for e in ("python", "native")
    ]
    for queue in replies:
        assert _ready(probe, queue) == 0


def test_the_redis_done_check_reads_every_priority_list_the_transport_uses(
    pg_settings: Settings, own_redis: tuple[int, object]
) -> None:
    server = f"redis://127.0.0.1:{own_redis[0]}"
    settings = pg_settings.replace(broker_url=f"{server}/0", redis_url=f"{server}/1")
    for steps, lists in ((PRIORITY_STEPS, 4), ([0], 1)):
        with Rig(settings) as rig:
            options = dict(rig.app.conf.broker_transport_options, priority_steps=steps)
            rig.app.conf.broker_transport_options = options
            probe = drain.probe_for(rig)
            assert isinstance(probe, drain.RedisProbe)
            queue = rig.queue("priorities")
            assert len(probe.keys(queue)) == lists
            assert probe.done(queue, 0)
            with rig.app.producer_or_acquire() as producer:
                producer.publish({}, routing_key=queue, exchange="wm", priority=9)
            assert probe.done(queue, 1) is False
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
