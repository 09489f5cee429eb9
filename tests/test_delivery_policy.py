"""The consumer task's failure policy (``wm.dataplane.tasks``) on an in-process Celery worker.

``celery_app`` and ``celery_worker`` (``celery.contrib.pytest``) run a real Celery worker in a
thread of this process, on kombu's in-memory transport; the store and the Redis state are the
suite's real ones. The worker's runtime reads its settings from the environment, as a node
does; it runs the threads pool (a node runs prefork) and lacks the node's reconcile step, so
it consumes a worker's queue when the manager's start broadcast reaches it. The same
behaviour through real node processes and a real broker is covered by the slow tests in
``test_dataplane.py``, ``test_guarantees.py`` and ``test_python_e2e.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import WorkController
from celery.worker import state as worker_state
from kombu.transport import memory
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import update

from tests.helpers import STUB, command_calls, drain, eventually, stub
from wm import DeadLetters, Settings, WorkManager, make_event, store
from wm.config import current_values
from wm.dataplane import observe, pipeline, tasks, tracing
from wm.dataplane.app import celery_settings
from wm.dataplane.bus import Route
from wm.dataplane.delivery import Delivery
from wm.dataplane.features import FEATURES
from wm.dataplane.message import DeliveryState
from wm.dataplane.pipeline import Feature, Pipeline
from wm.dataplane.queues import worker_queue_name
from wm.dataplane.routes import DROPPED, DROPPED_TTL_S, topic_key
from wm.dataplane.tasks import reset_runtime
from wm.dataplane.verdicts import Park, Verdict
from wm.errors import InvalidArgument
from wm.events import LIFECYCLE_TOPIC, LIFECYCLE_TYPE_PREFIX, derive_id, encode, event_key
from wm.lifecycle import Status
from wm.state.connection import redis_for
from wm.state.ledger import RUNS_TTL_S, Ledger
from wm.state.locks import GroupLocks
from wm.state.outcomes import Outcomes
from wm.state.unawaited import UNAWAITED
from wm.store.models import WorkerVersion
from wm.views import WorkerInfo

ERROR_TYPE = LIFECYCLE_TYPE_PREFIX + "error"


# -- the in-process node -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def memory_broker() -> Iterator[None]:
    """kombu's in-memory broker is process-wide: each test starts and ends with it empty."""
    _clear_memory_broker()
    yield
    _clear_memory_broker()


def _clear_memory_broker() -> None:
    memory.Channel.queues.clear()
    memory.Channel.events.clear()
    memory.Transport.global_state.clear()


@pytest.fixture
def node_settings(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, rng: random.Random
) -> Iterator[Settings]:
    """The test's settings on the in-memory broker, exported the way a node reads them.

    ``rng`` seeds the retry jitter the worker thread draws, so a failure can be replayed.
    """
    result = settings.replace(
        broker_url="memory://",
        reconcile_interval_s=1.0,
        group_lock_retry_base_delay_ms=10,
    )
    for name in list(os.environ):
        if name.startswith("WM_"):
            monkeypatch.delenv(name)
    for name, value in current_values(result).items():
        monkeypatch.setenv(name, value)
    reset_runtime()  # the worker thread builds its runtime from this environment
    yield result
    reset_runtime()


@pytest.fixture
def celery_config(node_settings: Settings) -> Mapping[str, Any]:
    """WorkManager's own Celery configuration, polling the in-memory broker often."""
    return {
        **celery_settings(node_settings),
        "broker_transport_options": {"polling_interval": 0.01},
    }


@pytest.fixture(scope="session")
def celery_includes() -> tuple[str, ...]:
    return ("wm.dataplane.tasks",)


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    """Threads, so the consumer keeps fetching (prefetch) while a delivery runs."""
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters() -> Mapping[str, Any]:
    # The ping check needs a result backend; WorkManager runs without one.
    return {"perform_ping_check": False}


@pytest.fixture
def manager(node_settings: Settings) -> WorkManager:
    return WorkManager(node_settings)


