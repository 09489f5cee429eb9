"""Shared groups (``group_mode=shared``, docs/guides/groups.md): each event of the topic runs on
one member of the group, members join and leave at run time, nothing is lost or output
twice, also when a node is killed with kill -9. The default, ``exclusive``, is the group
tests' of ``test_guarantees.py``."""

from __future__ import annotations

import random
import signal
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.helpers import STUB, drain, drain_each, eventually, publish_numbered, stub, wm_cli
from wm import DeadLetters, InvalidArgument, Settings, WorkManager
from wm.events import CloudEvent, derive_id, encode, event_key, key_of, make_event
from wm.state.ledger import Ledger
from wm.state.outcomes import Outcomes
from wm.store.shares import share_id
from wm.views import WorkerInfo

SHARED = {"group_mode": "shared"}


@pytest.fixture(params=["redis", "amqp"])
def broker(request: pytest.FixtureRequest, pg_settings: Settings) -> Settings:
    if request.param == "redis":
        return pg_settings.replace(reconcile_interval_s=1.0)
    return request.getfixturevalue("amqp_settings")


def _members(manager: WorkManager, topic: str, done: str, count: int, **code: Any) -> list[Any]:
    return [
        manager.create_worker(
            code=stub(output_type=done, **code),
            mime_type=STUB,
            topic=topic,
            group="g",
            group_mode="shared",
        )
        for _ in range(count)
    ]


def _by_member(outputs: list[dict[str, Any]]) -> Counter[str]:
    """Outputs per member that ran them (the stub's source names its worker)."""
    return Counter(e["source"].rpartition("/")[2] for e in outputs)


def _expected(topic: str, ids: list[str]) -> set[str]:
    """Each event's one output id: derived from the event and the share, whoever ran it."""
    share = share_id(topic, "g")
    return {derive_id(event_key("/tests", i), share, 0) for i in ids}


def _settled(settings: Settings, topic: str) -> None:
    """Nothing of the share stays pending, and nothing was parked."""
    ledger = Ledger(settings)
    eventually(lambda: ledger.pending(share_id(topic, "g")) == 0, timeout_s=30)
    assert DeadLetters(settings).list() == []


def _recorded_elsewhere(settings: Settings, topic: str, done: str) -> CloudEvent:
    """An event whose outcome is recorded under the share already, as a member killed before
    it acknowledged its delivery leaves it: whichever member picks it up republishes."""
    event = make_event(topic, "/tests", {"n": -1})
    share, key = share_id(topic, "g"), key_of(event)
    output = make_event(done, "/elsewhere", {}, id=derive_id(key, share, 0))
    settlement = Ledger(settings).settlement(share, key, encode(event))
    Outcomes(settings).record(share, key, [output], settlement)
    return event


def test_each_event_runs_on_one_member_and_both_members_work(
    broker: Settings, start_node: Any
) -> None:
    settings = broker
    run = uuid.uuid4().hex[:8]
    topic, done = f"in.{run}", f"done.{run}"
    manager = WorkManager(settings)
    sink = manager.subscribe(done, "sink")
    members = _members(manager, topic, done, 2, sleep_ms=2)
    share_queue = f"{topic}::{share_id(topic, 'g')}"
    start_node(settings).consuming(share_queue)
    recorded = _recorded_elsewhere(settings, topic, done)
    manager.publish(recorded)
    ids = [recorded.get_id(), *publish_numbered(manager, topic, 200)]
    outputs = drain(settings, sink, 201, timeout_s=60)
    outputs += drain(settings, sink, 1, timeout_s=1)  # anything run twice arrives too
    counts = Counter(e["id"] for e in outputs)
    assert set(counts) == _expected(topic, ids)
    assert [i for i, n in counts.items() if n > 1] == []
    # Its outcome was found recorded under the share: republished, not run by a member.
    assert [e["source"] for e in outputs if e["data"].get("input") is None] == ["/elsewhere"]
    ran = _by_member([e for e in outputs if e["source"] != "/elsewhere"])
    print(f"shared group: {dict(ran)}")
    assert set(ran) == {str(m.id) for m in members} and min(ran.values()) >= 20, ran
    _settled(settings, topic)
    for member in members:
        manager.delete_worker(member.id)
    assert manager.bus.queue_depth(share_queue) == 0
    manager.unsubscribe(done, "sink")


