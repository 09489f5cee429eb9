"""One priority level on a Redis broker (``WM_PRIORITY_STEPS``), and the switch from more.

kombu's Redis transport keeps one list per queue and priority level and names every list in
each BRPOP. A node reads only its levels; messages queued under other levels (kombu's
default 0,3,6,9, or an operator switching back) are moved to the levels it reads, in the
order a node reading every level would have served them.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.transport.redis import Channel as KombuChannel

from tests.conftest import AMQP_URL, BROKER_DB, REDIS_HOST, STATE_DB, flush_redis, make_settings
from tests.helpers import STUB, eventually, stub
from wm import Settings, WorkManager, make_event
from wm.dataplane import transport
from wm.dataplane.app import celery_settings, make_app
from wm.dataplane.bus import Bus, Route
from wm.dataplane.outputs import OutputPublisher, _kombu_message
from wm.dataplane.queues import DEFAULT_QUEUE, EXCHANGE, READY_LIST, subscription_queue
from wm.errors import ConfigurationError
from wm.events import encode, key_of

#: kombu's own default: four lists per queue.
KOMBU_STEPS = (0, 3, 6, 9)
SEP = KombuChannel.sep


def level_key(queue: str, level: int) -> str:
    return f"{queue}{SEP}{level}" if level else queue


def served_by_four_levels(published: list[tuple[int, Any]]) -> list[Any]:
    """The order a consumer of kombu's four levels serves (priority, body) pairs queued at
    once: level 0 (priorities 0-2) first, each level first in, first out."""
    level = {p: max(s for s in KOMBU_STEPS if s <= p) for p in range(10)}
    ordered = sorted(enumerate(published), key=lambda item: (level[item[1][0]], item[0]))
    return [body for _, (_, body) in ordered]


@pytest.fixture
def broker_settings(tmp_path: Path, redis_ok: None) -> Iterator[Settings]:
    """Settings whose broker and state databases are empty (no worker store needed)."""
    flush_redis(BROKER_DB, STATE_DB)
    yield make_settings(f"sqlite:///{tmp_path / 'wm.db'}")
    flush_redis(BROKER_DB, STATE_DB)


def publish(app: Celery, queue: str, priorities: list[int]) -> list[tuple[int, Any]]:
    """One plain message per priority to ``queue``, through ``app``'s transport options."""
    published = []
    with app.connection_for_write() as conn:
        producer = conn.Producer()
        for n, priority in enumerate(priorities):
            body = {"n": n, "priority": priority}
            producer.publish(
                body,
                exchange=EXCHANGE,
                routing_key=queue,
                declare=[subscription_queue(queue)],
                priority=priority,
            )
            published.append((priority, body))
    return published


def consume_all(app: Celery, queue: str) -> list[Any]:
    """Every message of ``queue`` in the order ``app``'s node would be served them."""
    bodies = []
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            bodies.append(json.loads(message.body))
    return bodies


# -- the setting ---------------------------------------------------------------------------


def test_one_level_by_default_and_kombus_four_on_request() -> None:
    assert Settings.from_env({}).priority_steps == (0,)
    assert Settings.from_env({"WM_PRIORITY_STEPS": "0, 3,6,9"}).priority_steps == KOMBU_STEPS


@pytest.mark.parametrize("value", ["", "3,6,9", "0,6,3", "0,3,3", "0,10", "0,-1", "zero"])
def test_levels_kombu_would_misread_are_refused(value: str) -> None:
    """A first level other than 0 would put unprioritized messages in the lowest level."""
    with pytest.raises(ConfigurationError, match=r"WM_PRIORITY_STEPS=.*expected ascending"):
        Settings.from_env({"WM_PRIORITY_STEPS": value})


def test_the_levels_reach_a_redis_broker_only() -> None:
    redis_conf = celery_settings(Settings.from_env({}))
    assert redis_conf["broker_transport_options"]["priority_steps"] == [0]
    four = Settings.from_env({"WM_PRIORITY_STEPS": "0,3,6,9"})
    assert celery_settings(four)["broker_transport_options"]["priority_steps"] == [0, 3, 6, 9]
    amqp = celery_settings(Settings.from_env({"WM_BROKER_URL": AMQP_URL}))
    assert "priority_steps" not in amqp["broker_transport_options"]


