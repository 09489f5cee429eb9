"""Two deployments on one Redis server (different database numbers) and on one RabbitMQ
vhost never meet: a stop in one is not held up by the other's processes, and a node never
consumes the other deployment's queues (issue 25, finding 9). Every setting of deployment B
is at its default but its URLs: nobody set a deployment name."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    AMQP_URL,
    CLI_BROKER_DB,
    CLI_STATE_DB,
    REDIS_HOST,
    STATE_DB,
    flush_redis,
)
from tests.helpers import STUB, drain, stub
from wm import Settings, WorkManager, make_event, store
from wm.config import ConfigurationError, deployment_name

#: Seconds a stop of an idle worker may take: the stop asks every listening process once
#: (answers within milliseconds); before the fix it waited out the 30 s grace period.
IDLE_STOP_S = 10.0


@pytest.fixture
def other(tmp_path: Path, redis_ok: None) -> Iterator[Settings]:
    """Deployment B: its own SQLite store and its own Redis databases (the CLI tests', free
    while this test runs) on the same Redis server as the tests' deployment A."""
    flush_redis(CLI_BROKER_DB, CLI_STATE_DB)
    settings = Settings.from_env({}).replace(
        database_url=f"sqlite:///{tmp_path / 'other.db'}",
        broker_url=f"{REDIS_HOST}/{CLI_BROKER_DB}",
        redis_url=f"{REDIS_HOST}/{CLI_STATE_DB}",
    )
    store.upgrade(settings)
    yield settings
    store.dispose_engines()
    flush_redis(CLI_BROKER_DB, CLI_STATE_DB)


def test_the_deployment_is_the_state_redis_database_unless_named() -> None:
    defaults = Settings.from_env({})
    assert deployment_name(defaults) == "db1"
    assert deployment_name(defaults.replace(redis_url="redis://h:6379/7")) == "db7"
    assert deployment_name(defaults.replace(redis_url="redis://h:6379")) == "db0"
    assert deployment_name(defaults.replace(redis_url="unix:///run/redis.sock?db=3")) == "db3"
    assert deployment_name(Settings.from_env({"WM_DEPLOYMENT": "orders-prod"})) == "orders-prod"
    with pytest.raises(ConfigurationError, match="WM_DEPLOYMENT='a b'"):
        Settings.from_env({"WM_DEPLOYMENT": "a b"})


@pytest.mark.slow
def test_stopping_an_idle_worker_is_not_held_up_by_another_deployment(
    pg_settings: Settings, other: Settings, start_node: Any
) -> None:
    mine, theirs = WorkManager(pg_settings), WorkManager(other)
    node = start_node(pg_settings, "mine")
    other_node = start_node(other, "theirs")
    busy = theirs.create_worker(code=stub(output_type="b.done"), mime_type=STUB, topic="b.in")
    other_node.consuming(f"b.in::{busy.id}")
    sink = theirs.subscribe("b.done", "sink")
    for n in range(10):  # B's processes run deliveries, so each listens for engine commands
        theirs.publish(make_event("b.in", "/tests", {"n": n}))
    assert len(drain(other, sink, 10)) == 10
    idle = mine.create_worker(code=stub(output_type="a.done"), mime_type=STUB, topic="a.in")
    node.consuming(f"a.in::{idle.id}")

    began = time.monotonic()
    stopped = mine.stop_worker(idle.id)
    took = time.monotonic() - began
    assert (stopped.status, took < IDLE_STOP_S) == ("stopped", True), took
    # and the other way round, while deployment A's node listens
    assert theirs.stop_worker(busy.id).status == "stopped"


@pytest.fixture(params=["one Redis server", "two Redis servers"])
def other_on_vhost(
    request: pytest.FixtureRequest, other: Settings, amqp_settings: Settings
) -> Settings:
    """Deployment B on the RabbitMQ vhost of deployment A (``amqp_settings``). Its state store
    is another database of A's Redis server, or on a Redis server of its own the database of
    A's number: then both have the same default deployment name, hear each other's
    broadcasts, and only the check of each queue against the node's store keeps them apart."""
    settings = other.replace(broker_url=AMQP_URL)
    if request.param == "two Redis servers":
        port, _ = request.getfixturevalue("own_redis")
        settings = settings.replace(redis_url=f"redis://127.0.0.1:{port}/{STATE_DB}")
        assert deployment_name(settings) == deployment_name(amqp_settings)
    return settings


@pytest.mark.slow
def test_a_node_never_consumes_another_deployments_queue_on_one_vhost(
    amqp_settings: Settings, other_on_vhost: Settings, start_node: Any
) -> None:
    mine, theirs = WorkManager(amqp_settings), WorkManager(other_on_vhost)
    sink = mine.subscribe("dep.a.done", "sink")
    node = start_node(amqp_settings, "mine")
    other_node = start_node(other_on_vhost, "theirs")
    worker = mine.create_worker(code=stub(output_type="dep.a.done"), mime_type=STUB, topic="dep.a")
    queue = f"dep.a::{worker.id}"
    node.consuming(queue)
    count = 40
    for n in range(count):
        mine.publish(make_event("dep.a", "/tests", {"n": n}))

    assert len(drain(amqp_settings, sink, count)) == count
    assert mine.dead_letters.count() == 0
    assert theirs.dead_letters.count() == 0
    log = other_node.log.read_text(errors="replace")
    assert f"Started consuming from {queue}" not in log
    heard = deployment_name(other_on_vhost) == deployment_name(amqp_settings)
    assert (f"leaving queue {queue} alone" in log) == heard
    mine.delete_worker(worker.id)
    mine.unsubscribe("dep.a.done", "sink")
