"""Outputs to topics without worker subscribers, pushed in their record's round trip with no
reply read (``wm.dataplane.outputs``, ``wm.state.unawaited``): what the push does when the
process's view of the topic was out of date, and a worker subscribing while outputs stream."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import STUB, drain, eventually, publish_numbered, queue_empty, stub
from wm import Settings, WorkManager, make_event
from wm.dataplane import outputs
from wm.dataplane.bus import Route
from wm.dataplane.outputs import OutputPublisher
from wm.dataplane.routes import READY, topic_key
from wm.events import CloudEvent, derive_id, encode, event_key, key_of
from wm.state.connection import redis_for
from wm.state.ledger import Ledger
from wm.state.outcomes import Outcomes
from wm.state.unawaited import UNAWAITED

TOPIC = "quiet.done"


class Deliveries:
    """Deliveries of one worker, recorded as a pool process records them: the outcome with
    its output's push folded behind it, the reply read or not."""

    def __init__(self, settings: Settings, publisher: OutputPublisher) -> None:
        self.publisher, self.worker = publisher, str(uuid.uuid4())
        self.outcomes, self.ledger = Outcomes(settings), Ledger(settings)

    def output(self, n: int) -> tuple[str, str, CloudEvent]:
        """A pending delivery's (key, payload) and its output."""
        event = make_event("quiet", "/tests", {"n": n})
        key, payload = key_of(event), encode(event)
        self.ledger.add([(self.worker, "quiet::w")], key, payload)
        output = make_event(TOPIC, "/w", {"n": n}, id=derive_id(key, self.worker, 0))
        return key, payload, output

    def deliver(
        self, n: int, unread: bool, prepared: tuple[str, str, CloudEvent] | None = None
    ) -> tuple[str, list[Any]]:
        key, payload, output = prepared or self.output(n)
        texts = [encode(output)]
        body = self.outcomes.encoded([output], texts)
        settlement = self.ledger.settlement(self.worker, key, payload)
        fold = self.publisher.folded(
            [output], texts, Outcomes.key(self.worker, key), body, settlement if unread else None
        )
        outcome, found = self.outcomes.record(
            self.worker, key, [output], settlement, fold, body=body, unread=1 if unread else None
        )
        assert outcome == [output]
        if not unread:
            self.publisher.looked_up([output], found, folded=True)
        UNAWAITED.settle()
        return key, found

    def owed(self) -> set[str]:
        """The keys of the deliveries due at the sweep's next turn."""
        pending = self.ledger.overdue(self.worker, 3600)
        scores = redis_for(self.ledger.settings)
        index = Ledger._index(self.worker)
        return {p.key for p in pending if scores.zscore(index, p.member) == 0}


