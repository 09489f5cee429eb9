"""OpenTelemetry spans of an event's path, linked through the CloudEvents distributed-tracing
extension (``traceparent``, ``tracestate``), so one trace follows an event through every
worker it passes.

- A publish is a span (``publish <topic>``, a producer), a child of the event's own
  ``traceparent`` if it has one, else of the publisher's current span; the event is sent
  with the publish span's context as its ``traceparent``.
- A delivery is a span (``deliver <topic>``, a consumer), a child of the event's
  ``traceparent``, with children ``lock wait``, ``engine call`` and ``output publish``; each
  output carries the delivery span's context as its ``traceparent``, so the next worker's
  delivery is its child.

Only the OpenTelemetry API is used here, as libraries do: with no SDK configured (the
default) every span is a no-op and events keep the ``traceparent`` they came with, copied to
their outputs. A node configures the SDK from the ``OTEL_*`` variables (``wm.ops.tracing``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from wm.events import CloudEvent, with_attributes

#: The CloudEvents distributed-tracing extension's attributes.
TRACE_ATTRIBUTES = ("traceparent", "tracestate")

_tracer = trace.get_tracer("workmanager")
_propagator = TraceContextTextMapPropagator()
#: Tracer providers of the API alone (no SDK configured): their spans record nothing.
_NO_SDK = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


def _parent(event: CloudEvent) -> Any:
    """The context the event's ``traceparent`` names (the current one if it names none)."""
    carrier = {
        name: str(value)
        for name in TRACE_ATTRIBUTES
        if (value := event.get_extension(name)) is not None
    }
    return _propagator.extract(carrier) if "traceparent" in carrier else None


def carrier() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the current span; empty when not tracing."""
    found: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        _propagator.inject(found)
    return found


@contextlib.contextmanager
def publishing(event: CloudEvent, topic: str) -> Iterator[CloudEvent]:
    """The publish span; yields the event to send (carrying the span's context)."""
    attributes = {"messaging.destination.name": topic, "cloudevents.event_id": event.get_id()}
    with _tracer.start_as_current_span(
        f"publish {topic}", context=_parent(event), kind=SpanKind.PRODUCER, attributes=attributes
    ):
        traced = carrier()
        yield with_attributes(event, **traced) if traced else event


def enabled() -> bool:
    """Whether spans are recorded: an SDK's tracer provider is set (``wm.ops.tracing``).
    Without one every span is a no-op, and the delivery skips them (six per delivery)."""
    return not isinstance(trace.get_tracer_provider(), _NO_SDK)


def delivering(
    event: CloudEvent, attributes: Mapping[str, Any]
) -> contextlib.AbstractContextManager[Any]:
    """The delivery span, a child of the event's ``traceparent``."""
    return _delivering(event, attributes) if enabled() else contextlib.nullcontext()


@contextlib.contextmanager
def _delivering(event: CloudEvent, attributes: Mapping[str, Any]) -> Iterator[None]:
    with _tracer.start_as_current_span(
        f"deliver {event.get_type()}",
        context=_parent(event),
        kind=SpanKind.CONSUMER,
        attributes={"cloudevents.event_id": event.get_id(), **attributes},
    ):
        yield


def step(name: str) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current delivery: ``lock wait``, ``engine call``, ``output publish``."""
    return _tracer.start_as_current_span(name) if enabled() else contextlib.nullcontext()
