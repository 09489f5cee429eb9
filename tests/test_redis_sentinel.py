"""The state store through Redis Sentinel: a primary, a replica and three sentinels started
by this test; kill -9 of the primary under writes.

What is checked is the client the state store uses (:func:`wm.state.connection.redis_for`
on a ``sentinel://`` WM_REDIS_URL): it follows the primary the sentinels elect, and every
write the replica had acknowledged (``WAIT 1``) before the kill is on the new primary. A
node follows the new primary. And with WM_BROKER_WAIT_REPLICAS, on a primary and its replica
alone: a publish returns once the replica has it, and what was confirmed survives the
primary's loss.
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import BROKER_DB, FIGURE, flush_redis, make_settings
from tests.helpers import STUB, free_port, stub
from wm import ConfigurationError, Settings, WorkManager, store
from wm.config import deployment_name, masked
from wm.dataplane.app import broker_connection, celery_settings
from wm.dataplane.queues import worker_queue_name
from wm.errors import BrokerUnavailable
from wm.events import make_event
from wm.local.embedded import find_redis_server
from wm.sentinelurl import kombu_url, parse
from wm.state.connection import redis_for
from wm.state.unawaited import Unawaited

#: The name the sentinels know the primary by.
MASTER = "wm"
SENTINELS = 3
#: Upper bound on a server answering, a replica in sync, a failover (s).
START_TIMEOUT_S = 20.0
FAILOVER_TIMEOUT_S = 30.0
#: Writes before the kill, and after it (no replica is left to acknowledge these).
WRITES = 300
WRITES_AFTER = 20
#: ms a WAIT gives the replica to acknowledge a write.
WAIT_MS = 2000


@dataclass
class Group:
    primary: int
    replica: int
    sentinels: list[int]
    processes: dict[int, subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        return self.url_of(1)

    def url_of(self, db: int) -> str:
        hosts = ";".join(f"sentinel://127.0.0.1:{port}" for port in self.sentinels)
        return f"{hosts}/{db}?master_name={MASTER}"

    def elected(self) -> int:
        """The primary's port, as the first sentinel names it."""
        sentinel = redis.Redis(port=self.sentinels[0], socket_timeout=2)
        _host, port = sentinel.sentinel_get_master_addr_by_name(MASTER)
        return int(port)


def _replica_caught_up(group: Group) -> None:
    """Until the replica has everything the primary has written so far. Replication is
    asynchronous and, at the default WM_BROKER_WAIT_REPLICAS=0, a publish to the broker is
    not waited for: what the primary confirmed in the last moments before its death is lost
    (one CI run lost the event published just before the kill; the setting's own tests are
    below). The guarantee tested is the guide's: nothing the replica acknowledged is lost,
    while the node's own writes go on as the primary dies."""
    primary, replica = redis.Redis(port=group.primary), redis.Redis(port=group.replica)
    wanted = int(primary.info("replication")["master_repl_offset"])
    _until(
        "the replica caught up with the primary",
        lambda: int(replica.info("replication")["slave_repl_offset"]) >= wanted,
        10.0,
    )


def _until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{what} within {timeout_s:g} s")


def _server(binary: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [binary, *args, "--logfile", str(log)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Group]:
    """A primary and its replica, in sync; no sentinels."""
    processes: dict[int, subprocess.Popen[bytes]] = {}
    try:
        yield _primary_and_replica(tmp_path, processes)
    finally:
        _stop(processes)


def _primary_and_replica(tmp_path: Path, processes: dict[int, subprocess.Popen[bytes]]) -> Group:
    primary, replica = free_port(), free_port()
    processes[primary] = _redis(tmp_path, primary)
    processes[replica] = _redis(tmp_path, replica, primary)
    _until("the replica in sync", lambda: _linked(replica), START_TIMEOUT_S)
    return Group(primary, replica, [], processes)


def _redis(tmp_path: Path, port: int, primary: int | None = None) -> subprocess.Popen[bytes]:
    """A Redis server on ``port``, keeping nothing on disk; a replica of ``primary``."""
    args = ["--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"]
    args += ["--dir", str(tmp_path)]
    if primary is not None:
        args += ["--replicaof", "127.0.0.1", str(primary)]
    return _server(str(find_redis_server()), args, tmp_path / f"redis-{port}.log")


def _stop(processes: dict[int, subprocess.Popen[bytes]]) -> None:
    for process in processes.values():
        process.send_signal(signal.SIGCONT)  # a test may have stopped it
        process.kill()
        process.wait()


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    """A primary and its replica, and the sentinels watching them."""
    processes: dict[int, subprocess.Popen[bytes]] = {}
    try:
        made = _primary_and_replica(tmp_path, processes)
        _add_sentinels(tmp_path, made)
        yield made
    finally:
        _stop(processes)


def _add_sentinels(tmp_path: Path, made: Group) -> None:
    binary = str(find_redis_server())
    for index in range(SENTINELS):
        port = free_port()
        conf = tmp_path / f"sentinel-{index}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {made.primary} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 3000\n"
        )
        made.processes[port] = _server(
            binary, [str(conf), "--sentinel"], tmp_path / f"sentinel-{index}.log"
        )
        made.sentinels.append(port)
    for port in made.sentinels:
        _until(
            "every sentinel to see the replica", lambda p=port: _sees_replica(p), START_TIMEOUT_S
        )


