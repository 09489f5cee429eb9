"""The worker contract: :class:`WorkerBase` and :class:`ApiWorker`.

Routing is passed to the constructor (``response_type``, ``source``), not declared by
overriding properties, as the DevKit contract requires. Responses and errors made through
the helpers carry the input's ``correlationid``; an input without one gives outputs without
one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

from wm.devkit.api import ApiClient
from wm.devkit.runtime import LOG_LEVELS, current_runtime
from wm.events import CloudEvent, make_event, with_attributes

#: Extension attribute that ties a response to its request.
CORRELATION_ID = "correlationid"
#: Suffix of the type of error responses: ``<response_type>.error``.
ERROR_TYPE_SUFFIX = ".error"

#: What ``process`` may return: one event, several, or none.
WorkerResult: TypeAlias = CloudEvent | Sequence[CloudEvent] | None


def with_correlation_id(output: CloudEvent, input_event: CloudEvent) -> CloudEvent:
    """``output`` carrying the ``correlationid`` of ``input_event``; unchanged when absent."""
    correlation_id = input_event.get_extension(CORRELATION_ID)
    if correlation_id is None:
        return output
    return with_attributes(output, **{CORRELATION_ID: correlation_id})


class WorkerBase:
    """Base of class-based workers: implement :meth:`process`, and :meth:`probe` if the
    worker can check its own health.

    The Python engine instantiates the one ``WorkerBase`` subclass a worker module defines,
    without arguments, so a worker passes its routing to ``super().__init__``.
    """

    def __init__(self, response_type: str, source: str) -> None:
        for name, value in (("response_type", response_type), ("source", source)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, not {value!r}")
        self.response_type = response_type
        self.source = source

    def process(self, event: CloudEvent) -> WorkerResult:
        """Handle one event; return the events to publish (or None)."""
        raise NotImplementedError("WorkerBase.process() must be implemented.")

    def probe(self) -> bool:
        """Health probe, optional: override it to have WorkManager call it every
        ``probe_interval_s`` (worker setting, default 30) on one node at a time, between
        events, within the worker's ``timeout_s``. Return a true value when the worker can do
        its work (its backends answer, say); a false value, an exception or a probe that
        outlives its time limit is a failed probe. ``max_probe_failures`` (default 3) failed
        in a row make the worker ``unhealthy``, fewer ``degraded``; the next passing probe
        ends it. Health is no status: an unhealthy worker still gets its events.

        Not overridden, the worker has no probe and is never probed. A function worker
        defines a top-level ``probe()`` function instead."""
        raise NotImplementedError("WorkerBase.probe() is optional; override it to have one.")

    def response(
        self,
        input_event: CloudEvent,
        data: Any = None,
        *,
        event_type: str | None = None,
        subject: str | None = None,
    ) -> CloudEvent:
        """A response to ``input_event`` (type ``response_type`` unless given)."""
        output = make_event(event_type or self.response_type, self.source, data, subject=subject)
        return with_correlation_id(output, input_event)

    def error(self, input_event: CloudEvent, message: str) -> CloudEvent:
        """An error response: type ``<response_type>.error``, data ``{"error": message}``."""
        output = make_event(self.response_type + ERROR_TYPE_SUFFIX, self.source, {"error": message})
        return with_correlation_id(output, input_event)

    def log(self, message: str, *args: Any, level: str = "info") -> None:
        """Log ``message % args`` with the worker's id (forwarded to the host's logger)."""
        if level not in LOG_LEVELS:
            raise ValueError(f"level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
        current_runtime().log(level, message % args if args else message)


class ApiWorker(WorkerBase):
    """A worker with an :class:`ApiClient` for ``api_host:api_port`` in ``self.api``."""

    def __init__(self, api_host: str, api_port: int, response_type: str, source: str) -> None:
        super().__init__(response_type, source)
        self.api = ApiClient(api_host, api_port)
