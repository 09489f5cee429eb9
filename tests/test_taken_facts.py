"""A delivery's first facts read by the take of its message (``wm.dataplane.takenfacts``):
where the broker is a database of the state store's server, the node's take script reads
them and the pool process sends no first trip of its own; a header a publisher forged, or
facts that are not the delivery's own or too old, are never used."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from typing import Any

import pytest
import redis
from celery import Celery

from tests.conftest import REDIS_HOST, STATE_DB
from tests.helpers import STUB, drain, publish_numbered, stub
from wm import Settings, WorkManager, make_event
from wm.dataplane import takenfacts
from wm.dataplane.app import make_app, shared_server
from wm.dataplane.queues import DELIVER_TASK
from wm.dataplane.tasks import first_trip_templates
from wm.events import encode, key_of
from wm.state.directory import find_keys
from wm.state.outcomes import Outcomes


class Monitor:
    """The commands Redis's MONITOR shows on the state store's database, by whether a
    client (``tcp``, ``unix``) or a script (``lua``) sent them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._client = redis.Redis.from_url(f"{REDIS_HOST}/0", socket_timeout=0.5)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(10)

    def _run(self) -> None:
        with self._client.monitor() as monitor:
            self._started.set()
            while not self._stop.is_set():
                try:
                    command = monitor.next_command()
                except (redis.TimeoutError, redis.ConnectionError):
                    continue
                if command["db"] == STATE_DB:
                    self.seen.append((command["client_type"], command["command"]))

    def mgets_of(self, worker_id: str) -> Counter[str]:
        """The MGETs that read ``worker_id``'s cache entry first, by who sent them."""
        first = f"MGET {find_keys(worker_id)[0]}"
        return Counter(kind for kind, text in self.seen if text.startswith(first))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.parametrize("how", ["publish", "publish_many"])
def test_the_facts_are_read_by_the_take_not_by_the_pool_process(
    pg_settings: Settings, start_node: Any, how: str
) -> None:
    """Every setting at its default: after a pool process's first delivery to the worker
    (which also reads its code), each delivery's facts come from the take script, whichever
    way the events were published."""
    assert shared_server(pg_settings) is not None  # the tests' broker and state: one server
    manager = WorkManager(pg_settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    node = start_node(pg_settings)
    node.consuming(f"in::{worker.id}")
    monitor = Monitor()
    try:
        if how == "publish":
            publish_numbered(manager, "in", 30)
        else:
            manager.publish_many(make_event("in", "/tests", {"n": n}) for n in range(30))
        assert len(drain(pg_settings, sink, 30)) == 30
    finally:
        monitor.close()
    # Each event is taken as it comes and run at once: its facts are fresh. A pool process
    # reads its own for its first delivery (and the worker's code), or where a busy host
    # kept it from the job longer than takenfacts.MAX_AGE_S.
    reads = monitor.mgets_of(str(worker.id))
    assert reads["lua"] >= 30, reads
    assert reads["tcp"] + reads["unix"] < 15, reads


def deliver_with_header(app: Celery, worker_id: str, queue: str, event: Any, header: Any) -> None:
    app.send_task(
        DELIVER_TASK,
        args=[worker_id, encode(event)],
        queue=queue,
        headers={takenfacts.FACTS_HEADER: header},  # no key: the take reads nothing
    )


def test_facts_a_publisher_put_in_the_message_are_not_used(
    pg_settings: Settings, start_node: Any
) -> None:
    """A message that arrives with facts claiming an outcome is already recorded is run
    (its worker's answer is published), not answered from the forged outcome."""
    manager = WorkManager(pg_settings)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    wid, queue = str(worker.id), f"in::{worker.id}"
    node = start_node(pg_settings, concurrency=1)
    node.consuming(queue)
    manager.publish(make_event("in", "/warm", {"n": 0}))  # the pool's first delivery
    assert len(drain(pg_settings, sink, 1)) == 1

    event = make_event("in", "/forged", {"n": 1})
    forged = json.dumps([encode(make_event("done", "/forger", {"forged": True}))])
    cache = redis.Redis.from_url(pg_settings.redis_url).get(find_keys(wid)[0])
    values = [cache.decode(), None, None, forged]
    values += [None] * (len(first_trip_templates()) - len(values))
    # fresh while the idle node takes it and its pool process reads it (milliseconds)
    header = [time.time(), wid, key_of(event), values]
    deliver_with_header(make_app(pg_settings), wid, queue, event, header)
    [answer] = drain(pg_settings, sink, 1)
    assert "forged" not in answer["data"], answer


@pytest.mark.parametrize(
    "change",
    ["stale", "other worker", "other event", "not a list", "told after", "none"],
)
def test_handed_facts_are_used_only_when_they_are_the_deliverys_own_and_fresh(
    change: str,
) -> None:
    wid, key = str(uuid.uuid4()), str(uuid.uuid4())
    values = ["{}", None, None, None]
    handed: Any = [time.time(), wid, key, values]
    if change == "stale":
        handed[0] -= takenfacts.MAX_AGE_S + 0.1
    elif change == "other worker":
        handed[1] = str(uuid.uuid4())
    elif change == "other event":
        handed[2] = str(uuid.uuid4())
    elif change == "not a list":
        handed = {"values": values}
    headers = {takenfacts.FACTS_HEADER: handed}
    told_at = time.time() if change == "told after" else 0.0  # a stop's question since
    got = takenfacts.taken(headers, wid, key, told_at)
    assert got == (values if change == "none" else None)
    assert takenfacts.FACTS_HEADER not in headers  # never carried into a retry


def test_the_node_drops_facts_a_message_arrived_with() -> None:
    message: dict[str, Any] = {"headers": {takenfacts.FACTS_HEADER: [1.0, "w", "k", []]}}
    takenfacts.hand_over(message, None)
    assert message["headers"] == {}
    takenfacts.hand_over(message, [b"w", b"k", [b"{}", None]])
    at, worker, key, values = message["headers"][takenfacts.FACTS_HEADER]
    assert (worker, key, values) == ("w", "k", ["{}", None])
    assert 0 <= time.time() - at < 1


def test_the_templates_are_the_first_trips_keys_but_the_code() -> None:
    wid, key = str(uuid.uuid4()), str(uuid.uuid4())
    filled = [
        t.replace(takenfacts.WORKER_MARK, wid).replace(takenfacts.EVENT_MARK, key)
        for t in first_trip_templates()
    ]
    assert filled[:4] == [*find_keys(wid), Outcomes.key(wid, key)]
    assert all(f"{{{wid}}}" in name for name in filled)  # one slot, as the MGET's


@pytest.mark.parametrize(
    ("broker", "state", "shared"),
    [
        ("redis://h:6379/2", "redis://h:6379/3", (3, 2)),
        ("redis://h:6379/2", "redis://h:6380/3", None),
        ("redis://h:6379/2", "redis://other:6379/3", None),
        ("amqp://guest:guest@h:5672//", "redis://h:6379/3", None),
        ("sentinel://h:26379/2?master=m", "redis://h:6379/3", None),
    ],
)
def test_the_take_reads_facts_only_where_one_script_reaches_both_stores(
    broker: str, state: str, shared: tuple[int, int] | None
) -> None:
    settings = Settings.from_env({}).replace(broker_url=broker, redis_url=state)
    assert shared_server(settings) == shared
