"""Every failure ends (issue 25, findings 2 and 3): poison text, malformed task messages and
requeue loops each end as an output or a dead letter, through real node processes."""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

import pytest
import redis

from tests.helpers import STUB, drain, eventually, stub
from wm import DeadLetters, Settings, WorkManager, make_event
from wm.dataplane.queues import DELIVER_TASK, EXCHANGE, subscription_queue
from wm.events import LIFECYCLE_TOPIC, LIFECYCLE_TYPE_PREFIX, encode
from wm.state.breaker import failures_key
from wm.store.models import DeadLetter
from wm.text import storable

POISON = "bad \udcff text \x00 here"


def _letters(settings: Settings, count: int, timeout_s: float = 30) -> list[Any]:
    return eventually(
        lambda: len(found := DeadLetters(settings).list()) >= count and found, timeout_s=timeout_s
    )


def _errors(settings: Settings, lifecycle: str, wait_s: float = 3) -> list[dict[str, Any]]:
    events = drain(settings, lifecycle, 1000, timeout_s=wait_s)
    return [e for e in events if e["type"] == LIFECYCLE_TYPE_PREFIX + "error"]


def test_storable_text_is_what_every_store_takes() -> None:
    assert storable("plain é text") == "plain é text"
    assert storable(POISON) == "bad \\udcff text \\x00 here"
    assert storable(b"\xff\xfe") == "\\xff\\xfe"
    cut = storable("x" * 1000, 100)
    assert len(cut) <= 100 and cut.endswith("[cut 940 characters]")
    storable("\udcff" * 10).encode("utf-8")  # encodes


@pytest.mark.slow
def test_a_lone_surrogate_in_an_error_is_dead_lettered(
    pg_settings: Settings, start_node: Any
) -> None:
    """A worker raising ``ValueError("\\udcff")`` was requeued for ever (37 times in 40 s):
    its dead letter could not be stored."""
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(
        code=stub(fail=POISON),
        mime_type=STUB,
        topic="in",
        settings={"max_retries": 1, "retry_base_delay_ms": 20, "failure_threshold": 0},
    )
    node.consuming(f"in::{worker.id}")
    manager.publish(make_event("in", "/tests", {"n": 1}))

    [letter] = _letters(fast, 1)
    assert "bad \\udcff text \\x00 here" in letter.error_message and letter.attempts == 2
    errors = _errors(fast, lifecycle)
    assert len(errors) == 2, f"the delivery ran {len(errors)} times"
    assert "\\udcff" in errors[0]["data"]["error_message"]
    assert node.proc.poll() is None, node.tail()


@pytest.mark.slow
def test_a_lone_surrogate_with_the_breaker_on_pauses_the_worker(
    pg_settings: Settings, start_node: Any
) -> None:
    """With the circuit breaker on, the same error was requeued 7,569 times in 40 s while the
    database said ``running``: the breaker's transition could not store its reason."""
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    lifecycle = manager.subscribe(LIFECYCLE_TOPIC, "audit")
    worker = manager.create_worker(
        code=stub(fail=POISON),
        mime_type=STUB,
        topic="in",
        settings={"failure_threshold": 1, "breaker_base_delay_s": 600},
    )
    node.consuming(f"in::{worker.id}")
    manager.publish(make_event("in", "/tests", {"n": 1}))

    eventually(lambda: manager.get_worker(str(worker.id)).status == "pending")
    assert len(_errors(fast, lifecycle)) == 1
    [paused] = [
        t for t in manager.get_worker_transitions(str(worker.id)) if t.to_status == "pending"
    ]
    assert "\\udcff" in paused.reason
    assert manager.get_worker(str(worker.id)).status == "pending"
    assert not DeadLetters(fast).list()  # kept for the worker's next run
    assert node.proc.poll() is None, node.tail()


@pytest.mark.slow
def test_a_lone_surrogate_in_an_event_id_is_delivered(
    pg_settings: Settings, start_node: Any
) -> None:
    """An event whose id held a lone surrogate looped: its key (``event_key``) could not be
    computed. Now it is delivered like any other, and a failing one is parked."""
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    failing = manager.create_worker(
        code=stub(fail="no"), mime_type=STUB, topic="in", settings={"max_retries": 0}
    )
    node.consuming(f"in::{worker.id}")
    node.consuming(f"in::{failing.id}")
    manager.publish(make_event("in", "/tests\udcfe", {"x": "\udcff"}, id="id-\udcff\x00"))

    [output] = drain(fast, sink, 1)
    assert output["data"]["input"] == {"x": "\udcff"}
    [letter] = _letters(fast, 1)
    assert letter.event_id == "id-\\udcff\\x00" and letter.worker_id == str(failing.id)
    assert node.proc.poll() is None, node.tail()


def _send(manager: WorkManager, queue: str, *args: Any, _retries: Any = 0, **kwargs: Any) -> None:
    app = manager.bus.app
    with app.producer_or_acquire() as producer:
        app.send_task(
            DELIVER_TASK,
            args=list(args),
            kwargs=kwargs,
            queue=subscription_queue(queue),
            producer=producer,
            retries=_retries,
        )


