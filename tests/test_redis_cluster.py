"""The state store on a Redis Cluster: a local 3-shard cluster started by these tests.

Every command the test process sends to the cluster is recorded, and each test ends by
checking that no script, MGET or transaction named keys of two slots (``slots``); the node
processes of the end-to-end test are checked through the servers' error counts (a command
across slots fails with CROSSSLOT there). The broker stays the suite's single Redis.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import ClusterPipeline, RedisCluster, TransactionStrategy, key_slot

from tests.conftest import (
    BROKER_DB,
    REDIS_HOST,
    STATE_DB,
    env_of,
    flush_redis,
    make_settings,
    need,
)
from tests.helpers import STUB, drain, eventually, queue_empty, stub
from wm import Settings, WorkManager, store
from wm.cli import EXIT_CODES
from wm.dataplane.bus import Route
from wm.dataplane.delivery import FENCE_EXTENSION
from wm.dataplane.outputs import OutputPublisher
from wm.errors import (
    BrokerUnavailable,
    ConfigurationError,
    EmbeddedRedisError,
    FenceRejected,
    LockContention,
    Misconfigured,
)
from wm.events import derive_id, key_of, make_event
from wm.local.embedded import find_redis_server
from wm.state.connection import redis_for
from wm.state.directory import Directory
from wm.state.health import HEALTHY, UNHEALTHY, UNKNOWN, Probes, WorkerHealth
from wm.state.ledger import Delivery as LedgerDelivery
from wm.state.ledger import Ledger
from wm.state.locks import GroupLocks
from wm.state.ordering import GO, KEY_TTL_S, Ordering, turn_key
from wm.state.outcomes import Outcomes
from wm.store.shares import share_id

#: Shards of the test cluster (primaries, no replicas).
SHARDS = 3
#: Slots of a Redis Cluster.
SLOTS = 16384
#: Upper bound on a server answering PING or a cluster reaching state ok (s).
START_TIMEOUT_S = 20.0
#: Ports a server start may try before giving up (another program may take a free port).
PORT_TRIES = 3


@dataclass
class Cluster:
    ports: list[int]
    processes: list[subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def nodes(self) -> list[redis.Redis]:
        return [redis.Redis(host="127.0.0.1", port=port) for port in self.ports]

    def flush(self) -> None:
        for node in self.nodes():
            node.flushall()
            node.config_resetstat()
            node.close()

    def cross_slot_errors(self) -> int:
        """Commands the servers refused because their keys were in several slots."""
        total = 0
        for node in self.nodes():
            total += int(node.info("errorstats").get("errorstat_CROSSSLOT", {}).get("count", 0))
            node.close()
        return total

    def shards_holding_keys(self) -> int:
        counts = []
        for node in self.nodes():
            counts.append(int(node.dbsize()))
            node.close()
        return sum(1 for n in counts if n)


#: First port tried for a server; its cluster bus listens 10000 above (redis-server < 7 has
#: no ``--cluster-port``), so ports come from below the ephemeral range, scanned upwards.
FIRST_PORT = 21000
#: Offset of a node's cluster bus port from its client port.
BUS_OFFSET = 10000


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_ports(after: int) -> int:
    """The first port above ``after`` free together with its bus port."""
    port = after + 1
    while not (_free(port) and _free(port + BUS_OFFSET)):
        port += 1
    return port


def _start_server(
    binary: str, directory: Path, after: int, *options: str
) -> tuple[int, subprocess.Popen[bytes]]:
    """A cluster-enabled redis-server on the first free port above ``after``, with more
    command-line ``options`` (``--name value`` pairs)."""
    port = after
    for _ in range(PORT_TRIES):
        port = _free_ports(port)
        log = (directory / f"redis-{port}.log").open("ab")
        process = subprocess.Popen(
            [
                binary,
                *("--port", str(port), "--bind", "127.0.0.1"),
                *("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"),
                *("--dir", str(directory), "--save", "", "--appendonly", "no"),
                *options,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError):
                # ours, not a server another test process started on the same free port
                answer = redis.Redis(port=port, socket_connect_timeout=1).info("server")
                if answer["process_id"] == process.pid:
                    return port, process
            time.sleep(0.05)
        _stop(process)  # its port was taken meanwhile, or it never answered: try another
    raise AssertionError(f"redis-server would not start in {directory}; see redis-*.log there")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def _form_cluster(ports: list[int]) -> None:
    """What ``redis-cli --cluster create … --cluster-replicas 0`` does: split the slots into
    equal ranges, one per node, and make the nodes meet; then wait for ``cluster_state:ok``."""
    nodes = [redis.Redis(port=port) for port in ports]
    bounds = [SLOTS * i // len(nodes) for i in range(len(nodes) + 1)]
    for node, low, high in zip(nodes, bounds, bounds[1:], strict=False):
        node.execute_command("CLUSTER", "ADDSLOTS", *range(low, high))
    for node in nodes[1:]:
        node.execute_command("CLUSTER", "MEET", "127.0.0.1", ports[0])

    await_cluster(nodes)


def await_cluster(nodes: list[redis.Redis]) -> None:
    """Wait until every node of a cluster forming says it is whole; then close them."""

    def ready() -> bool:
        infos = [node.execute_command("CLUSTER", "INFO") for node in nodes]
        return all(
            b"cluster_state:ok" in info and f"cluster_known_nodes:{len(nodes)}".encode() in info
            for info in infos
        )

    eventually(ready, timeout_s=START_TIMEOUT_S, interval_s=0.05)
    for node in nodes:
        node.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A 3-shard Redis Cluster of the module's own (missing redis-server: a skip locally,
    a failure in CI)."""
    try:
        binary = find_redis_server()
    except EmbeddedRedisError as exc:
        need("redis-server", exc)
    directory = tmp_path_factory.mktemp("redis-cluster")
    started: list[tuple[int, subprocess.Popen[bytes]]] = []
    try:
        for _ in range(SHARDS):
            started.append(
                _start_server(binary, directory, started[-1][0] if started else FIRST_PORT)
            )
        _form_cluster([port for port, _ in started])
        yield Cluster([port for port, _ in started], [process for _, process in started])
    finally:
        for _, process in started:
            _stop(process)