@pytest.mark.parametrize("leaving", ["delete", "stop", "suspend"])
def test_members_leave_and_join_at_run_time_and_nothing_is_lost(
    pg_settings: Settings, start_node: Any, leaving: str
) -> None:
    """Of two members, one leaves mid-stream (its deliveries in flight go back to the
    group's queue) and a third joins: the others run what it left, the newcomer takes a
    share, every event's output comes once."""
    settings = pg_settings.replace(reconcile_interval_s=1.0)
    run = uuid.uuid4().hex[:8]
    topic, done = f"in.{run}", f"done.{run}"
    manager = WorkManager(settings)
    sink = manager.subscribe(done, "sink")
    leaver, stayer = _members(manager, topic, done, 2, sleep_ms=20)
    processes = 4
    start_node(settings, concurrency=processes).consuming(f"{topic}::{share_id(topic, 'g')}")
    ids = publish_numbered(manager, topic, 300)
    outputs = drain(settings, sink, 40, timeout_s=60)
    if leaving == "stop":  # no grace: deliveries it runs are cut short, back to the queue
        manager.stop_worker(leaver.id, grace_s=0)
    else:
        getattr(manager, f"{leaving}_worker")(leaver.id)
    left_at = time.time()  # committed, and the nodes' cached entries dropped
    [joiner] = _members(manager, topic, done, 1, sleep_ms=20)
    outputs += drain(settings, sink, 300 - len(outputs), timeout_s=90)
    outputs += drain(settings, sink, 1, timeout_s=1)
    counts = Counter(e["id"] for e in outputs)
    assert set(counts) == _expected(topic, ids)
    assert [i for i, n in counts.items() if n > 1] == []
    ran = _by_member(outputs[40:])
    print(f"after the {leaving}: {dict(ran)}")
    assert ran[str(stayer.id)] > 0 and ran[str(joiner.id)] > 0, ran
    # Once it has left, a delivery reads it as gone: it can only have begun runs it had
    # picked before, one per pool process of the node (how many ran before depends on how
    # long the change took, not on the product).
    late = [
        e["data"]["started_at"] - left_at
        for e in outputs
        if e["source"].endswith(str(leaver.id)) and e["data"]["started_at"] > left_at
    ]
    assert len(late) <= processes, f"{len(late)} runs began after it left, by {late} s"
    _settled(settings, topic)
    for member in (leaver, stayer, joiner):
        manager.delete_worker(member.id)
    manager.unsubscribe(done, "sink")


def _shared_member(manager: WorkManager, group: str, **options: Any) -> WorkerInfo:
    return manager.create_worker(
        code=stub(), mime_type=STUB, topic="t", group=group, start=False, **options
    )