def _linked(port: int) -> bool:
    info = redis.Redis(port=port, socket_timeout=2).info("replication")
    return bool(info.get("master_link_status") == "up")


def _sees_replica(port: int) -> bool:
    sentinel = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
    return (
        len(sentinel.sentinel_slaves(MASTER)) == 1 and len(sentinel.sentinel_sentinels(MASTER)) == 2
    )


def _write(client: redis.Redis, key: str, wait: bool = True) -> bool:
    """Write ``key``; whether the replica acknowledged it (``wait``). Retries until the store
    takes it (the primary down, or no primary yet), failing after FAILOVER_TIMEOUT_S."""
    deadline = time.monotonic() + FAILOVER_TIMEOUT_S
    while True:
        try:
            client.set(key, "1")
            return not wait or int(client.execute_command("WAIT", 1, WAIT_MS)) >= 1
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.timeout(120)
def test_the_state_store_follows_the_primary_the_sentinels_elect(
    group: Group, record_property: Callable[[str, object], None]
) -> None:
    client = redis_for(Settings(redis_url=group.url))
    assert isinstance(client, redis.Redis)
    acknowledged = [key for key in _keys(0, WRITES) if _write(client, key)]
    group.processes[group.primary].kill()  # SIGKILL
    killed_at = time.monotonic()
    _write(client, "sentinel-test:first-after", wait=False)
    paused_s = time.monotonic() - killed_at
    for key in _keys(WRITES, WRITES + WRITES_AFTER):
        _write(client, key, wait=False)
    assert group.elected() == group.replica
    new_primary = redis.Redis(port=group.replica, db=1)
    lost = [key for key in acknowledged if not new_primary.exists(key)]
    record_property(
        FIGURE,
        f"sentinel failover, state store: acknowledged {len(acknowledged)} of {WRITES} "
        f"before the kill, lost {len(lost)}; writes paused {paused_s:.1f} s by the failover",
    )
    assert not lost
    assert len(acknowledged) == WRITES  # the replica was in sync: every WAIT answered 1
    assert all(new_primary.exists(key) for key in _keys(WRITES, WRITES + WRITES_AFTER))


@pytest.mark.timeout(120)
def test_a_write_nobody_waits_for_goes_to_the_primary_the_sentinels_elect(group: Group) -> None:
    """``wm.state.unawaited``'s connection asks the sentinels for the primary, as the pool's
    connections do: before the primary's loss, and after it on a new connection."""
    client = redis_for(Settings(redis_url=group.url))
    assert isinstance(client, redis.Redis)
    later = Unawaited()
    later.send(client, ("SET", "unawaited:before", "1"), "the first write")
    later.settle()
    assert redis.Redis(port=group.primary, db=1).get("unawaited:before") == b"1"
    group.processes[group.primary].kill()  # SIGKILL
    deadline = time.monotonic() + FAILOVER_TIMEOUT_S
    while True:  # no primary until the sentinels elect one
        try:
            later.send(client, ("SET", "unawaited:after", "1"), "the second write")
            later.settle()
            if redis.Redis(port=group.replica, db=1).get("unawaited:after") == b"1":
                break
        except (redis.ConnectionError, redis.TimeoutError):
            pass
        assert time.monotonic() < deadline, "no write reached the new primary"
        time.sleep(0.1)
    assert group.elected() == group.replica