@pytest.fixture
def cluster_settings(cluster: Cluster, tmp_path: Path, redis_ok: None) -> Iterator[Settings]:
    """Settings with WM_REDIS_URL at the cluster (the broker: the suite's single Redis)."""
    cluster.flush()
    flush_redis(BROKER_DB)
    settings = make_settings(
        f"sqlite:///{tmp_path / 'wm.db'}", redis_url=cluster.url, reconcile_interval_s=1.0
    )
    store.upgrade(settings)
    yield settings
    store.dispose_engines()


# --- the slot check ----------------------------------------------------------------------


@dataclass
class SlotRecorder:
    """The keys of every command (or transaction) this process sent to the cluster."""

    probe: redis.Redis
    sent: list[tuple[str, list[bytes]]] = field(default_factory=list)

    def keys_of(self, args: tuple[Any, ...]) -> list[bytes]:
        name = str(args[0]).upper()
        if name in ("EVAL", "EVALSHA"):
            return [_raw(key) for key in args[3 : 3 + int(args[2])]]
        try:  # the server knows where each command keeps its keys
            return [_raw(key) for key in self.probe.command_getkeys(*args)]
        except redis.ResponseError:  # a command without keys
            return []

    def record(self, name: str, keys: list[bytes]) -> None:
        if keys:
            self.sent.append((name, keys))

    def crossing(self) -> list[tuple[str, list[bytes]]]:
        return [(name, keys) for name, keys in self.sent if len({key_slot(k) for k in keys}) > 1]

    def seen(self, name: str, key_count: int) -> bool:
        return any(n == name and len(keys) >= key_count for n, keys in self.sent)


def _raw(key: Any) -> bytes:
    return key if isinstance(key, bytes) else str(key).encode()