@pytest.fixture
def node(celery_worker: WorkController, celery_app: Celery) -> Iterator[WorkController]:
    yield celery_worker
    # celery_worker's teardown asks the worker to stop, but on a polling transport the worker
    # notices only after its current drain cycle and one more (2 s each): wake both at once.
    worker_state.should_terminate = 0
    for _ in range(2):
        celery_app.control.broadcast("ping", reply=False)


def _consuming(node: WorkController, worker: WorkerInfo) -> str:
    """Wait until the node consumes the worker's queue (``start_worker`` broadcasts it)."""
    queue = worker_queue_name(worker.topic, str(worker.id))
    eventually(
        lambda: queue in {q.name for q in node.consumer.task_consumer.queues},
        timeout_s=10,
        interval_s=0.02,
    )
    return queue


def _time(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(event["time"])


# -- tests ---------------------------------------------------------------------------------


def test_a_delivery_publishes_stamped_outputs_and_settles(
    node: WorkController, manager: WorkManager, node_settings: Settings
) -> None:
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="done", outputs=2), mime_type=STUB, topic="in"
    )
    _consuming(node, worker)
    event = make_event("in", "/tests", {"n": 1}, extensions={"correlationid": "corr-1"})
    manager.publish(event)

    outputs = drain(node_settings, sink, 2, timeout_s=10)
    key = event_key("/tests", event.get_id())
    assert sorted(o["id"] for o in outputs) == sorted(
        derive_id(key, str(worker.id), i) for i in (0, 1)
    )
    assert {o["correlationid"] for o in outputs} == {"corr-1"}
    assert [o["data"]["input"] for o in outputs] == [{"n": 1}, {"n": 1}]
    eventually(lambda: Ledger(node_settings).pending(str(worker.id)) == 0, timeout_s=5)
    assert DeadLetters(node_settings).list() == []


def test_a_failing_worker_is_retried_with_backoff_then_dead_lettered(
    node: WorkController, manager: WorkManager, node_settings: Settings
) -> None:
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    alerts = manager.subscribe("in-dead", "alerts")
    base_ms = 200
    worker = manager.create_worker(
        code=stub(fail="boom"),
        mime_type=STUB,
        topic="in",
        settings={"max_retries": 2, "retry_base_delay_ms": base_ms},
    )
    queue = _consuming(node, worker)
    event = make_event("in", "/tests", {"n": 1})
    manager.publish(event)

    [alert] = drain(node_settings, alerts, 1, timeout_s=15)
    assert (alert["data"]["event_id"], alert["data"]["attempts"]) == (event.get_id(), 3)
    [letter] = DeadLetters(node_settings).list(worker_id=str(worker.id))
    assert (letter.error_type, letter.error_message, letter.attempts) == (
        "WorkerExecutionError",
        "boom",
        3,
    )
    assert json.loads(letter.envelope)["id"] == event.get_id()  # parked, not dropped
    events = drain(node_settings, lifecycle, 6, timeout_s=5)  # created … started, 3 errors
    errors = [e for e in events if e["type"] == ERROR_TYPE]
    assert [e["data"]["attempt"] for e in errors] == [1, 2, 3]
    # Retry n waits between half and all of base × 2^(n-1).
    gaps = [(_time(b) - _time(a)).total_seconds() for a, b in pairwise(errors)]
    assert gaps[0] >= base_ms / 2 / 1000 and gaps[1] >= base_ms / 1000, gaps
    assert manager.bus.queue_depth(queue) == 0
    assert Ledger(node_settings).pending(str(worker.id)) == 0