def _keys(start: int, stop: int) -> list[str]:
    return [f"sentinel-test:{n}" for n in range(start, stop)]


#: Events of the end-to-end test, half before the kill and half after.
EVENTS = 60


@pytest.mark.timeout(180)
@pytest.mark.parametrize("broker", ["redis", "sentinel"])
def test_a_node_follows_the_new_primary_and_delivers_every_event(
    group: Group,
    tmp_path: Path,
    redis_ok: None,
    start_node: Callable[..., Any],
    broker: str,
    record_property: Callable[[str, object], None],
) -> None:
    """The primary killed while a node delivers: the node stays up, and every event gets its
    output (at least once: an outcome or a message the replica had not received when the
    primary died is recorded or sent again). The state store is on the Sentinel group; the
    broker on the suite's Redis, or on the same group."""
    flush_redis(BROKER_DB)
    settings = make_settings(
        f"sqlite:///{tmp_path / 'wm.db'}", redis_url=group.url, reconcile_interval_s=1.0
    )
    if broker == "sentinel":
        settings = settings.replace(broker_url=group.url_of(0))
    figure = _deliver_through_a_failover(
        group, settings, start_node, before_kill=lambda: _replica_caught_up(group)
    )
    record_property(FIGURE, f"sentinel failover, broker {broker}: {figure}")
    assert group.elected() == group.replica
    store.dispose_engines()


def _deliver_through_a_failover(
    group: Group,
    settings: Settings,
    start_node: Callable[..., Any],
    *,
    before_kill: Callable[[], object] = lambda: None,
    after_kill: Callable[[], object] = lambda: None,
) -> str:
    """A node delivers EVENTS events, one output each; the primary is killed (SIGKILL) when
    half of them are published, between ``before_kill`` and ``after_kill``. Asserts every
    event got its output (at least once) and the node never exited; returns the figure."""
    store.upgrade(settings)
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    node = start_node(settings)
    node.consuming(f"in::{worker.id}")
    for n in range(EVENTS):
        if n == EVENTS // 2:
            before_kill()
            group.processes[group.primary].kill()
            killed_at = time.monotonic()
            after_kill()
        _publish(manager, n)
    seen: list[int] = []
    deadline = time.monotonic() + FAILOVER_TIMEOUT_S + 30
    while set(seen) != set(range(EVENTS)) and time.monotonic() < deadline:
        seen += _drain(settings, sink)
    figure = (
        f"lost {EVENTS - len(set(seen))} of {EVENTS}, duplicated {len(seen) - len(set(seen))}; "
        f"all delivered {time.monotonic() - killed_at:.1f} s after the kill"
    )
    assert sorted(set(seen)) == list(range(EVENTS)), figure
    assert node.proc.poll() is None  # the node did not exit
    return figure


def _drain(settings: Settings, queue: str) -> list[int]:
    """The ``n`` of each output waiting in ``queue`` (for 2 s at most), whatever the broker;
    nothing while the broker has no primary."""
    found: list[int] = []
    try:
        with broker_connection(settings) as conn:
            simple = conn.SimpleQueue(queue)
            while True:
                try:
                    message = simple.get(timeout=2)
                except simple.Empty:
                    return found
                found.append(json.loads(message.body)["data"]["input"]["n"])
                message.ack()
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        time.sleep(0.2)
        return found


def _publish(manager: WorkManager, n: int) -> None:
    """Publish event n, again while the state store has no primary (its routes live there)."""
    deadline = time.monotonic() + FAILOVER_TIMEOUT_S
    while True:
        try:
            manager.publish(make_event("in", "/tests", {"n": n}))
            return
        except BrokerUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# -- WM_BROKER_WAIT_REPLICAS: a publish returns once the broker's replica has it -----------

WAITED = (
    r"reached 0 replica\(s\) of the broker within WM_REDIS_WAIT_TIMEOUT_MS=500, "
    "not WM_BROKER_WAIT_REPLICAS=1"
)


def _waiting_on(pair: Group, tmp_path: Path) -> Settings:
    """Settings whose broker is ``pair``'s primary, each publish waited for by its replica;
    the state store on the suite's Redis; every other setting at its default."""
    settings = make_settings(
        f"sqlite:///{tmp_path / 'wm.db'}",
        broker_url=f"redis://127.0.0.1:{pair.primary}/0",
        broker_wait_replicas=1,
    )
    store.upgrade(settings)
    return settings


