"""A real prefork node configured from the OTEL_* conventions exports its spans (here with
the console exporter, into its log), one trace from the publisher's span to the delivery;
an exporter it does not know stops it with a line naming the variable."""

from __future__ import annotations

import json
import re
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