def test_a_push_whose_reply_is_not_read_owes_the_delivery_wherever_more_was_to_do(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process learns from a reply it reads that the topic has no worker subscriber;
    for a second then it reads no reply, and the push alone delivers to the plain
    subscriptions. Where the topic has a worker subscriber after all, its routes must be
    loaded or another outcome was recorded first, the push puts the delivery back in the
    ledger, due at the sweep's next turn (which republishes the outcome recorded)."""
    manager = WorkManager(settings)
    sink = manager.subscribe(TOPIC, "sink")
    publisher = OutputPublisher(manager.bus)
    deliveries = Deliveries(settings, publisher)
    probe = [make_event(TOPIC, "/w", {})]
    assert not publisher.quiet(probe)  # nothing learnt yet
    # the routes not loaded: the push did nothing (the delivery then publishes, loading them)
    assert deliveries.deliver(-1, unread=False)[1] == [None]
    assert not publisher.quiet(probe)
    assert manager.bus.routes(TOPIC) == [Route(sink, None)]
    _, found = deliveries.deliver(0, unread=False)
    assert len(found) == 1 and publisher.quiet(probe)
    _, found = deliveries.deliver(1, unread=True)
    assert found == []  # nothing read
    assert [e["data"]["n"] for e in drain(settings, sink, 2)] == [0, 1]
    assert deliveries.ledger.pending(deliveries.worker) == 0  # both settled, none owed

    # a worker subscribes: the process does not know it yet
    manager.bus.add_route(TOPIC, Route(f"{TOPIC}::late", str(uuid.uuid4())))
    late, _ = deliveries.deliver(2, unread=True)
    assert deliveries.owed() == {late}
    assert [e["data"]["n"] for e in drain(settings, sink, 1)] == [2]  # plain: pushed already

    # another outcome recorded first (a copy that ran alongside): owed, the sweep republishes it
    prepared = key, payload, output = deliveries.output(3)
    first = make_event(TOPIC, "/first", {}, id=output.get_id())
    settlement = deliveries.ledger.settlement(deliveries.worker, key, payload)
    deliveries.outcomes.record(deliveries.worker, key, [first], settlement)
    deliveries.ledger.add([(deliveries.worker, "quiet::w")], key, payload)  # sent again
    raced, _ = deliveries.deliver(3, unread=True, prepared=prepared)
    assert deliveries.owed() == {late, raced}

    # no outcome at all (the record failed: its own reply decides): nothing pushed, none owed
    key, payload, output = deliveries.output(7)
    texts = [encode(output)]
    settlement = deliveries.ledger.settlement(deliveries.worker, key, payload)
    fold = publisher.folded(
        [output], texts, Outcomes.key(deliveries.worker, key), encode(output), settlement
    )
    pipe = redis_for(settings).pipeline(transaction=False)
    fold(pipe)
    assert pipe.execute() == [None]
    assert deliveries.owed() == {late, raced}

    # routes to load (their flag ended): nothing pushed, the delivery owed
    redis_for(settings).delete(topic_key(TOPIC, READY))
    unloaded, _ = deliveries.deliver(4, unread=True)
    assert deliveries.owed() == {late, raced, unloaded}
    assert queue_empty(settings, sink, 0.5)

    # a reply read says there are workers: the process reads the replies again
    manager.bus.rebuild_routes(TOPIC)
    manager.bus.add_route(TOPIC, Route(f"{TOPIC}::late", str(uuid.uuid4())))
    deliveries.deliver(5, unread=False)
    assert not publisher.quiet(probe)

    # and what it learnt ends: a subscriber is found within QUIET_S
    monkeypatch.setattr(outputs, "QUIET_S", 0.2)
    manager.bus.rebuild_routes(TOPIC)  # the plain subscription alone
    deliveries.deliver(6, unread=False)
    assert publisher.quiet(probe)
    time.sleep(0.3)
    assert not publisher.quiet(probe)


@pytest.mark.slow
def test_with_the_defaults_a_worker_subscribing_while_outputs_stream_gets_every_later_one(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """Every setting at its default. Events stream to a worker whose outputs go to a topic
    with a plain subscription and no worker subscriber, so its pool processes push them
    without reading the replies. A worker subscribes to that topic meanwhile: it gets the
    output of every event published after its creation, those pushed by a process that did
    not know of it yet from the sweep (the push put their deliveries back in the ledger, due
    at once); the plain subscription gets each output once."""
    manager = WorkManager(pg_settings)
    sink = manager.subscribe(TOPIC, "sink")
    source = manager.create_worker(code=stub(output_type=TOPIC), mime_type=STUB, topic="quiet")
    node = start_node(pg_settings)
    node.consuming(f"quiet::{source.id}")
    published: list[str] = []
    stop = threading.Event()

    def stream() -> None:
        publisher = WorkManager(pg_settings)
        while not stop.is_set():
            published.extend(publish_numbered(publisher, "quiet", 1))
            time.sleep(0.005)

    thread = threading.Thread(target=stream, name="stream")
    thread.start()
    lates: list[tuple[str, Path, int]] = []  # each late worker: id, trace, events before it
    index, owed = Ledger._index(str(source.id)), set()
    try:
        time.sleep(3)  # both pool processes learn the topic is quiet
        while not owed and len(lates) < 3:  # a node stalled past the second: try once more
            trace = tmp_path / f"late{len(lates)}.jsonl"
            late = manager.create_worker(code=stub(trace=str(trace)), mime_type=STUB, topic=TOPIC)
            lates.append((str(late.id), trace, len(published)))
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:  # deliveries owed to it, due at once
                owed |= set(redis_for(pg_settings).zrangebyscore(index, 0, 0))
                time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    assert owed, "no push found a late worker in three tries: nothing tested the race"

    def ran(trace: Path) -> set[str]:
        lines = trace.read_text().splitlines() if trace.exists() else []
        return {json.loads(line)["event_id"] for line in lines}

    for late_id, trace, mark in lates:
        node.consuming(f"{TOPIC}::{late_id}")
        later = {derive_id(event_key("/tests", i), str(source.id), 0) for i in published[mark:]}
        eventually(lambda t=trace, e=later: e <= ran(t), timeout_s=90, interval_s=0.5)
    outputs_seen = drain(pg_settings, sink, len(published), timeout_s=60)
    ids = [e["id"] for e in outputs_seen]
    assert len(ids) == len(set(ids)) == len(published)
    assert queue_empty(pg_settings, sink, 1.0)
    eventually(lambda: Ledger(pg_settings).pending(str(source.id)) == 0, timeout_s=60)