def test_a_malformed_payload_is_dead_lettered_at_once(
    node: WorkController, manager: WorkManager, node_settings: Settings
) -> None:
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(
        code=stub(output_type="done"),
        mime_type=STUB,
        topic="in",
        settings={"max_retries": 5, "retry_base_delay_ms": 20},
    )
    queue = _consuming(node, worker)
    payloads = ["this is not json", '{"specversion": "1.0", "type": "x"}']
    route = Route(queue, str(worker.id))
    for payload in payloads:
        manager.bus.send(payload, [route])

    letters = eventually(
        lambda: len(DeadLetters(node_settings).list()) == 2 and DeadLetters(node_settings).list(),
        timeout_s=10,
    )
    assert sorted(x.envelope for x in letters) == sorted(payloads)
    assert {(x.error_type, x.attempts) for x in letters} == {("EventDecodeError", 1)}
    assert "lacks required attribute(s): id, source" in " ".join(x.error_message for x in letters)
    # Never retried: a retry (20 ms away) would have run within this window, reported an
    # error and parked the letter again with attempts 2.
    assert [
        e for e in drain(node_settings, lifecycle, 50, timeout_s=0.5) if e["type"] == ERROR_TYPE
    ] == []
    assert {x.attempts for x in DeadLetters(node_settings).list()} == {1}
    assert manager.bus.queue_depth(queue) == 0
    assert Ledger(node_settings).pending(str(worker.id)) == 0


def test_deliveries_a_node_holds_for_a_deleted_worker_are_dead_lettered(
    node: WorkController, manager: WorkManager, node_settings: Settings
) -> None:
    """The node has taken both events off the queue (the second waits for the first, which
    is slow) when the worker is deleted: the second is parked as WorkerNotFound, not run."""
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=stub(output_type="done", sleep_ms=1000), mime_type=STUB, topic="in"
    )
    queue = _consuming(node, worker)
    first, second = (make_event("in", "/tests", {"n": n}) for n in (1, 2))
    manager.publish(first)
    manager.publish(second)
    eventually(lambda: manager.bus.queue_depth(queue) == 0, timeout_s=5, interval_s=0.01)
    manager.delete_worker(worker.id)

    [letter] = eventually(lambda: DeadLetters(node_settings).list(), timeout_s=10)
    assert (letter.event_id, letter.error_type, letter.attempts) == (
        second.get_id(),
        "WorkerNotFound",
        1,
    )
    assert f"worker {worker.id} does not exist" in letter.error_message
    assert json.loads(letter.envelope)["data"] == {"n": 2}
    [output] = drain(node_settings, sink, 1)  # the one already running finished first
    assert output["data"]["input"] == {"n": 1}


def test_a_count_of_runs_that_nothing_settles_ends(node_settings: Settings) -> None:
    """A redelivered event's runs are counted until it settles or its run ends. A run that
    raced its worker's delete (the ledger forgotten, then the run counted) is never settled:
    its count ends RUNS_TTL_S after the worker's latest run counted or start, instead of
    staying for ever."""
    ledger, client = Ledger(node_settings), redis_for(node_settings)
    worker = str(uuid.uuid4())
    runs = f"wm:pending:{{{worker}}}:runs"
    ledger.forget_worker(worker)
    assert ledger.begin_run(worker, "k1") == 1
    assert RUNS_TTL_S - 60 < client.ttl(runs) <= RUNS_TTL_S
    client.expire(runs, 10)
    assert ledger.begin_run(worker, "k2") == 1  # another run counted: the end moves on
    assert RUNS_TTL_S - 60 < client.ttl(runs) <= RUNS_TTL_S
    client.expire(runs, 10)
    ledger.restart_clocks(worker)  # the worker starts again: the end moves on too
    assert RUNS_TTL_S - 60 < client.ttl(runs) <= RUNS_TTL_S
    ledger.end_run(worker, "k1")
    ledger.settle(worker, "k2", "{}", ran_again=True)
    assert not client.exists(runs)


def test_a_delivery_pinned_to_a_missing_version_is_dead_lettered_at_once(
    node: WorkController, manager: WorkManager, node_settings: Settings
) -> None:
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(
        code=stub(output_type="done"),
        mime_type=STUB,
        topic="in",
        settings={"max_retries": 5, "retry_base_delay_ms": 20},
    )
    queue = _consuming(node, worker)
    event = make_event("in", "/tests", {"n": 1})
    manager.bus.send(encode(event), [Route(queue, str(worker.id))], kwargs={"pin_version": 7})

    [letter] = eventually(lambda: DeadLetters(node_settings).list(), timeout_s=10)
    assert (letter.event_id, letter.error_type, letter.attempts, letter.version) == (
        event.get_id(),
        "VersionNotFound",
        1,
        7,
    )
    events = drain(node_settings, lifecycle, 4, timeout_s=5)  # created … started, 1 error
    errors = [e for e in events if e["type"] == ERROR_TYPE]
    assert [(e["data"]["error_type"], e["data"]["attempt"]) for e in errors] == [
        ("VersionNotFound", 1)
    ]


