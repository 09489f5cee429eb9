"""OpenTelemetry's SDK for a node, configured from the ``OTEL_*`` conventions (issue 13,
point 3); the spans themselves are the data plane's (``wm.dataplane.tracing``).

``OTEL_TRACES_EXPORTER``: ``otlp`` (OTLP over HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, default ``http://localhost:4318``), ``console``
(JSON lines on the node's output), or unset / ``none``: no tracing, and no cost beyond the
API's no-op spans. ``OTEL_SERVICE_NAME`` names the service (default ``workmanager``);
``OTEL_RESOURCE_ATTRIBUTES`` and the exporter's own variables apply as the SDK defines them.
The SDK comes with the ``[otel]`` extra.
"""

from __future__ import annotations

import os
from typing import Any

from wm.errors import ConfigurationError, MissingDependency
from wm.extras import install_hint

_provider: list[Any] = []


def configure() -> bool:
    """Install the SDK's tracer provider when an exporter is named; True when tracing."""
    name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if name in ("", "none") or _provider:
        return bool(_provider)
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        raise MissingDependency(
            f"OTEL_TRACES_EXPORTER={name} needs OpenTelemetry's SDK: "
            f"{install_hint('otel')} (or unset OTEL_TRACES_EXPORTER)"
        ) from exc
    exporter: Any
    if name == "console":
        exporter = ConsoleSpanExporter()
    elif name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    else:
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER={name!r} is not supported here: use otlp, console or none"
        )
    service = os.environ.get("OTEL_SERVICE_NAME") or "workmanager"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider.append(provider)
    return True


def flush() -> None:
    """Export what a pool process that ends still holds (it may exit without atexit)."""
    for provider in _provider:
        provider.force_flush()