def test_publishers_and_consumers_use_the_setting(broker_settings: Settings) -> None:
    """Bus, output publisher and consumer all get their channel from the app's options."""
    for steps in [(0,), KOMBU_STEPS]:
        settings = broker_settings.replace(priority_steps=steps)
        bus = Bus(settings)
        channel = OutputPublisher(bus)._message_channel()
        assert list(channel.priority_steps) == list(steps)
        key, _ = _kombu_message(channel, encode(make_event("in", "/t", {})), "in::sub::s")
        assert key == "in::sub::s"
        with bus.app.connection_for_read() as conn:
            assert list(conn.default_channel.priority_steps) == list(steps)


# -- the switch, in-process against the broker's Redis ---------------------------------------


@pytest.mark.parametrize(("batch", "queues_per_call"), [(transport.MERGE_BATCH, 100), (7, 2)])
def test_moved_messages_are_served_in_the_order_four_levels_would_have_served_them(
    broker_settings: Settings,
    rng: random.Random,
    monkeypatch: pytest.MonkeyPatch,
    batch: int,
    queues_per_call: int,
) -> None:
    monkeypatch.setattr(transport, "MERGE_BATCH", batch)
    monkeypatch.setattr(transport, "MERGE_QUEUES_PER_CALL", queues_per_call)
    four = make_app(broker_settings.replace(priority_steps=KOMBU_STEPS))
    one = make_app(broker_settings)
    broker = redis.Redis.from_url(broker_settings.broker_url)
    queues = [f"in::q{i}" for i in range(5)]
    published = {q: publish(four, q, [rng.randrange(10) for _ in range(40)]) for q in queues}
    low = sum(p >= 3 for sent in published.values() for p, _ in sent)
    assert low and broker.exists(*(level_key(q, s) for q in queues for s in KOMBU_STEPS[1:]))

    with one.connection_for_write() as conn:
        assert conn.default_channel.merge_unread_levels(queues) == low
        assert conn.default_channel.merge_unread_levels(queues) == 0

    assert broker.keys(f"*{SEP}*") == []
    for queue in queues:
        assert consume_all(one, queue) == served_by_four_levels(published[queue])


def test_a_node_with_more_levels_moves_unread_ones_to_the_level_below(
    broker_settings: Settings,
) -> None:
    """Messages of a level a node does not read go where its publisher would put them now."""
    five = make_app(broker_settings.replace(priority_steps=(0, 5)))
    four = make_app(broker_settings.replace(priority_steps=KOMBU_STEPS))
    publish(five, "in::q", [5, 9, 0])  # lists 0 and 5
    with four.connection_for_write() as conn:
        assert conn.default_channel.merge_unread_levels(["in::q"]) == 2
    broker = redis.Redis.from_url(broker_settings.broker_url)
    assert broker.llen(level_key("in::q", 3)) == 2 and broker.llen("in::q") == 1
    assert not broker.exists(level_key("in::q", 5))


def test_a_message_held_at_a_dropped_level_is_restored_to_a_level_that_is_read(
    broker_settings: Settings,
) -> None:
    """A node of four levels took a priority-9 message and died; a single-level node
    restores it after the visibility timeout to the list it reads."""
    four = make_app(broker_settings.replace(priority_steps=KOMBU_STEPS))
    one = make_app(broker_settings.replace(visibility_timeout_s=1))
    broker = redis.Redis.from_url(broker_settings.broker_url)
    publish(four, "in::q", [9])
    assert broker.llen(level_key("in::q", 9)) == 1
    with four.connection_for_read() as holder, one.connection_for_read() as survivor:
        held = holder.default_channel.basic_get("in::q", no_ack=False)
        assert held is not None and broker.hlen("unacked") == 1

        def restored() -> bool:
            survivor.default_channel.qos.restore_visible(interval=1)
            return bool(broker.llen("in::q"))

        eventually(restored, timeout_s=10, interval_s=0.2)
        assert not broker.exists(level_key("in::q", 9)) and broker.hlen("unacked") == 0
        assert consume_all(one, "in::q") == [{"n": 0, "priority": 9}]


def test_deleting_or_purging_a_queue_takes_every_levels_list(broker_settings: Settings) -> None:
    four = make_app(broker_settings.replace(priority_steps=KOMBU_STEPS))
    bus = Bus(broker_settings)
    broker = redis.Redis.from_url(broker_settings.broker_url)
    publish(four, "in::q", [0, 4, 9])
    with bus.app.connection_for_write() as conn:
        assert subscription_queue("in::q").bind(conn.default_channel).purge() == 3
    assert broker.keys("in::q*") == []
    publish(four, "in::q", [0, 4, 9])
    bus.delete_queue("in::q")
    assert broker.keys("in::q*") == []


