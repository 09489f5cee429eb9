"""A real prefork node configured from the OTEL_* conventions exports its spans (here with
the console exporter, into its log), one trace from the publisher's span to the delivery;
an exporter it does not know stops it with a line naming the variable."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from tests.helpers import STUB, drain, eventually, stub
from wm import Settings, WorkManager, make_event


@pytest.mark.slow
def test_a_node_exports_the_delivery_span_of_the_publishers_trace(
    pg_settings: Settings, start_node: Any
) -> None:
    manager = WorkManager(pg_settings)
    sink = manager.subscribe("traced.out", "sink")
    worker = manager.create_worker(
        code=stub(output_type="traced.out"), mime_type=STUB, topic="traced.in", name="traced"
    )
    node = start_node(pg_settings, name="tracing", OTEL_TRACES_EXPORTER="console")
    node.consuming(f"traced.in::{worker.id}")
    # the publisher's own span, from a tracer of its own (the test process has no SDK set)
    publisher = TracerProvider().get_tracer("publisher")
    with publisher.start_as_current_span("caller") as caller:
        event = make_event("traced.in", "/tests", {"n": 1})
        manager.publish(event)
    trace_hex = f"{caller.get_span_context().trace_id:032x}"
    [output] = drain(pg_settings, sink, 1, timeout_s=20)
    assert output["traceparent"].split("-")[1] == trace_hex

    def exported() -> list[dict[str, Any]]:
        text = node.log.read_text(errors="replace")
        blocks = re.findall(r"^\{\n.*?^\}$", text, flags=re.M | re.S)
        return [json.loads(block) for block in blocks if '"name": "deliver traced.in"' in block]

    [span] = eventually(exported, timeout_s=30)  # batched: exported within seconds
    assert span["context"]["trace_id"] == "0x" + trace_hex
    assert span["kind"] == "SpanKind.CONSUMER"
    assert span["attributes"]["workmanager.worker"] == "traced"
    assert span["resource"]["attributes"]["service.name"] == "workmanager"


def test_an_unknown_exporter_stops_the_node_with_a_line_naming_it(
    pg_settings: Settings, start_node: Any
) -> None:
    with pytest.raises(AssertionError, match="OTEL_TRACES_EXPORTER='zipkin' is not supported"):
        start_node(pg_settings, name="badtrace", OTEL_TRACES_EXPORTER="zipkin")


def test_publish_many_carries_the_callers_trace_only_under_a_span(pg_settings: Settings) -> None:
    """``publish_many`` decides once per call whether its events go through publish spans:
    under a caller's span each event carries that trace, without one not that trace."""
    manager = WorkManager(pg_settings)
    topic = f"traced.many.{uuid.uuid4().hex[:8]}"
    sink = manager.subscribe(topic, "sink")
    try:
        publisher = TracerProvider().get_tracer("publisher")
        with publisher.start_as_current_span("caller") as caller:
            manager.publish_many([make_event(topic, "/tests", {"n": n}) for n in range(2)])
        manager.publish_many([make_event(topic, "/tests", {"n": 2})])
        found = drain(pg_settings, sink, 3, timeout_s=10)
        assert [event["data"]["n"] for event in found] == [0, 1, 2]
        trace_hex = f"{caller.get_span_context().trace_id:032x}"
        assert [event["traceparent"].split("-")[1] for event in found[:2]] == [trace_hex] * 2
        # none, or (an SDK set in this process by another test) a trace of its own
        assert found[2].get("traceparent", "-?-").split("-")[1] != trace_hex
    finally:
        manager.unsubscribe(topic, "sink")