@pytest.fixture(autouse=True)
def slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlotRecorder]:
    """Record each command sent through redis-py's cluster client, alone or in a pipeline
    (a transaction as one), and fail the test if one named keys of two slots."""
    recorder = SlotRecorder(redis.Redis.from_url(f"{REDIS_HOST}/{STATE_DB}"))
    direct = RedisCluster.execute_command
    piped = ClusterPipeline.execute

    def execute_command(self: RedisCluster, *args: Any, **kwargs: Any) -> Any:
        recorder.record(str(args[0]).upper(), recorder.keys_of(args))
        return direct(self, *args, **kwargs)

    def execute(self: ClusterPipeline, raise_on_error: bool = True) -> Any:
        queued = [command.args for command in self._execution_strategy.command_queue]
        if isinstance(self._execution_strategy, TransactionStrategy):
            recorder.record("MULTI", [key for args in queued for key in recorder.keys_of(args)])
        else:
            for args in queued:
                recorder.record(str(args[0]).upper(), recorder.keys_of(args))
        return piped(self, raise_on_error)

    monkeypatch.setattr(RedisCluster, "execute_command", execute_command)
    monkeypatch.setattr(ClusterPipeline, "execute", execute)
    yield recorder
    recorder.probe.close()
    assert recorder.crossing() == []


# --- connecting ----------------------------------------------------------------------------


def test_a_cluster_node_in_the_url_gives_a_cluster_client(cluster_settings: Settings) -> None:
    assert isinstance(redis_for(cluster_settings), RedisCluster)
    single = cluster_settings.replace(redis_url=f"{REDIS_HOST}/{STATE_DB}")
    assert isinstance(redis_for(single), redis.Redis)


