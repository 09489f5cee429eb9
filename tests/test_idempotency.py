"""Business idempotency keys (``idempotency_key``, ``wm.idempotency``; issue 27, seed 002):
one business operation sent again under a new event id runs once, on a real node; a bad
key is refused at create; an event without its key is parked, named."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import drain, eventually, queue_empty, stub
from wm import DeadLetters, Settings, WorkManager, make_event
from wm.errors import IdempotencyKeyMissing, InvalidArgument
from wm.events import LIFECYCLE_TOPIC, LIFECYCLE_TYPE_PREFIX, key_of
from wm.idempotency import key_source, operation_key

STUB = "application/x-wm-stub"
WORKER = "7b0c7a52-8a3c-4a8e-9d0e-1f2a3b4c5d6e"
#: Orders of the batch test, each sent twice.
ORDERS = 15


def order(order_id: Any, **attributes: Any) -> Any:
    return make_event(
        "orders", "/tests", {"orderId": order_id, "lines": [{"sku": "a"}]}, **attributes
    )


def key(declared: str | None, event: Any) -> str:
    return operation_key(declared, event, WORKER, key_of(event))


def test_the_business_key_replaces_the_event_id_in_seed_002_s_formula() -> None:
    first, again, other = order(7), order(7), order(8)
    assert first.get_id() != again.get_id()
    assert key("$.orderId", first) == key("$.orderId", again) != key("$.orderId", other)
    assert key(None, first) == key_of(first) != key(None, again)  # the default: the event
    # the subject is the target aggregate; an attribute or an array member may hold the key
    assert key("$.orderId", order(7, subject="cart-1")) != key("$.orderId", first)
    tagged = [order(n, extensions={"orderid": "o-1"}) for n in (1, 2)]
    assert key("orderid", tagged[0]) == key("orderid", tagged[1])
    assert key("$.lines[0].sku", first) == key("$.lines[0].sku", other)
    assert key("$.orderId", order("7")) == key("$.orderId", first)  # as text, 7 is "7"


@pytest.mark.parametrize(
    ("declared", "why"),
    [
        ("$.orderId", "has nothing at '$.orderId' in its data"),
        ("$.lines[3].sku", "has nothing at '$.lines[3].sku' in its data"),
        ("orderid", "has no attribute 'orderid'"),
    ],
)
def test_an_event_without_its_key_is_refused_naming_it(declared: str, why: str) -> None:
    event = make_event("orders", "/tests", {"orderId": None, "lines": []})
    with pytest.raises(IdempotencyKeyMissing, match=re.escape(why)):
        key(declared, event)


@pytest.mark.parametrize(
    ("declared", "why"),
    [
        ("$", "a path names at least one member"),
        ("$.order..id", "a path step is expected at character 7"),
        ("$.lines[-1]", "a path step is expected at character 7"),
        ("$orderId", "a path step is expected at character 1"),
        ("orderId", "not an attribute name"),
        ("data", "the data is no attribute"),
    ],
)
def test_an_invalid_key_is_refused_at_create_and_nothing_is_stored(
    settings: Settings, declared: str, why: str
) -> None:
    manager = WorkManager(settings)
    with pytest.raises(InvalidArgument, match=re.escape(why)) as refused:
        manager.create_worker(
            code=stub(), mime_type=STUB, topic="orders", settings={"idempotency_key": declared}
        )
    assert "worker setting 'idempotency_key' must be" in str(refused.value)
    assert manager.list_workers() == []
    assert key_source("$.lines[0].sku").path == ("lines", 0, "sku")


def test_one_business_operation_runs_once_on_a_real_node(
    pg_settings: Settings, start_node: Any, tmp_path: Path
) -> None:
    """Two workers on one topic, one keyed on ``$.orderId``, one at the default: events 7, 7
    again (a new id), 8, and one without an order id. Concurrency 1 keeps the order, so the
    repeat meets the first's recorded outcome."""
    manager = WorkManager(pg_settings)
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    traces = {name: tmp_path / f"{name}.jsonl" for name in ("keyed", "plain")}
    sinks = {name: manager.subscribe(f"orders.{name}", "sink") for name in traces}
    keyed, _ = (
        manager.create_worker(
            code=stub(output_type=f"orders.{name}", trace=str(traces[name])),
            mime_type=STUB,
            topic="orders",
            settings={"idempotency_key": "$.orderId"} if name == "keyed" else None,
        )
        for name in traces
    )
    events = [order(7), order(7), order(8), make_event("orders", "/tests", {"lines": []})]
    manager.publish_many(events)
    start_node(pg_settings, concurrency=1)

    [letter] = eventually(lambda: DeadLetters(pg_settings).list())
    assert (letter.worker_id, letter.event_id) == (str(keyed.id), events[3].get_id())
    assert (letter.error_type, letter.attempts) == ("IdempotencyKeyMissing", 1)
    assert "has nothing at '$.orderId' in its data" in letter.error_message
    outputs = drain(pg_settings, sinks["keyed"], 2)
    assert [o["data"]["input"]["orderId"] for o in outputs] == [7, 8]
    assert queue_empty(pg_settings, sinks["keyed"])
    ran = [line for line in traces["keyed"].read_text().splitlines()]
    assert len(ran) == 2 and events[1].get_id() not in "".join(ran)
    assert len(drain(pg_settings, sinks["plain"], 4)) == 4  # the default: one run per event
    assert len(traces["plain"].read_text().splitlines()) == 4
    errors = [e for e in drain(pg_settings, lifecycle, 100, 2) if e["type"].endswith(".error")]
    assert [e["data"]["error_type"] for e in errors] == ["IdempotencyKeyMissing"]
    assert errors[0]["data"]["worker_id"] == str(keyed.id)
    assert errors[0]["type"] == LIFECYCLE_TYPE_PREFIX + "error"


def test_a_repeated_operation_in_one_batch_runs_once(
    pg_settings: Settings, start_node: Any, tmp_path: Path, rng: random.Random
) -> None:
    """Each order sent twice in a row under two event ids, in batches of 10: a repeat in the
    batch of its first runs in a later call of it, and meets the first's outcome there."""
    manager = WorkManager(pg_settings)
    sink = manager.subscribe("orders.done", "sink")
    trace = tmp_path / "runs.jsonl"
    manager.create_worker(
        code=stub(output_type="orders.done", trace=str(trace)),
        mime_type=STUB,
        topic="orders",
        settings={"idempotency_key": "$.orderId", "batch_size": 10},
    )
    numbers = list(range(ORDERS))
    rng.shuffle(numbers)
    orders = [n for n in numbers for _ in range(2)]  # the repeat next to its first
    manager.publish_many([order(n) for n in orders])  # queued before the node: full batches
    start_node(pg_settings, concurrency=1)
    outputs = drain(pg_settings, sink, ORDERS)
    assert sorted(o["data"]["input"]["orderId"] for o in outputs) == list(range(ORDERS))
    assert queue_empty(pg_settings, sink)
    assert len(trace.read_text().splitlines()) == ORDERS
    assert DeadLetters(pg_settings).list() == []
