"""Topic, subscription and worker names follow one set of rules, so queue names built from
them never collide (a subscription could once land on another's queue, or on a worker's)."""

from __future__ import annotations

import pytest

from tests.helpers import STUB, stub
from wm import InvalidArgument, WorkManager, make_event
from wm.names import MAX_NAME_BYTES, check_name

REFUSED = [
    ("", "non-empty"),
    ("   ", "non-empty"),
    ("a" * (MAX_NAME_BYTES + 1), f"limit is {MAX_NAME_BYTES} bytes"),
    ("é" * (MAX_NAME_BYTES // 2 + 1), f"limit is {MAX_NAME_BYTES} bytes"),
    ("orders\nnext", "control character"),
    ("orders\x00", "control character"),
    ("orders\u200b", "control character"),
    ("a::b", "separates the parts of a queue name"),
]


@pytest.mark.parametrize(("name", "rule"), REFUSED)
def test_refused_names_name_the_rule(name: str, rule: str) -> None:
    with pytest.raises(InvalidArgument, match=rule):
        check_name("topic", name)


def test_accepted_names_are_returned_unchanged() -> None:
    for name in ("orders", "com.example.orders.created", "ordres-reçues", "a" * MAX_NAME_BYTES):
        assert check_name("topic", name) == name


def test_create_publish_and_subscribe_apply_the_rules(manager: WorkManager) -> None:
    long_topic = "t" * 300
    with pytest.raises(InvalidArgument, match="limit is"):
        manager.create_worker(code=stub(), mime_type=STUB, topic=long_topic)
    with pytest.raises(InvalidArgument, match="worker name"):
        manager.create_worker(code=stub(), mime_type=STUB, topic="orders", name="x::y")
    with pytest.raises(InvalidArgument, match="subscription name"):
        manager.subscribe("a", "sub::b")
    with pytest.raises(InvalidArgument, match="topic"):
        manager.subscribe("a::sub", "b")
    with pytest.raises(InvalidArgument, match="control character"):
        manager.publish(make_event("orders\n", "/test", {}))
    assert manager.list_workers() == [] and manager.list_subscriptions() == []


def test_a_subscription_never_shares_a_queue(manager: WorkManager) -> None:
    worker = manager.create_worker(code=stub(), mime_type=STUB, topic="a")
    queues = {
        manager.subscribe("a", "b"),
        manager.subscribe("a", str(worker.id)),
        manager.subscribe("a", "sub"),
    }
    listed = manager.list_subscriptions("a")
    assert len(queues) == 3 and len(listed) == 4
    assert len({s["queue"] for s in listed}) == 4