def test_a_database_number_on_a_cluster_is_refused_naming_the_setting(
    cluster_settings: Settings,
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        redis_for(cluster_settings.replace(redis_url=f"{cluster_settings.redis_url}/1"))
    assert "WM_REDIS_URL" in str(refused.value) and "database" in str(refused.value)


def test_an_unreachable_state_store_is_reported_with_the_setting_to_fix(
    cluster_settings: Settings,
) -> None:
    with socket.socket() as bound:  # bound, not listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        settings = cluster_settings.replace(redis_url=f"redis://127.0.0.1:{port}")
        with pytest.raises(BrokerUnavailable) as refused:
            GroupLocks(settings).try_acquire("g", "owner")
    assert f"127.0.0.1:{port}" in str(refused.value) and "WM_REDIS_URL" in str(refused.value)


def test_a_cluster_node_taken_for_a_single_server_is_named_as_such(
    cluster_settings: Settings, cluster: Cluster
) -> None:
    """A client that did not learn it talks to a cluster (its user may not run INFO) is
    sent elsewhere (MOVED): the error says what the server is."""
    cluster_client = redis_for(cluster_settings)
    assert isinstance(cluster_client, RedisCluster)
    elsewhere = next(
        group
        for group in (f"group-{n}" for n in range(16))
        if cluster_client.get_node_from_key(f"wm:lock:{{{group}}}").port != cluster.ports[0]
    )
    plain = redis.Redis(port=cluster.ports[0])
    with pytest.raises(BrokerUnavailable) as refused:
        GroupLocks(cluster_settings, client=plain).try_acquire(elsewhere, "owner")
    plain.close()
    assert "Redis Cluster node" in str(refused.value) and "INFO" in str(refused.value)


def test_a_cluster_node_as_the_broker_is_refused_in_one_line(
    cluster_settings: Settings, cluster: Cluster
) -> None:
    """Finding 11: kombu's Redis transport cannot run on a cluster. The `wm` command that
    reaches the broker says so in one line naming WM_BROKER_URL, whether the URL names
    database 0 (INFO says it is a cluster) or another (the server refuses SELECT)."""
    for url in (cluster.url, f"{cluster.url}/3"):
        env = env_of(cluster_settings.replace(broker_url=url))
        done = subprocess.run(
            [sys.executable, "-m", "wm.cli", "subscribe", "t", "q"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == EXIT_CODES[Misconfigured], done.stderr
        [line] = done.stderr.splitlines()
        assert line.startswith("wm: error: WM_BROKER_URL (") and cluster.url[8:] in line, line
        assert "Redis Cluster is not supported as a broker" in line, line


# --- the state store, part by part ----------------------------------------------------------


def test_group_locks_acquire_release_fence_and_take_over(cluster_settings: Settings) -> None:
    settings = cluster_settings.replace(group_lock_lease_s=0.3, group_lock_handoff_ms=75)
    locks = GroupLocks(settings)
    client = redis_for(settings)
    assert isinstance(client, RedisCluster)
    groups = [f"group-{n}" for n in range(8)]
    nodes = {client.get_node_from_key(f"wm:lock:{{{g}}}").name for g in groups}
    assert len(nodes) > 1  # the groups spread over the shards
    fences = {}
    for group in groups:
        lease = locks.acquire(group, "owner-1")
        locks.mark_write(lease)
        holder = locks.holder(group)
        assert holder is not None and holder["owner"] == "owner-1" and holder["written"]
        assert locks.release(lease) and locks.holder(group) is None
        fences[group] = locks.acquire(group, "owner-2").fence
        assert fences[group] > lease.fence  # the fence survives a release
    group = groups[0]
    held = locks.acquire(group, "busy")  # owner-2 still holds it: its lease runs out first
    assert held.owner == "busy" and held.fence > fences[group]
    with pytest.raises(LockContention):
        locks.take(group, "contender")
    # a holder whose lease ran out is refused its write, and the lock is taken over
    time.sleep(settings.group_lock_lease_s * 1.5)
    taken = locks.take(group, "successor")
    assert taken.fence > held.fence
    with pytest.raises(FenceRejected):
        locks.mark_write(held)
    assert not locks.release(held) and locks.release(taken)


def test_a_release_hands_the_lock_to_a_waiting_contender(
    cluster_settings: Settings, slots: SlotRecorder
) -> None:
    settings = cluster_settings.replace(group_lock_retry_base_delay_ms=3000)
    locks = GroupLocks(settings)
    holder = locks.acquire("handoff", "holder")
    assert locks.try_acquire("handoff", "contender") is None  # marks the lock as waited for
    released = threading.Timer(0.2, locks.release, args=(holder,))
    released.start()
    started = time.monotonic()
    lease = locks.acquire("handoff", "contender", retries=1)
    waited_s = time.monotonic() - started
    released.join()
    assert lease.fence > holder.fence
    assert waited_s < 2.0  # woken by the release's token, not by the 2.5 s backoff
    assert slots.seen("BLPOP", 1)  # waited on the wake-up key's node


def test_outcomes_and_the_pending_ledger(cluster_settings: Settings) -> None:
    ledger, outcomes = Ledger(cluster_settings), Outcomes(cluster_settings)
    workers = [f"00000000-0000-0000-0000-00000000000{n}" for n in range(6)]
    client = redis_for(cluster_settings)
    assert isinstance(client, RedisCluster)
    assert len({client.get_node_from_key(f"wm:pending:{{{w}}}").name for w in workers}) > 1
    event = make_event("in", "/tests", {"n": 1})
    key, payload = key_of(event), '{"n": 1}'
    ledger.add([(w, f"in::{w}") for w in workers], key, payload)
    assert ledger.pending_of(workers) == dict.fromkeys(workers, 1)
    assert [p.key for p in ledger.overdue(workers[0], 0.0)] == [key]
    ledger.restart_clock(workers[0], ledger.overdue(workers[0], 0.0))
    assert ledger.overdue(workers[0], 60.0) == []
    ledger.restart_clocks(workers[1])
    assert ledger.claim_sweep(10.0) and not ledger.claim_sweep(10.0)

    output = make_event("done", "/tests", {"n": 2})
    assert outcomes.get(workers[0], key) is None
    recorded, more = outcomes.record(
        workers[0], key, [output], ledger.settlement(workers[0], key, payload)
    )
    assert recorded[0].get_id() == output.get_id() and more == []
    assert outcomes.get(workers[0], key)[0].get_id() == output.get_id()  # type: ignore[index]
    again, _ = outcomes.record(
        workers[0], key, [make_event("done", "/tests", {})], ledger.settlement(workers[0], key, "x")
    )
    assert again[0].get_id() == output.get_id()  # the first record wins
    assert ledger.pending(workers[0]) == 0

    assert ledger.begin_run(workers[2], key) == 1 and ledger.begin_run(workers[2], key) == 2
    outcomes.record(
        workers[2], key, [], ledger.settlement(workers[2], key, payload, ran_again=True)
    )
    assert ledger.pending(workers[2]) == 0 and ledger.begin_run(workers[2], key) == 1
    ledger.end_run(workers[2], key)
    ledger.settle(workers[3], key, payload)
    ledger.forget_worker(workers[4])
    assert ledger.pending_of(workers[3:]) == {workers[3]: 0, workers[4]: 0, workers[5]: 1}

    # ordered keys: numbered in each worker's slot, one pipeline for all; a key's hash ends
    # once its numbers have had their turns
    numbered = ledger.add([], "k", payload, numbered=workers, partition="alpha")
    assert numbered.numbers == dict.fromkeys(workers, 1)
    many = [LedgerDelivery("k2", payload, (), tuple(workers), "alpha")]
    assert ledger.add_many(many)[0].numbers == dict.fromkeys(workers, 2)
    assert {client.ttl(turn_key(w, "alpha")) for w in workers} == {-1}
    ordering = Ordering(cluster_settings)
    for number in (1, 2):
        assert ordering.turn(workers[0], "alpha", number, 60.0)[0] == GO
        ordering.advance(workers[0], "alpha", number)
    assert 0 < client.ttl(turn_key(workers[0], "alpha")) <= KEY_TTL_S


def test_the_directory_reads_caches_and_forgets(cluster_settings: Settings) -> None:
    manager = WorkManager(cluster_settings)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="in", start=False)
    wid = str(worker.id)
    directory, outcomes = Directory(cluster_settings), Outcomes(cluster_settings)
    client = redis_for(cluster_settings)
    meta, (outcome,) = directory.get_with(wid, outcomes.key(wid, "src\nid"))
    assert meta is not None and meta.topic == "in" and outcome is None
    assert client.get(f"wm:worker:{{{wid}}}") is not None  # cached
    directory.invalidate(wid)
    assert client.get(f"wm:worker:{{{wid}}}") is None
    assert directory.get(wid) == meta
    directory.invalidate()  # all of them, on every shard
    assert client.get(f"wm:worker:{{{wid}}}") is None
    assert directory.get("") is None and directory.get("not-a-uuid") is None


def test_worker_health_is_judged_and_kept_on_the_cluster(cluster_settings: Settings) -> None:
    """A node judges its workers' health each reconcile: the reads of many workers' keys
    go in one pipeline (a cluster pipeline refuses MGET, which failed every reconcile)."""
    probes, health = Probes(cluster_settings), WorkerHealth(cluster_settings)
    workers = [f"00000000-0000-0000-0000-00000000010{n}" for n in range(3)]
    for _ in range(2):
        probes.record(workers[0], 1, "db down", interval_s=30)
    probes.record(workers[1], 1, None, interval_s=30)
    verdicts = health.judge_all(
        {workers[0]: {"max_probe_failures": 2}, workers[1]: {}, workers[2]: {}}
    )
    assert {w: (v.health, old) for w, (v, old) in verdicts.items()} == {
        workers[0]: (UNHEALTHY, UNKNOWN),
        workers[1]: (HEALTHY, UNKNOWN),
        workers[2]: (UNKNOWN, UNKNOWN),
    }
    assert health.known(workers[:2]) == {workers[0]: UNHEALTHY, workers[1]: HEALTHY}
    again = health.judge_all({workers[0]: {"max_probe_failures": 2}})
    assert again[workers[0]][1] == UNHEALTHY  # the kept verdict was read back


def test_routes_are_loaded_repaired_and_count_drops(cluster_settings: Settings) -> None:
    manager = WorkManager(cluster_settings)
    bus = manager.bus
    topics = [f"topic-{n}" for n in range(8)]
    queues = {topic: manager.subscribe(topic, "sink") for topic in topics}
    client = redis_for(cluster_settings)
    assert isinstance(client, RedisCluster)
    assert len({client.get_node_from_key(f"wm:topic:{{{t}}}:routes").name for t in topics}) > 1
    for topic in topics:
        assert bus.routes(topic) == [Route(queues[topic], None)]
    # a shard lost a topic's keys: the lookup loads that topic from the database
    client.delete(f"wm:topic:{{{topics[0]}}}:ready", f"wm:topic:{{{topics[0]}}}:routes")
    assert bus.routes(topics[0]) == [Route(queues[topics[0]], None)]
    # a route lost and one made up behind WorkManager's back: a rebuild repairs both
    client.hdel(f"wm:topic:{{{topics[1]}}}:routes", queues[topics[1]])
    client.hset(f"wm:topic:{{{topics[2]}}}:routes", "made-up", "")
    assert bus.rebuild_routes() == 2
    assert bus.routes(topics[1]) == [Route(queues[topics[1]], None)]
    assert bus.routes(topics[2]) == [Route(queues[topics[2]], None)]
    for topic in ("nobody.a", "nobody.b", "nobody.b"):
        assert manager.publish(make_event(topic, "/tests", {})) == 0
    assert bus.dropped("nobody.a") == 1 and bus.dropped("nobody.b") == 2 and bus.dropped() == 3
    manager.unsubscribe(topics[3], "sink")
    assert bus.routes(topics[3]) == []


def test_publish_many_routes_records_and_counts_drops_on_the_cluster(
    cluster_settings: Settings,
) -> None:
    """On a cluster the lookups and the ledger writes of a batch are two round trips (their
    keys lie in different slots): each event still reaches its topic's subscriptions, each
    delivery to a worker is pending, and an event nobody hears is counted."""
    manager = WorkManager(cluster_settings)
    queue = manager.subscribe("many-a", "sink")
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="many-b")
    topics = ["many-a", "many-b", "nobody.many", "many-a", "many-b"]
    events = [make_event(topic, "/tests", {"n": n}) for n, topic in enumerate(topics)]
    assert manager.publish_many(events) == [1, 1, 0, 1, 1]
    assert manager.bus.dropped("nobody.many") == 1
    assert [e["data"]["n"] for e in drain(cluster_settings, queue, 2)] == [0, 3]
    assert Ledger(cluster_settings).pending(str(worker.id)) == 2
    manager.delete_worker(worker.id)


def test_an_output_reaches_a_plain_subscription_once_with_the_marker_on_the_cluster(
    cluster_settings: Settings,
) -> None:
    """With a broker other than Redis the output's marker lives in the state store."""
    manager = WorkManager(cluster_settings)
    sink = manager.subscribe("done", "sink")
    publisher = OutputPublisher(manager.bus)
    publisher.redis_broker = False  # the marker path of RabbitMQ, over the Redis broker
    output = make_event("done", "/tests", {"n": 1})
    for _ in range(3):  # a redelivered event republishes its recorded outputs
        publisher.publish(output)
    assert [e["id"] for e in drain(cluster_settings, sink, 1)] == [output.get_id()]
    assert queue_empty(cluster_settings, sink, 0.5)
    assert redis_for(cluster_settings).exists(f"wm:published:done:{key_of(output)}")


def test_every_multi_key_command_names_one_slot(
    cluster_settings: Settings, slots: SlotRecorder, cluster: Cluster
) -> None:
    """The recorder sees the state store's scripts and MGETs (so the check at the end of
    each test has something to check), and the servers refused nothing across slots."""
    test_outcomes_and_the_pending_ledger(cluster_settings)
    test_the_directory_reads_caches_and_forgets(cluster_settings)
    GroupLocks(cluster_settings).release(GroupLocks(cluster_settings).acquire("g", "o"))
    assert slots.seen("EVALSHA", 2)  # lock acquire, release: record, fence, wake
    assert slots.seen("EVAL", 3)  # outcome record: outcome, pending index, runs
    assert slots.seen("MGET", 3)  # worker facts, generation, outcome
    assert slots.seen("EVAL", 2)  # cache if unchanged
    assert slots.crossing() == [] and cluster.cross_slot_errors() == 0


# --- upgrading from the layout of earlier releases (a single Redis) -------------------------


@pytest.fixture
def single_settings(tmp_path: Path, redis_ok: None) -> Iterator[Settings]:
    flush_redis(BROKER_DB, STATE_DB)
    settings = make_settings(f"sqlite:///{tmp_path / 'wm.db'}")
    store.upgrade(settings)
    yield settings
    store.dispose_engines()


def test_an_upgrade_keeps_routes_and_drop_counts_of_the_earlier_layout(
    single_settings: Settings,
) -> None:
    """Routes of an earlier release (``wm:routes:<topic>``, one ``wm:routes-ready`` flag)
    are loaded again from the database; while a process of that release may still read
    them, a new subscription is written there too, and a full rebuild makes such processes
    rebuild theirs. Its drop counts (``wm:stats:dropped``) are still reported."""
    manager = WorkManager(single_settings)
    state = redis.Redis.from_url(single_settings.redis_url)
    old = manager.subscribe("orders", "old")
    state.hset("wm:routes:orders", old, "")
    state.set("wm:routes-ready", "1")
    state.hset("wm:stats:dropped", mapping={"nobody": 2, "*": 2})
    state.delete("wm:topic:{orders}:ready", "wm:topic:{orders}:routes")  # as after upgrade
    assert manager.bus.routes("orders") == [Route(old, None)]
    new = manager.subscribe("orders", "new")
    assert state.hgetall("wm:routes:orders") == {old.encode(): b"", new.encode(): b""}
    assert manager.publish(make_event("nobody", "/tests", {})) == 0
    assert manager.bus.dropped("nobody") == 3 and manager.bus.dropped() == 3
    manager.bus.rebuild_routes()
    assert not state.exists("wm:routes-ready")
    assert manager.bus.routes("orders") == [Route(new, None), Route(old, None)]


def test_outcomes_ledger_and_locks_keep_the_names_of_earlier_releases(
    single_settings: Settings,
) -> None:
    """They were hash-tagged already, so a running system keeps them across an upgrade."""
    wid, key = "4f1c2a8e-0000-4000-8000-000000000001", "/tests\n1"
    assert Outcomes.key(wid, key) == f"wm:outcome:{{{wid}}}:{key}"
    settlement = Ledger(single_settings).settlement(wid, key, "payload", ran_again=True)
    assert (settlement.index, settlement.runs) == (
        f"wm:pending:{{{wid}}}",
        f"wm:pending:{{{wid}}}:runs",
    )
    lease = GroupLocks(single_settings).acquire("g", "owner")
    state = redis.Redis.from_url(single_settings.redis_url)
    assert state.hget("wm:lock:{g}", "fence") == str(lease.fence).encode()
    assert state.get("wm:lock:{g}:fence") == str(lease.fence).encode()
    GroupLocks(single_settings).release(lease)


# --- end to end ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_group_delivers_end_to_end_with_the_state_store_on_the_cluster(
    cluster_settings: Settings, cluster: Cluster, start_node: Callable[..., Any]
) -> None:
    settings = cluster_settings
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    workers = [
        manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in", group="g")
        for _ in range(2)
    ]
    node = start_node(settings)
    for worker in workers:
        node.consuming(f"in::{worker.id}")
    events = [make_event("in", "/tests", {"n": n}) for n in range(10)]
    for event in events:
        manager.publish(event)
    outputs = drain(settings, sink, 20)
    assert len(outputs) == 20
    assert len({int(e[FENCE_EXTENSION]) for e in outputs}) == 20  # one lock per delivery
    ledger, outcomes = Ledger(settings), Outcomes(settings)
    wids = [str(w.id) for w in workers]
    eventually(lambda: ledger.pending_of(wids) == dict.fromkeys(wids, 0), timeout_s=10)
    assert all(outcomes.get(w, key_of(e)) is not None for w in wids for e in events)
    assert GroupLocks(settings).holder("g") is None
    assert cluster.shards_holding_keys() > 1
    assert cluster.cross_slot_errors() == 0


