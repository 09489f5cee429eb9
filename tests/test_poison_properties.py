"""Property-based (hypothesis): whatever a publisher, a worker or a raw client hands a real
node — hostile event ids, types, sources and data, hostile error texts, task messages of any
shape — each ends as an output or a dead letter, and the node lives (issue 25, Build 2).

Examples are few and drawn from the test's seed (``hypothesis.seed``), so a failure replays
with ``TEST_SEED``; each example waits for its own end before the next is sent."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.helpers import STUB, drain, stub
from wm import DeadLetters, Settings, WorkManager, make_event
from wm.dataplane.queues import DELIVER_TASK, subscription_queue
from wm.errors import EventDecodeError
from wm.events import encode

EXAMPLES = 12
#: How long one example may take to end (an output, or a dead letter).
END_S = 30.0

#: Text as hostile as it gets: any code point (lone surrogates included), NUL, long runs.
hostile_text = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(alphabet=st.sampled_from("\x00\udcff\ud800\ufffe\n\\\"'é😀"), min_size=1),
    st.builds(lambda c, n: c * n, st.sampled_from("x\udcff\x00"), st.integers(1, 100_000)),
)
json_data = st.recursive(
    st.none() | st.booleans() | st.integers() | hostile_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_text, inner, max_size=3),
    max_leaves=8,
)
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Ends:
    """Waits for each example's end: an output on the sink, or a dead letter stored or
    updated since it was sent."""

    def __init__(self, settings: Settings, sink: str, node: Any) -> None:
        self.settings, self.sink, self.node = settings, sink, node

    def wait(self, sent_at: datetime) -> str:
        deadline = time.monotonic() + END_S
        while time.monotonic() < deadline:
            if drain(self.settings, self.sink, 1, timeout_s=0.2):
                return "output"
            letters = DeadLetters(self.settings).list(limit=1000, include_replayed=True)
            if any(d.last_failure_at >= sent_at for d in letters):
                return "dead letter"
            assert self.node.proc.poll() is None, self.node.tail()
        raise AssertionError(f"no output and no dead letter within {END_S} s:\n{self.node.tail()}")


def _node(
    pg_settings: Settings, start_node: Any, code: bytes, mime_type: str = STUB
) -> tuple[WorkManager, str, Ends]:
    fast = pg_settings.replace(reconcile_interval_s=1.0)
    manager = WorkManager(fast)
    node = start_node(fast)
    sink = manager.subscribe("done", "sink")
    worker = manager.create_worker(
        code=code,
        mime_type=mime_type,
        topic="in",
        # every event fails at once: neither the breaker nor health may pause the worker
        settings={"max_retries": 0, "failure_threshold": 0, "pause_when_unhealthy": False},
    )
    queue = f"in::{worker.id}"
    node.consuming(queue)
    return manager, queue, Ends(fast, sink, node)


@pytest.mark.slow
def test_hostile_events_each_end(pg_settings: Settings, start_node: Any, seed: int) -> None:
    manager, _, ends = _node(pg_settings, start_node, stub(output_type="done"))
    seen: set[tuple[str, str]] = set()  # an event sent again republishes: no new output

    @seed_with(seed)
    @PROPERTY
    @given(id=hostile_text, source=hostile_text, type=hostile_text, data=json_data)
    def each_ends(id: str, source: str, type: str, data: Any) -> None:
        try:
            event = make_event(type, source, data, id=id)
        except EventDecodeError:  # refused at publish, with the reason: nothing to deliver
            return
        if (source, id) in seen:
            return
        seen.add((source, id))
        sent_at = datetime.now(UTC)
        manager.publish(event, "in")
        ends.wait(sent_at)

    each_ends()


@pytest.mark.slow
def test_hostile_error_texts_each_end(pg_settings: Settings, start_node: Any, seed: int) -> None:
    """A Python worker raises ``ValueError`` with the text the event carries."""
    code = b'def process(event):\n    raise ValueError(event.get_data()["poison"])\n'
    manager, _, ends = _node(pg_settings, start_node, code, "text/x-python")

    @seed_with(seed)
    @PROPERTY
    @given(text=hostile_text)
    def each_ends(text: str) -> None:
        sent_at = datetime.now(UTC)
        manager.publish(make_event("in", "/tests", {"poison": text}), "in")
        assert ends.wait(sent_at) == "dead letter"

    each_ends()


def _deliver_args() -> st.SearchStrategy[tuple[list[Any], dict[str, Any]]]:
    anything = st.one_of(json_data, st.floats(), st.dictionaries(hostile_text, json_data))
    state = st.dictionaries(
        st.sampled_from(["lock_waits", "seq", "pin_version", "first_failure_at", "v", "x"]),
        anything,
        max_size=3,
    )
    return st.tuples(
        st.lists(anything, max_size=4),
        st.dictionaries(
            st.sampled_from(["state", "worker_id", "payload", "seq"]), anything | state
        ),
    )


@pytest.mark.slow
def test_task_messages_of_any_shape_each_end(
    pg_settings: Settings, start_node: Any, seed: int
) -> None:
    manager, queue, ends = _node(pg_settings, start_node, stub(output_type="done"))
    wid = queue.rpartition("::")[2]
    app = manager.bus.app

    @seed_with(seed)
    @PROPERTY
    @given(shape=_deliver_args(), valid_head=st.booleans())
    def each_ends(shape: tuple[list[Any], dict[str, Any]], valid_head: bool) -> None:
        args, kwargs = shape
        if valid_head:  # a real worker and event, then whatever follows
            args = [wid, encode(make_event("in", "/tests", {"n": len(args)})), *args[2:]]
        sent_at = datetime.now(UTC)
        with app.producer_or_acquire() as producer:
            app.send_task(
                DELIVER_TASK,
                args=args,
                kwargs=kwargs,
                queue=subscription_queue(queue),
                producer=producer,
            )
        ends.wait(sent_at)

    each_ends()


def seed_with(value: int) -> Any:
    """``hypothesis.seed`` from the conftest's seed (printed on failure)."""
    return seed(value)
