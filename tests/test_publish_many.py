"""``publish_many``: a batch of events published with one round trip for the routes and the
pending ledger and one pipelined write to the broker per batch, with every guarantee of
``publish`` (issue 26, build 4)."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from typing import Any

import pytest

from tests.helpers import STUB, drain, eventually, free_port, queue_empty, stub
from wm import BrokerUnavailable, InvalidArgument, PublishInterrupted, Settings, WorkManager
from wm.control.publishing import checked
from wm.dataplane.outgoing import PUBLISH_BATCH
from wm.dataplane.routes import DROPPED, DROPPED_TTL_S, topic_key
from wm.events import make_event
from wm.state.connection import redis_for
from wm.state.ledger import Ledger

KEYS = ("alpha", "beta", "gamma")


@pytest.fixture(params=["redis", "amqp"])
def broker(request: pytest.FixtureRequest, pg_settings: Settings) -> Settings:
    """Settings on each broker, every setting else at its default."""
    if request.param == "redis":
        return pg_settings
    return request.getfixturevalue("amqp_settings")


@pytest.mark.slow
def test_publish_many_delivers_every_event_once_to_every_subscriber_in_key_order(
    broker: Settings, start_node: Any, rng: random.Random
) -> None:
    """Several batches, to a plain subscription, a worker and an ordered worker:
    each event reaches each once, and the ordered worker runs each key's events in the order
    given (its sequence numbers were taken in the batch's one script)."""
    topic, done = f"many.{uuid.uuid4().hex[:8]}", f"done.{uuid.uuid4().hex[:8]}"
    manager = WorkManager(broker)
    tap, sink = manager.subscribe(topic, "tap"), manager.subscribe(done, "sink")
    plain = manager.create_worker(code=stub(output_type=done), mime_type=STUB, topic=topic)
    keyed = manager.create_worker(
        code=stub(output_type=done), mime_type=STUB, topic=topic, settings={"ordering": "key"}
    )
    count, batch = 60, 25  # three batches
    keys = [rng.choice(KEYS) for _ in range(count)]
    events = [
        make_event(topic, "/tests", {"n": n, "key": key}, extensions={"partitionkey": key})
        for n, key in enumerate(keys)
    ]
    try:
        assert manager.bus.publish_many(checked(events), batch=batch) == [3] * count
        node = start_node(broker)
        for worker in (plain, keyed):
            node.consuming(f"{topic}::{worker.id}")
        tapped = drain(broker, tap, count, timeout_s=60)
        assert [e["data"]["n"] for e in tapped] == list(range(count))  # once each, in order
        outputs = drain(broker, sink, 2 * count, timeout_s=240)
        runs = Counter((o["source"], o["data"]["input"]["n"]) for o in outputs)
        assert set(runs.values()) == {1} and len(runs) == 2 * count
        assert queue_empty(broker, tap) and queue_empty(broker, sink)
        ordered = [o["data"]["input"] for o in outputs if o["source"] == f"/workers/{keyed.id}"]
        for key in KEYS:
            in_order = [i["n"] for i in ordered if i["key"] == key]
            assert in_order == [n for n, k in enumerate(keys) if k == key], key
        ledger = Ledger(broker)
        eventually(
            lambda: (
                ledger.pending_of([str(plain.id), str(keyed.id)])
                == {
                    str(plain.id): 0,
                    str(keyed.id): 0,
                }
            )
        )
    finally:
        for worker in (plain, keyed):
            manager.delete_worker(worker.id)
        manager.unsubscribe(topic, "tap")
        manager.unsubscribe(done, "sink")


def _refusing(settings: Settings) -> Settings:
    """``settings`` with a broker of the same kind on a port nothing listens on."""
    scheme, _, rest = settings.broker_url.partition("://")
    credentials = rest.rpartition("@")[0]
    at = f"{credentials}@" if credentials else ""
    path = "/0" if scheme.startswith("redis") else "//"
    return settings.replace(broker_url=f"{scheme}://{at}127.0.0.1:{free_port()}{path}")


def test_a_publish_many_the_broker_refused_leaves_nothing_behind(broker: Settings) -> None:
    """The refused batch withdraws the ledger entries it wrote and says that none of its
    events was published."""
    topic = f"many.{uuid.uuid4().hex[:8]}"
    manager = WorkManager(broker)
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic=topic)
    refused = WorkManager(_refusing(broker))
    try:
        events = [make_event(topic, "/tests", {"n": n}) for n in range(PUBLISH_BATCH + 3)]
        with pytest.raises(PublishInterrupted, match="unreachable") as raised:
            refused.publish_many(events)
        assert isinstance(raised.value, BrokerUnavailable)
        assert (raised.value.sent, raised.value.reached) == (0, [])
        assert "the first 0 of 503 events were published" in str(raised.value)
        assert Ledger(broker).pending(str(worker.id)) == 0
        assert manager.bus.queue_depth(f"{topic}::{worker.id}") == 0
    finally:
        manager.delete_worker(worker.id)


def test_a_bad_event_is_named_by_its_index_and_nothing_is_sent(pg_settings: Settings) -> None:
    manager = WorkManager(pg_settings)
    queue = manager.subscribe("many.bad", "tap")
    good = make_event("many.bad", "/tests", None)
    with pytest.raises(InvalidArgument, match=r"^event 1: not a CloudEvent but dict"):
        manager.publish_many([good, {"type": "many.bad"}, good])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match=r"^event 2: .*topic"):
        manager.publish_many([good, good, make_event("a::b", "/tests", None)])
    assert manager.bus.queue_depth(queue) == 0
    assert manager.publish_many([]) == []
    assert manager.publish_many([good, make_event("nobody.hears", "/t", None)]) == [1, 0]
    assert manager.bus.dropped("nobody.hears") == 1  # counted, not lost silently
    assert 0 < redis_for(pg_settings).ttl(topic_key("nobody.hears", DROPPED)) <= DROPPED_TTL_S
    assert len(drain(pg_settings, queue, 2, timeout_s=5)) == 1


def test_a_route_added_between_two_batches_gets_the_second(pg_settings: Settings) -> None:
    """No routes are cached: a subscription made after one batch receives the next."""
    manager = WorkManager(pg_settings)
    first = manager.subscribe("many.late", "first")
    batch = [make_event("many.late", "/tests", {"n": n}) for n in range(3)]
    assert manager.publish_many(batch) == [1, 1, 1]
    second = manager.subscribe("many.late", "second")
    assert manager.publish_many(batch) == [2, 2, 2]
    assert len(drain(pg_settings, first, 7, timeout_s=5)) == 6
    assert len(drain(pg_settings, second, 4, timeout_s=5)) == 3