def test_code_this_node_cannot_load_fails_the_worker_and_keeps_the_message(
    node: WorkController, manager: WorkManager, node_settings: Settings
) -> None:
    """Code accepted at create time that no longer loads (say, after an engine upgrade): the
    worker moves to ``failed``, the node stops consuming, and the event waits in the queue
    until the code is repaired and the worker started again."""
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    queue = _consuming(node, worker)
    with store.session_scope(node_settings) as session:
        session.execute(
            update(WorkerVersion)
            .where(WorkerVersion.worker_id == worker.id)
            .values(code=stub(output_type="done", retired_key=1))
        )
    manager.publish(make_event("in", "/tests", {"n": 1}))

    eventually(lambda: manager.get_worker(worker.id).status == Status.FAILED, timeout_s=10)
    eventually(
        lambda: (
            queue not in {q.name for q in node.consumer.task_consumer.queues}
            and manager.bus.queue_depth(queue) == 1
        ),
        timeout_s=10,
    )
    reason = manager.get_worker_transitions(worker.id)[-1].reason
    assert reason.startswith("InvalidCode:") and "retired_key" in reason
    assert DeadLetters(node_settings).list() == []

    manager.load_code_from_content(worker.id, stub(output_type="done"))
    manager.start_worker(worker.id)
    [output] = drain(node_settings, sink, 1, timeout_s=10)
    assert (output["data"]["input"], output["data"]["version"]) == ({"n": 1}, 2)


