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
import time
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from wm.dataplane import logcontext
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


def trace_id(event: CloudEvent) -> str | None:
    """The trace id (32 hex digits) of the event's ``traceparent``; None without a valid one."""
    parent = _parent(event) if event.get_extension("traceparent") is not None else None
    if parent is None:
        return None
    context = trace.get_current_span(parent).get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else None


def carrier() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the current span; empty when not tracing."""
    found: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        _propagator.inject(found)
    return found


def publishing(event: CloudEvent, topic: str) -> contextlib.AbstractContextManager[CloudEvent]:
    """The publish span; yields the event to send (carrying the span's context). Without an
    SDK and without a caller's span (from a tracer of the caller's own) the span would be a
    no-op whose context is the event's own ``traceparent``, so the event is sent as it is
    (about 10 µs less per event of a ``publish_many``)."""
    if spans_publishing():
        return _publishing(event, topic)
    return contextlib.nullcontext(event)


def spans_publishing() -> bool:
    """Whether :func:`publishing` makes a span now: an SDK records spans, or a caller's
    span is current."""
    return enabled() or trace.get_current_span().get_span_context().is_valid


@contextlib.contextmanager
def _publishing(event: CloudEvent, topic: str) -> Iterator[CloudEvent]:
    attributes = {"messaging.destination.name": topic, "cloudevents.event_id": event.get_id()}
    with _tracer.start_as_current_span(
        f"publish {topic}", context=_parent(event), kind=SpanKind.PRODUCER, attributes=attributes
    ):
        traced = carrier()
        yield with_attributes(event, **traced) if traced else event


def enabled() -> bool:
    """Whether spans are recorded: an SDK's tracer provider is set (``wm.ops.tracing``).
    Without one every span is a no-op, and the delivery skips them (six per delivery).

    Until a provider is set, ``trace.get_tracer_provider()`` looks a variable up in
    ``os.environ`` on every call (a missed key raises inside ``os.environ``: 7 % of a batched
    delivery's time), so without one the answer is kept for :data:`RECHECK_S`; a provider,
    once set, stays (the API sets one per process)."""
    global _sdk_set, _checked_at
    if _sdk_set:
        return True
    now = time.monotonic()
    if now - _checked_at < RECHECK_S:
        return False
    _checked_at = now
    _sdk_set = not isinstance(trace.get_tracer_provider(), _NO_SDK)
    return _sdk_set


#: Seconds :func:`enabled` keeps the answer that no SDK is set: spans start at most this much
#: later than a provider set while the process runs.
RECHECK_S = 0.05
_sdk_set, _checked_at = False, -RECHECK_S


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
    ) as span:
        # the delivery's lines name its trace, a new one when the event carried none
        logcontext.bind(trace_id=trace.format_trace_id(span.get_span_context().trace_id))
        yield


def step(name: str) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current delivery: ``lock wait``, ``engine call``, ``output publish``."""
    return _tracer.start_as_current_span(name) if enabled() else contextlib.nullcontext()
