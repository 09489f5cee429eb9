"""Recovery (seed 000): one worker's failure is logged and skipped, ``wm recover`` runs it on
request, and a running node takes over a recovery whose leader was killed mid-way."""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from kombu import Connection
from sqlalchemy import update

from tests.cli_env import one_error_line, wm, wm_json
from tests.conftest import AMQP_URL, node_hostname
from tests.helpers import STUB, drain, eventually, stub
from wm import Settings, WorkManager, make_event, store
from wm.dataplane.app import make_app
from wm.dataplane.queues import worker_queue_name
from wm.dataplane.recovery import DONE_KEY, EPOCH_KEY, LEADER_KEY, Takeover
from wm.errors import RecoveryRunning
from wm.store.models import WorkerVersion

#: Lease of the takeover test, and what a takeover may take beyond it (a look at the lease
#: every second, the recovery itself, a loaded machine).
LEASE_S = 3
TAKEOVER_MARGIN_S = 7.0


def test_a_worker_recovery_cannot_bring_back_is_logged_and_the_others_recover(
    pg_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    manager = WorkManager(pg_settings)
    manager.create_worker(code=stub(), mime_type=STUB, topic="in", name="good")
    bad = manager.create_worker(code=stub(), mime_type=STUB, topic="in", name="bad")
    with store.session_scope(pg_settings) as session:  # a damaged code row
        session.execute(
            update(WorkerVersion).where(WorkerVersion.worker_id == bad.id).values(code=b"x")
        )
    state = redis.Redis.from_url(pg_settings.redis_url)
    state.flushdb()  # Redis lost the routing table
    with caplog.at_level(logging.ERROR, logger="wm.dataplane.recovery"):
        report = manager.recover()
    assert (report.routes_repaired, report.queues_declared, report.workers_checked) == (2, 2, 2)
    [failure] = report.failures
    assert (failure.worker_id, failure.name) == (bad.id, "bad")
    assert f"version 1 holds 1 byte(s) in the store, {bad.size} recorded" in failure.reason
    # only recovery's own errors: the log level earlier tests on this process left lets the
    # records of the workers' creation into caplog too
    [line] = [
        r.getMessage()
        for r in caplog.records
        if r.name == "wm.dataplane.recovery" and r.levelno >= logging.ERROR
    ]
    assert line.startswith(f"recovery: worker 'bad' ({bad.id}): its code cannot be loaded")
    assert state.hlen("wm:topic:{in}:routes") == 2
    assert state.get(DONE_KEY) and not state.exists(LEADER_KEY)


def test_a_queue_the_broker_refuses_fails_its_worker_alone(amqp_settings: Settings) -> None:
    """Recovery declares every queue on one connection; RabbitMQ closes the channel of a
    declaration it refuses (a queue that exists with other arguments), and the queues after
    it are still declared, on a new channel."""
    manager = WorkManager(amqp_settings)
    run = uuid.uuid4().hex[:8]  # the vhost outlives the test
    refused = manager.create_worker(code=stub(), mime_type=STUB, topic=f"a{run}", name="a")
    other = manager.create_worker(code=stub(), mime_type=STUB, topic=f"b{run}", name="b")
    queues = [worker_queue_name(f"a{run}", refused.id), worker_queue_name(f"b{run}", other.id)]
    assert sorted(queues) == queues  # declared in this order: the refused one first
    with Connection(AMQP_URL) as conn:
        channel = conn.channel()
        for queue in queues:
            channel.queue_delete(queue)
        channel.queue_declare(queues[0], durable=True, arguments={"x-max-length": 5})
    try:
        report = manager.recover()
        [failure] = report.failures
        assert failure.worker_id == refused.id
        assert "its queue could not be declared: ConfigurationError" in failure.reason
        assert report.queues_declared == 1
        with Connection(AMQP_URL) as conn:  # passive: raises if it was not declared
            conn.channel().queue_declare(queues[1], passive=True)
    finally:
        with Connection(AMQP_URL) as conn:
            for queue in queues:
                conn.channel().queue_delete(queue)


def _mailbox(settings: Settings, name: str) -> tuple[str, Any]:
    """A node's Celery name and its mailbox queue (exclusive to the node's connection)."""
    hostname = node_hostname(name)
    return hostname, make_app(settings).control.mailbox.get_queue(hostname)


def test_a_node_started_while_the_broker_holds_its_name_waits_then_serves(
    pg_settings: Settings, start_node: Any
) -> None:
    """A node replaced under its name before the broker let go of the old one's connection
    (a host lost without a word) finds its mailbox locked (405 RESOURCE_LOCKED): it tries again
    until the broker lets go, then serves, rather than exit. Every setting at its default but
    the broker."""
    settings = pg_settings.replace(broker_url=AMQP_URL)
    manager = WorkManager(settings)
    run = uuid.uuid4().hex[:8]
    sink = manager.subscribe(f"done{run}", "sink")
    manager.create_worker(code=stub(output_type=f"done{run}"), mime_type=STUB, topic=f"in{run}")
    hostname, mailbox = _mailbox(settings, "n0")
    with Connection(AMQP_URL) as old:  # the connection of the node it replaces
        mailbox.bind(old.channel()).declare()
        node = start_node(settings, name="n0", hostname=hostname, ready=False)
        locked = "RESOURCE_LOCKED"
        node.wait_for(locked)
        eventually(lambda: node.log.read_text(errors="replace").count(locked) >= 3)
        assert node.proc.poll() is None, node.tail()
    node.wait_for("ready.")
    manager.publish(make_event(f"in{run}", "/tests", {"n": 1}))
    assert len(drain(settings, sink, 1)) == 1


def test_a_node_whose_mailbox_is_declared_otherwise_exits_naming_it(
    pg_settings: Settings, start_node: Any
) -> None:
    """A channel error that no waiting mends (406 PRECONDITION_FAILED: an exchange the node
    declares exists as another type) still ends the node, with the broker's words. The test's
    own deployment: the exchange of mailboxes is the deployment's."""
    settings = pg_settings.replace(broker_url=AMQP_URL, deployment=f"t{uuid.uuid4().hex[:8]}")
    hostname, mailbox = _mailbox(settings, "n0")
    with Connection(AMQP_URL) as conn:
        conn.channel().exchange_declare(mailbox.exchange.name, "direct", auto_delete=True)
        try:
            node = start_node(settings, name="n0", hostname=hostname, ready=False)
            node.proc.wait(timeout=60)
            log = node.tail(200)
            assert "Unrecoverable error: PreconditionFailed" in log, log
            assert f"exchange '{mailbox.exchange.name}'" in log, log
        finally:
            conn.channel().exchange_delete(mailbox.exchange.name)


def test_recover_is_refused_while_another_holds_the_lease(pg_settings: Settings) -> None:
    redis.Redis.from_url(pg_settings.redis_url).set(LEADER_KEY, "celery@elsewhere/t0", ex=60)
    with pytest.raises(RecoveryRunning, match=r"celery@elsewhere, lease \d+ s left"):
        WorkManager(pg_settings).recover()


def test_wm_recover_prints_what_it_did(env: dict[str, str]) -> None:
    manager = WorkManager(Settings.from_env(env))
    manager.create_worker(code=stub(), mime_type=STUB, topic="in", name="w")
    store.dispose_engines()
    found = wm_json(env, "recover")
    assert (found["queues_declared"], found["workers_checked"], found["failures"]) == (1, 1, [])
    assert re.search(r"queues declared:\s+1\n", wm(env, "recover").out)
    redis.Redis.from_url(env["WM_REDIS_URL"]).set(LEADER_KEY, "celery@n/t", ex=60)
    refused = wm(env, "recover", expect=1)
    assert "a recovery is running (celery@n" in one_error_line(refused)


def test_a_watching_node_takes_over_only_a_recovery_left_unfinished(pg_settings: Settings) -> None:
    state = redis.Redis.from_url(pg_settings.redis_url)
    heard: list[str] = []
    watch = Takeover(pg_settings, make_app(pg_settings), "w@t", lambda s, _: heard.append(s))
    state.set(EPOCH_KEY, 7)
    state.set(LEADER_KEY, "celery@a/5/x")
    watch.turn()
    state.delete(LEADER_KEY)
    state.set(DONE_KEY, "celery@b/6/y")  # a later recovery completed
    watch.turn()
    assert heard == []
    state.set(LEADER_KEY, "celery@c/7/z")
    watch.turn()
    state.delete(LEADER_KEY)  # its holder died: done is still at 6
    watch.turn()
    assert heard == ["running", "done"]
    assert (state.get(DONE_KEY) or b"").startswith(b"w@t/8/")


@pytest.mark.slow
def test_a_running_node_takes_over_when_the_leader_dies_mid_recovery(
    pg_settings: Settings, start_node: Any
) -> None:
    """The leader is held mid-recovery by a lock on the subscriptions table, then killed
    (-9): the node already running finishes its recovery once the lease lapses."""
    settings = pg_settings.replace(worker_recovery_lease_ttl_seconds=LEASE_S)
    WorkManager(settings).create_worker(code=stub(), mime_type=STUB, topic="in")
    other = start_node(settings, "other")  # leads its own start, then watches
    engine = sa.create_engine(settings.database_url)
    with engine.connect() as conn:
        conn.execute(sa.text("LOCK TABLE subscriptions IN ACCESS EXCLUSIVE MODE"))
        leader = start_node(settings, "leader", ready=False)
        leader.wait_for("recovery: leader@")
        leader.kill()
        killed = time.monotonic()
        conn.rollback()
    engine.dispose()
    other.wait_for("takes over", timeout_s=LEASE_S + TAKEOVER_MARGIN_S)
    other.wait_for("recovery done", after=other.log.read_text().index("takes over"))
    took_s = time.monotonic() - killed
    assert took_s < LEASE_S + TAKEOVER_MARGIN_S, took_s
    done = redis.Redis.from_url(settings.redis_url).get(DONE_KEY)
    assert done is not None and done.decode().startswith("other@")