@pytest.mark.slow
def test_waiting_for_a_group_lock_is_no_failure_and_frees_the_pool(
    node: WorkController,
    manager: WorkManager,
    node_settings: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A group lock held (and renewed) elsewhere while a member's deliveries wait many times
    longer than its retries would last: they wait in the broker, so the node's one pool
    thread runs another worker's event meanwhile; no wait counts as a failure; once the lock
    is free one runs and the other fails and is retried exactly ``max_retries`` times."""
    caplog.set_level(logging.INFO, logger="celery.app.trace")
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    sink, free_sink = manager.subscribe("done", "sink"), manager.subscribe("free", "free-sink")
    grouped = manager.create_worker(
        code=stub(output_type="done", fail="boom", fail_if_data_has="poison"),
        mime_type=STUB,
        topic="in",
        group="busy",
        settings={"max_retries": 1, "retry_base_delay_ms": 20},
    )
    free = manager.create_worker(code=stub(output_type="free"), mime_type=STUB, topic="other")
    _consuming(node, grouped)
    _consuming(node, free)
    good, poison = make_event("in", "/tests", {"n": 1}), make_event("in", "/tests", {"poison": 1})

    def waits() -> int:
        return sum("LockContention" in r.getMessage() for r in caplog.records)

    with GroupLocks(node_settings).holding("busy", "operator-script", limit_s=60):
        manager.publish(good)
        manager.publish(poison)
        eventually(lambda: waits() >= 6, timeout_s=15, interval_s=0.02)
        manager.publish(make_event("other", "/tests", {"n": 2}))
        assert len(drain(node_settings, free_sink, 1, timeout_s=10)) == 1
        assert drain(node_settings, sink, 1, timeout_s=0.2) == []
        assert DeadLetters(node_settings).list() == []

    [output] = drain(node_settings, sink, 1, timeout_s=10)
    assert output["data"]["input"] == {"n": 1}
    [letter] = eventually(lambda: DeadLetters(node_settings).list(), timeout_s=10)
    assert (letter.event_id, letter.error_type, letter.attempts) == (
        poison.get_id(),
        "WorkerExecutionError",
        2,
    )
    errors = [
        e for e in drain(node_settings, lifecycle, 10, timeout_s=2) if e["type"] == ERROR_TYPE
    ]
    assert [e["data"]["attempt"] for e in errors] == [1, 2]  # the waits counted no attempt


def test_an_unknown_worker_id_is_dead_lettered_not_dropped(
    node: WorkController, manager: WorkManager, node_settings: Settings
) -> None:
    """A delivery naming a worker the store never had (say, sent by an old deployment)."""
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="in")
    queue = _consuming(node, worker)
    ghost = str(uuid.uuid4())
    event = make_event("in", "/tests", {"n": 1})
    manager.bus.send(encode(event), [Route(queue, ghost)])

    [letter] = eventually(lambda: DeadLetters(node_settings).list(), timeout_s=10)
    assert (letter.worker_id, letter.event_id, letter.error_type, letter.attempts) == (
        ghost,
        event.get_id(),
        "WorkerNotFound",
        1,
    )


def _count_sends(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """From now on, the command names of each send to Redis by the node's threads (not this
    one's), a new connection's handshake left out: one list per round trip."""
    sends: list[list[str]] = []
    real_send = redis.connection.AbstractConnection.send_packed_command
    main = threading.main_thread()

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        if threading.current_thread() is not main:
            names = [part.split(b"\r\n")[2].decode() for part in command if part[:1] == b"*"]
            if not set(names) <= HANDSHAKE:
                sends.append(names)
        real_send(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    return sends


def test_a_delivery_costs_two_redis_round_trips(
    node: WorkController,
    manager: WorkManager,
    node_settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One before the engine call (the worker's facts and the recorded outcome), one after
    (the outcome, its outputs' routes, the ledger): counted as the sends of the worker's
    threads (a new connection's handshake aside), for deliveries with an output to a topic
    nobody subscribes to."""
    worker = manager.create_worker(
        code=stub(output_type="nobody.listens"), mime_type=STUB, topic="in"
    )
    _consuming(node, worker)
    manager.publish(make_event("in", "/tests", {"n": 0}))  # warm: engine loaded, cache filled
    eventually(lambda: Ledger(node_settings).pending(str(worker.id)) == 0, timeout_s=5)
    sends = _count_sends(monkeypatch)
    for n in range(1, 11):
        manager.publish(make_event("in", "/tests", {"n": n}))
    eventually(lambda: manager.bus.dropped("nobody.listens") == 11, timeout_s=10)
    eventually(lambda: Ledger(node_settings).pending(str(worker.id)) == 0, timeout_s=5)
    assert len(sends) == 20, sends
    dropped = topic_key("nobody.listens", DROPPED)  # the outputs' drops, counted with an end
    assert 0 < redis_for(node_settings).ttl(dropped) <= DROPPED_TTL_S


def test_a_delivery_in_a_group_costs_three_redis_round_trips(
    node: WorkController,
    manager: WorkManager,
    node_settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's facts; the lock taken with the recorded outcome read in its script; the
    outcome recorded in a script that checks the fence first, with the release behind it in
    the same round trip (nothing is left to do under the lease). Counted as in the test
    above, for deliveries without outputs, and each group's lock is free again."""
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="in", group="g")
    _consuming(node, worker)
    ledger = Ledger(node_settings)
    manager.publish(make_event("in", "/tests", {"n": 0}))  # warm: engine loaded, cache filled
    eventually(lambda: ledger.pending(str(worker.id)) == 0, timeout_s=5)
    sends = _count_sends(monkeypatch)
    for n in range(1, 11):
        manager.publish(make_event("in", "/tests", {"n": n}))
    eventually(lambda: ledger.pending(str(worker.id)) == 0, timeout_s=10)
    eventually(lambda: GroupLocks(node_settings).holder("g") is None, timeout_s=5)
    assert len(sends) == 30, sends
    assert [names[0] for names in sends[:3]] == ["MGET", "EVALSHA", "EVAL"], sends


def test_a_delivery_without_a_group_runs_four_redis_commands(
    node: WorkController, manager: WorkManager, node_settings: Settings
) -> None:
    """MGET (the worker's facts, their generation, the recorded outcome) before the engine
    call; after it one script: SET NX of the outcome and ZREM of the pending entry.
    Counted on the server (``INFO commandstats``, which counts a script's commands too)."""
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="in")
    _consuming(node, worker)
    manager.publish(make_event("in", "/tests", {"n": 0}))  # warm: engine loaded, cache filled
    ledger = Ledger(node_settings)
    eventually(lambda: ledger.pending(str(worker.id)) == 0, timeout_s=5)
    server = redis.Redis.from_url(node_settings.redis_url)
    before, started = command_calls(server), time.monotonic()
    for n in range(1, 11):
        manager.publish(make_event("in", "/tests", {"n": n}))
    eventually(lambda: ledger.pending(str(worker.id)) == 0, timeout_s=5)
    spent, took_s = command_calls(server) - before, time.monotonic() - started
    # the publisher's share: one script by its hash, the routes (EXISTS, HGETALL) and the
    # ledger's ZADD
    publisher = Counter({"evalsha": 10, "exists": 10, "hgetall": 10, "zadd": 10})
    # and what is no delivery's: polls, and the handshake of a connection a thread of the
    # node opens meanwhile (its engine-command listener's, wm.dataplane.enginecontrol)
    polls = {"zcard", "info", *(command.lower() for command in HANDSHAKE)}
    node_side = Counter({k: v for k, v in (spent - publisher).items() if k not in polls})
    # the health tally (wm.state.health): its counts and their end, at most once a second
    # (one process), in the record's round trip
    for command in ("hincrby", "expire"):
        assert node_side[command] <= math.ceil(took_s) + 1, spent
        del node_side[command]
    assert node_side == Counter({"mget": 10, "eval": 10, "set": 10, "zrem": 10}), spent