@pytest.mark.timeout(120)
def test_a_publish_returns_once_the_brokers_replica_has_it_and_fails_without_it(
    pair: Group, tmp_path: Path, redis_ok: None, start_node: Callable[..., Any]
) -> None:
    settings = _waiting_on(pair, tmp_path)
    manager = WorkManager(settings)
    sink = manager.subscribe("final", "sink")  # a plain queue: kombu's LPUSH
    first = manager.create_worker(code=stub(output_type="middle"), mime_type=STUB, topic="in")
    second = manager.create_worker(code=stub(output_type="final"), mime_type=STUB, topic="middle")
    queue = worker_queue_name("in", str(first.id))  # a worker queue: the ready list's script
    replica = redis.Redis(port=pair.replica)
    manager.publish(make_event("in", "/t", {"n": 0}))
    manager.publish(make_event("final", "/t", {"n": 1}))
    manager.publish_many([make_event("final", "/t", {"n": n}) for n in (2, 3)])
    assert (replica.llen(queue), replica.llen(sink)) == (1, 3)  # there when publish returned

    stopped = pair.processes[pair.replica]
    stopped.send_signal(signal.SIGSTOP)  # the replica acknowledges nothing
    try:
        for publish in (
            lambda: manager.publish(make_event("in", "/t", {"n": 4})),
            lambda: manager.publish(make_event("final", "/t", {"n": 5})),
            lambda: manager.publish_many([make_event("final", "/t", {"n": 6})]),
        ):
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable, match=WAITED):
                publish()
            assert time.monotonic() - started >= 0.45  # it waited for the replica
    finally:
        stopped.send_signal(signal.SIGCONT)

    # A node under the setting: its output to the second worker is waited for as well.
    # (The refused publishes' messages are on the primary: delivered or not, as a publish
    # whose reply was lost; an event published again is delivered once, by its id.)
    node = start_node(settings)
    node.consuming(f"middle::{second.id}")
    found = _drain_data(settings, sink, lambda seen: {0, 1, 2, 3, 5, 6} <= _numbers(seen))
    assert {0, 1, 2, 3, 5, 6} <= _numbers(found) <= {0, 1, 2, 3, 4, 5, 6}


@pytest.mark.timeout(180)
def test_a_failover_under_waited_publishes_loses_no_confirmed_event(
    group: Group,
    tmp_path: Path,
    redis_ok: None,
    start_node: Callable[..., Any],
    record_property: Callable[[str, object], None],
) -> None:
    """The broker on the Sentinel group with WM_BROKER_WAIT_REPLICAS=1 (the state store on
    the suite's Redis): the primary is killed right after a confirmed publish, with no wait
    for the replica to catch up. The replica is elected; until the old primary rejoins as
    its replica no publish is confirmed (the publisher retries, the node requeues); then
    every event gets its output and the node never exited. (That nothing confirmed is lost
    whatever the timing is shown by the test of a publish refused while the replica is cut
    off, below: here replication is usually quicker than the kill.)"""
    flush_redis(BROKER_DB)
    settings = make_settings(
        f"sqlite:///{tmp_path / 'wm.db'}",
        broker_url=group.url_of(0),
        broker_wait_replicas=1,
        reconcile_interval_s=1.0,
    )

    def old_primary_rejoins() -> None:  # right after a confirmed publish's kill
        _until("the replica elected", lambda: group.elected() == group.replica, 30)
        group.processes[group.primary].wait()
        group.processes[group.primary] = _redis(tmp_path, group.primary, group.replica)

    figure = _deliver_through_a_failover(
        group, settings, start_node, after_kill=old_primary_rejoins
    )
    record_property(FIGURE, f"sentinel failover, publishes waited for: {figure}")


def _data_of(raw: bytes) -> Any:
    """The event data of a kombu message as kombu's Redis transport keeps it in a list."""
    message = json.loads(raw)
    assert message["properties"]["body_encoding"] == "base64"
    return json.loads(base64.b64decode(message["body"]))["data"]


def _numbers(found: list[Any]) -> set[int]:
    """The ``n`` of each event's data: its own, or, for an output of the two workers, its
    cause's."""
    return {data["n"] if "n" in data else data["input"]["input"]["n"] for data in found}