@pytest.mark.slow
def test_malformed_deliver_messages_are_parked(pg_settings: Settings, start_node: Any) -> None:
    """``wm.deliver`` with a missing argument was dropped; with extra arguments of the wrong
    type it was requeued for ever; with a retries header that is no count it was dropped."""
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    queue, wid = f"in::{worker.id}", str(worker.id)
    node.consuming(queue)

    def payload(n: int) -> str:
        return encode(make_event("in", "/tests", {"n": n}))

    _send(manager, queue, wid)  # no payload
    _send(manager, queue, wid, payload(1), 5, "extra")  # extra arguments of the wrong type
    _send(manager, queue, wid, payload(2), state={"lock_waits": "x"})  # a wrong-typed state
    _send(manager, queue, wid, payload(3), state={"first_failure_at": float("inf")})
    _send(manager, queue, 42, payload(4))  # no worker id
    _send(manager, queue, wid, {"not": "a string"})
    _send(manager, queue, wid, payload(6), _retries="many")  # a retries header of no count

    letters = _letters(fast, 7)
    assert {(d.error_type, d.worker_id, d.topic) for d in letters} == {
        ("MalformedMessage", wid, "in")
    }
    reasons = " ".join(d.error_message for d in letters)
    assert "missing a required argument: 'payload'" in reasons
    assert "too many positional arguments" in reasons
    assert "lock_waits must be a whole number" in reasons
    assert "first_failure_at must be a number" in reasons
    assert "worker_id must be a worker's id" in reasons
    assert "payload must be an encoded event" in reasons
    assert "its retries header must be a count" in reasons
    assert any('"extra"' in d.envelope for d in letters)  # its arguments, as they came

    manager.publish(make_event("in", "/tests", {"n": 5}))
    assert len(drain(fast, sink, 1)) == 1
    assert node.proc.poll() is None, node.tail()


@pytest.mark.slow
def test_an_envelope_without_a_delivery_tag_is_parked_on_redis(
    pg_settings: Settings, start_node: Any
) -> None:
    """A kombu-shaped item without ``delivery_tag`` reset the consumer, and was gone."""
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(code=stub(output_type="done"), mime_type=STUB, topic="in")
    queue = f"in::{worker.id}"
    node.consuming(queue)

    body = json.dumps([[str(worker.id), encode(make_event("in", "/t", {}))], {}, {}])
    item = {
        "body": base64.b64encode(body.encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"task": DELIVER_TASK, "id": str(uuid.uuid4())},
        "properties": {
            "body_encoding": "base64",
            "delivery_info": {"exchange": EXCHANGE.name, "routing_key": queue},
            "priority": 0,
        },
    }
    redis.Redis.from_url(fast.broker_url).lpush(queue, json.dumps(item))

    [letter] = _letters(fast, 1)
    assert (letter.error_type, letter.worker_id) == ("MalformedMessage", str(worker.id))
    assert json.loads(letter.envelope) == item
    manager.publish(make_event("in", "/tests", {"n": 1}))
    assert len(drain(fast, sink, 1)) == 1
    assert node.proc.poll() is None, node.tail()


@pytest.mark.slow
def test_a_requeue_loop_ends_in_a_dead_letter_naming_its_cause(
    pg_settings: Settings, start_node: Any
) -> None:
    """A failure nothing can judge (here Redis refusing the breaker's count) sent the
    message back to its queue for ever; past WM_REQUEUE_LIMIT_S it is parked."""
    fast = pg_settings.replace(reconcile_interval_s=1.0, requeue_limit_s=2.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    worker = manager.create_worker(code=stub(fail="boom"), mime_type=STUB, topic="in")
    redis.Redis.from_url(fast.redis_url).rpush(failures_key(str(worker.id)), "not a count")
    node.consuming(f"in::{worker.id}")
    started = time.monotonic()
    manager.publish(make_event("in", "/tests", {"n": 1}))

    [letter] = _letters(fast, 1, timeout_s=60)
    assert letter.error_type == "RequeueLimitExceeded" and letter.worker_id == str(worker.id)
    assert "WM_REQUEUE_LIMIT_S=2" in letter.error_message
    assert "last cause:" in letter.error_message and "WRONGTYPE" in letter.error_message
    assert time.monotonic() - started >= 2
    assert node.proc.poll() is None, node.tail()


def test_the_requeue_limit_outlasts_an_outage_by_default() -> None:
    """A Redis restart or a database outage of a minute requeues every message it meets
    (tests/test_guarantees.py, tests/test_reliability.py): the default bound is far above."""
    assert Settings.from_env({}).requeue_limit_s == 300


def test_free_text_columns_store_anything(pg_settings: Settings) -> None:
    """What PostgreSQL refuses (NUL) or no encoder takes (a lone surrogate) is stored as
    its escape, bounded to the column."""
    from wm import store

    with store.session_scope(pg_settings) as session:
        session.add(
            DeadLetter(
                id="x",
                topic="in",
                envelope="\x00\udcff",
                error_type="E" * 300 + "\udcff",
                error_message=POISON,
                attempts=1,
                first_failure_at=time_now(),
                last_failure_at=time_now(),
            )
        )
    with store.session_scope(pg_settings) as session:
        row = session.get(DeadLetter, "x")
        assert row is not None
        assert row.envelope == "\\x00\\udcff" and row.error_message == storable(POISON)
        assert len(row.error_type) <= 255 and row.error_type.endswith("characters]")


def time_now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)