def test_a_delivery_without_outputs_does_not_wait_for_its_record(
    node: WorkController,
    manager: WorkManager,
    node_settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With nothing to publish, the record is sent and the delivery goes on: its reply is read
    at the thread's next record (``wm.state.unawaited``). Once the ledger is settled (every
    record ran), the last one's reply is still unread; every outcome is recorded. An ordered
    key's delivery waits for it: its turn moves on only once its outcome is written."""
    monkeypatch.setattr(UNAWAITED, "idle_s", 3600.0)  # no reply read by the reader thread
    plain = manager.create_worker(code=stub(), mime_type=STUB, topic="in")
    ordered = manager.create_worker(
        code=stub(), mime_type=STUB, topic="in.ordered", settings={"ordering": "key"}
    )
    for worker in (plain, ordered):
        _consuming(node, worker)
    events = [make_event("in", "/tests", {"n": n}) for n in range(10)]
    for event in events:
        manager.publish(event)
    ledger = Ledger(node_settings)
    eventually(lambda: ledger.pending(str(plain.id)) == 0, timeout_s=10)
    assert [w for w in UNAWAITED.unread() if f"of worker {plain.id}" in w], UNAWAITED.unread()
    server = redis.Redis.from_url(node_settings.redis_url)
    keys = [Outcomes.key(str(plain.id), event_key("/tests", e.get_id())) for e in events]
    assert server.mget(keys) == [b"[]"] * len(events)

    key = {"partitionkey": "k"}
    for n in range(3):
        manager.publish(make_event("in.ordered", "/tests", {"n": n}, extensions=key))
    eventually(lambda: ledger.pending(str(ordered.id)) == 0, timeout_s=10)
    assert not [w for w in UNAWAITED.unread() if f"of worker {ordered.id}" in w]