def _drain_data(settings: Settings, queue: str, enough: Callable[[list[Any]], bool]) -> list[Any]:
    """The data of the events in ``queue`` until they are ``enough``, for 30 s at most."""
    found: list[Any] = []
    deadline = time.monotonic() + 30
    with broker_connection(settings) as conn:
        simple = conn.SimpleQueue(queue)
        while not enough(found) and time.monotonic() < deadline:
            try:
                message = simple.get(timeout=1)
            except simple.Empty:
                continue
            found.append(json.loads(message.body)["data"])
            message.ack()
    return found


@pytest.mark.timeout(60)
def test_every_publish_the_broker_confirmed_survives_the_loss_of_its_primary(
    pair: Group, tmp_path: Path, redis_ok: None
) -> None:
    """The replica cut off, a publish is refused, not confirmed: then the primary dies and
    the replica takes its place with every event that was confirmed. Without the setting,
    that publish returned and its event died with the primary."""
    manager = WorkManager(_waiting_on(pair, tmp_path))
    sink = manager.subscribe("t", "sink")
    confirmed = []
    for n in range(10):
        manager.publish(make_event("t", "/t", {"n": n}))
        confirmed.append(n)
    # stopped, the replica cannot connect again: what the primary writes now stays there
    pair.processes[pair.replica].send_signal(signal.SIGSTOP)
    redis.Redis(port=pair.primary).client_kill_filter(_type="replica")
    try:
        manager.publish(make_event("t", "/t", {"n": 10}))
        confirmed.append(10)
    except BrokerUnavailable:
        pass
    pair.processes[pair.primary].kill()  # SIGKILL: what the replica lacks is gone
    pair.processes[pair.primary].wait()
    pair.processes[pair.replica].send_signal(signal.SIGCONT)
    promoted = redis.Redis(port=pair.replica)
    promoted.execute_command("REPLICAOF", "NO", "ONE")
    kept = {_data_of(raw)["n"] for raw in promoted.lrange(sink, 0, -1)}
    assert set(confirmed) <= kept, f"confirmed {confirmed}, on the new primary {sorted(kept)}"
    assert confirmed == list(range(10))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sentinel://127.0.0.1:26379/1", "no master_name"),
        ("sentinel://127.0.0.1:26379/x?master_name=wm", "the database 'x' is not a number"),
        ("sentinel://127.0.0.1:26379;redis://127.0.0.1:6379?master_name=wm", "is not a sentinel"),
        ("sentinel://h:1/1;sentinel://h:2/2?master_name=wm", "disagree on db"),
        ("sentinel://h:1/1?master_name=wm&mastr=x", "unknown option 'mastr'"),
    ],
)
@pytest.mark.parametrize("variable", ["WM_REDIS_URL", "WM_BROKER_URL"])
def test_a_bad_sentinel_url_is_refused(url: str, message: str, variable: str) -> None:
    with pytest.raises(ConfigurationError, match=f"{variable}.*{message}"):
        Settings.from_env({variable: url})


def test_a_sentinel_url_names_its_sentinels_primary_and_database() -> None:
    url = "sentinel://:s%40cret@a:26379;sentinel://b;sentinel://c:26380/3?master_name=wm"
    where = parse(url)
    assert where.sentinels == (("a", 26379), ("b", 26379), ("c", 26380))
    assert (where.master_name, where.db, where.password) == ("wm", 3, "s@cret")
    assert deployment_name(Settings.from_env({"WM_REDIS_URL": url})) == "db3"
    # kombu reads the password and database from the first URL, master_name from options
    assert kombu_url(url) == (
        "sentinel://:s%40cret@a:26379/3;sentinel://:s%40cret@b:26379/3;"
        "sentinel://:s%40cret@c:26380/3"
    )
    assert masked(url).count("s%40cret") == 0


def test_waiting_for_the_brokers_replicas_is_refused_on_rabbitmq() -> None:
    settings = Settings.from_env(
        {"WM_BROKER_URL": "amqp://guest:secret@mq:5672//", "WM_BROKER_WAIT_REPLICAS": "1"}
    )
    with pytest.raises(ConfigurationError) as refused:
        celery_settings(settings)
    assert str(refused.value).startswith(
        "WM_BROKER_WAIT_REPLICAS=1 applies to a Redis broker only, not "
        f"WM_BROKER_URL={masked(settings.broker_url)} (on RabbitMQ"
    )
    assert "secret" not in str(refused.value)
    assert celery_settings(settings.replace(broker_wait_replicas=0))["broker_url"]