def test_a_group_is_exclusive_or_shared_as_a_whole(pg_settings: Settings) -> None:
    manager = WorkManager(pg_settings)
    first = _shared_member(manager, "g")
    assert first.settings == {}  # the default: exclusive, as before
    with pytest.raises(InvalidArgument, match=r"group 'g' is exclusive .* cannot join it"):
        _shared_member(manager, "g", group_mode="shared")
    shared = _shared_member(manager, "s", settings=SHARED)
    assert shared.settings == SHARED
    with pytest.raises(InvalidArgument, match="group 's' is shared"):
        _shared_member(manager, "s", settings={"group_mode": "exclusive"})
    refusals = [
        ({"group_mode": "shared"}, None, "'group_mode' shared needs a group"),
        ({"group_mode": "shared", "ordering": "key"}, "s", "'ordering' key do not go together"),
        ({"group_mode": "shared", "batch_size": 5}, "s", "'batch_size' > 1 do not go together"),
        ({"group_mode": "all"}, "s", "'group_mode' must be one of exclusive, shared"),
    ]
    for given, group, named in refusals:
        with pytest.raises(InvalidArgument, match=named):
            manager.create_worker(
                code=stub(), mime_type=STUB, topic="t", group=group, settings=given
            )
    with pytest.raises(InvalidArgument, match="disagree"):
        _shared_member(manager, "s", group_mode="shared", settings={"group_mode": "exclusive"})
    manager.delete_worker(first.id)
    assert _shared_member(manager, "g", group_mode="shared").settings == SHARED  # g was empty
    made = wm_cli(
        pg_settings,
        "worker",
        "create",
        "--topic",
        "t",
        "--mime-type",
        STUB,
        "--base64",
        "e30=",
        "--group",
        "s",
        "--group-mode",
        "shared",
        "--no-start",
    )
    assert made["settings"] == SHARED


@pytest.mark.slow
def test_kill_9_while_a_shared_group_consumes_loses_and_duplicates_nothing(
    broker: Settings, start_node: Any, rng: random.Random, tmp_path: Path
) -> None:
    """Two members on two nodes; twice, at a point the seed picks, a node is killed with
    kill -9 and replaced. Every event's output comes once (on RabbitMQ a kill may repeat one
    output to the plain subscription, docs), nothing stays pending, and what ran twice is
    at most what the kills cut short."""
    settings = broker.replace(visibility_timeout_s=5, redeliver_after_s=10.0)
    run = uuid.uuid4().hex[:8]
    topic, done = f"in.{run}", f"done.{run}"
    manager = WorkManager(settings)
    sink = manager.subscribe(done, "sink")
    trace = tmp_path / "runs.jsonl"
    # Runs of 10 ms: a kill is likely to cut some short, to be run again.
    members = _members(manager, topic, done, 2, sleep_ms=10, trace=str(trace))
    share, events, kills = share_id(topic, "g"), 600, 2
    ids = publish_numbered(manager, topic, events)
    ledger, in_flight = Ledger(settings), 0
    nodes = [start_node(settings, name=f"n{i}") for i in range(2)]
    for round_ in range(kills):
        target = max(ledger.pending(share) - rng.randint(50, 150), 0)
        eventually(lambda t=target: ledger.pending(share) <= t, timeout_s=60, interval_s=0.02)
        victim = rng.choice(nodes)
        in_flight += _unacked(settings)
        victim.kill(signal.SIGKILL)
        nodes.remove(victim)
        nodes.append(start_node(settings, name=f"r{round_}"))
    outputs = drain_each(settings, sink, _expected(topic, ids), timeout_s=90)
    outputs += drain(settings, sink, events, timeout_s=3)  # anything repeated late
    counts = Counter(e["id"] for e in outputs)
    executions = len(trace.read_text().splitlines())
    print(
        f"shared chaos: {len(outputs)} outputs for {events} events, {executions} executions "
        f"({in_flight} in flight at the kills), by member {sorted(_by_member(outputs).values())}"
    )
    assert sorted(_expected(topic, ids) - set(counts)) == []  # nothing lost
    assert len(counts) == events
    repeated = [i for i, n in counts.items() if n > 1]
    if settings.broker_url.startswith("redis"):
        assert repeated == []  # nothing output twice
    else:
        assert len(repeated) <= kills and all(counts[i] == 2 for i in repeated), repeated
    assert executions <= events + in_flight + 2 * kills, (executions, in_flight)  # 2 per node
    _settled(settings, topic)
    for member in members:
        manager.delete_worker(member.id)
    manager.unsubscribe(done, "sink")


def _unacked(settings: Settings) -> int:
    """Messages a Redis broker holds unacknowledged (RabbitMQ requeues a dead consumer's)."""
    if not settings.broker_url.startswith("redis"):
        return 0
    return int(redis.Redis.from_url(settings.broker_url).hlen("unacked"))