#: What redis-py sends when it opens a connection.
HANDSHAKE = {"HELLO", "AUTH", "CLIENT", "SELECT", "PING"}


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """OpenTelemetry's SDK, recording in memory (set once: the API allows one provider per
    process; later in-process deliveries record spans too, which no other test reads)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def test_one_trace_follows_an_event_through_two_workers_in_a_chain(
    node: WorkController, manager: WorkManager, node_settings: Settings, spans: Any
) -> None:
    """caller → publish → deliver (first worker: engine call, output publish) → deliver
    (second worker, in a group: lock wait, engine call, output publish), linked through the
    events' traceparent; the last output carries the second delivery's context."""
    sink = manager.subscribe("chain.out", "sink")
    first = manager.create_worker(
        code=stub(output_type="chain.mid"), mime_type=STUB, topic="chain.in", name="first"
    )
    second = manager.create_worker(
        code=stub(output_type="chain.out"), mime_type=STUB, topic="chain.mid", group="g"
    )
    _consuming(node, first)
    _consuming(node, second)
    spans.clear()
    with trace.get_tracer("tests").start_as_current_span("caller") as caller:
        manager.publish(make_event("chain.in", "/tests", {"n": 1}))
    [output] = drain(node_settings, sink, 1, timeout_s=10)
    finished = eventually(
        lambda: (found := spans.get_finished_spans()) and len(found) >= 9 and found
    )
    trace_id = caller.get_span_context().trace_id
    assert {s.context.trace_id for s in finished} == {trace_id}
    named = {}
    for span in finished:
        named.setdefault(span.name, []).append(span)
    parent = {span.context.span_id: span for span in finished}

    def parent_name(span: Any) -> str:
        return parent[span.parent.span_id].name

    [publish] = named["publish chain.in"]
    [deliver_first] = named["deliver chain.in"]
    [deliver_second] = named["deliver chain.mid"]
    [lock_wait] = named["lock wait"]
    assert parent_name(publish) == "caller"
    assert parent_name(deliver_first) == "publish chain.in"
    assert parent_name(deliver_second) == "deliver chain.in"
    assert parent_name(lock_wait) == "deliver chain.mid"
    assert sorted(parent_name(s) for s in named["engine call"]) == [
        "deliver chain.in",
        "deliver chain.mid",
    ]
    assert sorted(parent_name(s) for s in named["output publish"]) == [
        "deliver chain.in",
        "deliver chain.mid",
    ]
    assert deliver_first.attributes["workmanager.worker"] == "first"
    _, trace_hex, span_hex, _ = output["traceparent"].split("-")
    assert (int(trace_hex, 16), int(span_hex, 16)) == (trace_id, deliver_second.context.span_id)


# -- the task message's format and the pipeline's features ---------------------------------


def test_a_message_of_the_first_format_is_still_delivered(
    node: WorkController, manager: WorkManager, node_settings: Settings, tmp_path: Path
) -> None:
    """Release 0.1 sent the retry state as five keyword arguments: a node of this release
    reads them, and what it sends again carries them in format 2 (one ``state``)."""
    sink, runs = manager.subscribe("done", "sink"), tmp_path / "runs.jsonl"
    worker = manager.create_worker(
        code=stub(output_type="done", fail="boom", fail_runs=1, trace=str(runs)),
        mime_type=STUB,
        topic="in",
        settings={"max_retries": 3, "retry_base_delay_ms": 20},
    )
    queue = _consuming(node, worker)
    event = make_event("in", "/tests", {"n": 1})
    first_failure_at = time.time() - 60
    legacy = {
        "pin_version": 1,
        "first_failure_at": first_failure_at,
        "lock_waits": 0,
        "waiting_since": None,
        "seq": None,
    }
    manager.bus.send(encode(event), [Route(queue, str(worker.id))], kwargs=legacy)

    [output] = drain(node_settings, sink, 1, timeout_s=10)
    assert output["data"]["input"] == {"n": 1}
    assert len(runs.read_text().splitlines()) == 2  # failed once, then ran from format 2
    assert DeadLetters(node_settings).list() == []


def test_the_delivery_state_reads_both_formats_and_writes_the_second() -> None:
    legacy = {"pin_version": 3, "first_failure_at": 1.5, "lock_waits": 2, "waiting_since": 1.0}
    state = DeliveryState.read(None, {**legacy, "seq": 7})
    assert state == DeliveryState(3, 7, 1.5, 2, 1.0)
    assert state.kwargs() == {
        "state": {
            "v": 2,
            "pin_version": 3,
            "seq": 7,
            "first_failure_at": 1.5,
            "lock_waits": 2,
            "waiting_since": 1.0,
        }
    }
    assert DeliveryState.read(state.wire(), {}) == state
    assert DeliveryState.read(None, {}) == DeliveryState()
    with pytest.raises(InvalidArgument, match="unknown delivery state colour"):
        DeliveryState.read({"v": 2, "colour": "red"}, {})


def test_a_delivery_enters_the_contexts_of_the_features_its_worker_uses_only(
    monkeypatch: pytest.MonkeyPatch,
    node: WorkController,
    manager: WorkManager,
    node_settings: Settings,
) -> None:
    """A feature with nothing to do for a delivery answers ``NOTHING``, which costs the
    pipeline no context: a plain worker's delivery enters none, one with a group and a
    max_events quota enters the group lock's and the quota's (no observer, no tracing)."""
    entered: list[list[object]] = []
    enter = pipeline.enter

    def counting(stack: contextlib.ExitStack, context: Any) -> Any:
        if context is not pipeline.NOTHING:
            entered[-1].append(context)
        return enter(stack, context)

    monkeypatch.setattr(pipeline, "enter", counting)
    monkeypatch.setattr(observe, "_observers", [])
    monkeypatch.setattr(tracing, "enabled", lambda: False)
    sink = manager.subscribe("done", "sink")
    plain = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    grouped = manager.create_worker(
        code=stub(output_type="done"),
        mime_type=STUB,
        topic="in.quota",
        group="g",
        settings={"max_events": 5},
    )
    for worker in (plain, grouped):
        _consuming(node, worker)
        entered.append([])
        manager.publish(make_event(worker.topic, "/t", {"n": 1}))
        drain(node_settings, sink, 1, timeout_s=10)
    assert [len(contexts) for contexts in entered] == [0, 2], entered


class Quarantine(Feature):
    """An example feature, as a deployment would add one: events whose data says
    ``"quarantine": true`` are parked before they run, every verdict is remembered, and a
    Redis key of the worker is read in the delivery's first round trip."""

    def __init__(self) -> None:
        self.verdicts: list[tuple[str, str]] = []
        self.seen: list[object] = []

    def facts_key(self, worker_id: str) -> str:
        return f"wm:test-quarantine:{{{worker_id}}}"

    def facts(self, worker_id: str) -> Sequence[str]:  # type: ignore[override]
        return (self.facts_key(worker_id),)

    @contextlib.contextmanager
    def admit(self, delivery: Delivery) -> Iterator[None]:
        self.seen.append(delivery.facts[self.facts_key(delivery.meta.id)])
        data = delivery.event.get_data()
        if isinstance(data, dict) and data.get("quarantine"):
            raise Park(delivery.failure(ValueError("quarantined by the example feature")))
        yield

    def ended(self, delivery: Delivery, verdict: Verdict) -> None:
        self.verdicts.append((delivery.event.get_id(), type(verdict).__name__))