# -- real nodes -----------------------------------------------------------------------------


def send_at(bus: Bus, queue: str, worker_id: str, priorities: list[int]) -> list[str]:
    """One delivery per priority, sent as a publisher with ``bus``'s settings would."""
    ids = []
    for n, priority in enumerate(priorities):
        event = make_event("in", "/tests", {"n": n})
        bus.send(encode(event), [Route(queue, worker_id)], key=key_of(event), priority=priority)
        ids.append(event.get_id())
    return ids


def executions(trace: Path) -> Counter[str]:
    lines = trace.read_text().splitlines() if trace.exists() else []
    return Counter(json.loads(line)["event_id"] for line in lines)


@pytest.mark.slow
def test_a_single_level_node_runs_what_four_levels_queued_exactly_once(
    pg_settings: Settings, start_node: Any, tmp_path: Path, rng: random.Random
) -> None:
    """Queued under kombu's four levels before the node starts (moved at its start), and
    sent by a publisher still on four levels while it runs (moved by the maintaining node
    within a reconcile period): every delivery runs once."""
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    assert settings.priority_steps == (0,)
    old_publisher = Bus(settings.replace(priority_steps=KOMBU_STEPS))
    trace = tmp_path / "runs.jsonl"
    worker = WorkManager(settings).create_worker(
        code=stub(trace=str(trace)), mime_type=STUB, topic="in"
    )
    queue = f"in::{worker.id}"
    priorities = [n % 10 for n in range(40)]
    rng.shuffle(priorities)
    ids = send_at(old_publisher, queue, str(worker.id), priorities)
    broker = redis.Redis.from_url(settings.broker_url)
    queued = {s: broker.llen(level_key(queue, s)) for s in KOMBU_STEPS}
    assert queued == {0: 12, 3: 12, 6: 12, 9: 4}  # priorities 0-2, 3-5, 6-8, 9

    node = start_node(settings)
    node.consuming(queue)
    eventually(lambda: set(executions(trace)) >= set(ids), timeout_s=60)
    node.wait_for("moved 28 message(s) queued under other priority levels")
    ids += send_at(old_publisher, queue, str(worker.id), [9, 6, 3, 0] * 5)
    eventually(lambda: set(executions(trace)) >= set(ids), timeout_s=60)

    eventually(lambda: not broker.keys(f"{queue}*") and not broker.hlen("unacked"))
    runs = executions(trace)
    assert sorted(set(runs) - set(ids)) == [] and len(ids) == 60
    assert [i for i in ids if runs[i] != 1] == []


def brpop_keys(db: int, timeout_s: float = 30) -> list[str]:
    """The keys of the next BRPOP sent to broker database ``db``, as Redis's MONITOR shows
    them (bytes outside ASCII as ``\\xNN``)."""
    monitor_client = redis.Redis.from_url(f"{REDIS_HOST}/0", socket_timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    with monitor_client.monitor() as monitor:
        while time.monotonic() < deadline:
            command = monitor.next_command()
            words = command["command"].split(" ")
            if command["db"] == db and words[0].upper() == "BRPOP":
                return words[1:-1]  # the last word is the timeout
    raise AssertionError(f"no BRPOP on database {db} within {timeout_s}s")


@pytest.mark.slow
@pytest.mark.parametrize("steps", [(0,), KOMBU_STEPS], ids=["one-level", "kombu-four"])
@pytest.mark.parametrize("ready_list", [False, True], ids=["per-queue", "ready-list"])
def test_a_nodes_brpop_names_each_queue_once_per_level(
    pg_settings: Settings, start_node: Any, steps: tuple[int, ...], ready_list: bool
) -> None:
    """Without the ready list a node's BRPOP names every queue it consumes; with it, the
    ready list stands for every worker queue."""
    settings = pg_settings.replace(priority_steps=steps, ready_list=ready_list)
    manager = WorkManager(settings)
    workers = [manager.create_worker(code=stub(), mime_type=STUB, topic=f"t{i}") for i in range(12)]
    queues = [DEFAULT_QUEUE, *(f"{w.topic}::{w.id}" for w in workers)]
    node = start_node(settings)
    for queue in queues[1:]:
        node.consuming(queue)

    keys = brpop_keys(BROKER_DB)
    named = [DEFAULT_QUEUE] if ready_list else queues
    shown = [queue if not s else f"{queue}\\x06\\x16{s}" for s in steps for queue in named]
    assert Counter(keys) == Counter(shown + [READY_LIST] * ready_list)