@pytest.mark.slow
def test_a_shared_group_delivers_end_to_end_with_the_state_store_on_the_cluster(
    cluster_settings: Settings, cluster: Cluster, start_node: Callable[..., Any]
) -> None:
    """A shared group's directory entry, outcomes, pending ledger and event locks each keep
    to one slot: its events run once each, recorded under the share."""
    settings = cluster_settings
    manager = WorkManager(settings)
    sink = manager.subscribe("done", "sink")
    for _ in range(2):
        manager.create_worker(
            code=stub(output_type="done"),
            mime_type=STUB,
            topic="in",
            group="s",
            group_mode="shared",
        )
    share = share_id("in", "s")
    start_node(settings).consuming(f"in::{share}")
    events = [make_event("in", "/tests", {"n": n}) for n in range(10)]
    for event in events:
        manager.publish(event)
    outputs = drain(settings, sink, 10) + drain(settings, sink, 1, timeout_s=1)
    assert sorted(e["id"] for e in outputs) == sorted(
        derive_id(key_of(e), share, 0) for e in events
    )
    ledger, outcomes = Ledger(settings), Outcomes(settings)
    eventually(lambda: ledger.pending(share) == 0, timeout_s=10)
    assert all(outcomes.get(share, key_of(e)) is not None for e in events)
    assert cluster.cross_slot_errors() == 0