@pytest.fixture
def quarantine(monkeypatch: pytest.MonkeyPatch) -> Quarantine:
    """The example feature, one line in the feature list (first: around everything)."""
    feature = Quarantine()
    monkeypatch.setattr(tasks, "PIPELINE", Pipeline((feature, *FEATURES)))
    return feature


def test_a_feature_is_one_module_and_one_line_in_the_list(
    quarantine: Quarantine,
    node: WorkController,
    manager: WorkManager,
    node_settings: Settings,
) -> None:
    redis_state = redis.Redis.from_url(node_settings.redis_url)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    _consuming(node, worker)
    redis_state.set(quarantine.facts_key(str(worker.id)), "seen")
    good, bad = make_event("in", "/t", {"n": 1}), make_event("in", "/t", {"quarantine": True})
    manager.publish(good)
    manager.publish(bad)

    [output] = drain(node_settings, sink, 1, timeout_s=10)
    assert output["data"]["input"] == {"n": 1}
    [letter] = eventually(lambda: DeadLetters(node_settings).list(), timeout_s=10)
    assert (letter.event_id, letter.error_type) == (bad.get_id(), "ValueError")
    assert "quarantined by the example feature" in letter.error_message
    eventually(lambda: len(quarantine.verdicts) == 2, timeout_s=5)
    assert sorted(quarantine.verdicts) == sorted([(good.get_id(), "Done"), (bad.get_id(), "Park")])
    assert quarantine.seen == [b"seen", b"seen"]
