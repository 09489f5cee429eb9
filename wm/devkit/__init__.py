"""The Python DevKit: what worker code imports to build CloudEvents and workers.

Importable inside the sandbox (always allowed, whatever ``PYTHON_ALLOWED_PACKAGES`` says) and
usable in plain Python for tests. It depends only on :mod:`wm.events` and :mod:`wm.errors`,
which the sandbox loads without the rest of ``wm``; keep it that way.

A function worker::

    def process(event):
        return make_event("orders.checked", "/workers/checker", {"ok": True})

A class worker::

    class Checker(WorkerBase):
        def __init__(self):
            super().__init__("orders.checked", "/workers/checker")

        def process(self, event):
            return self.response(event, {"ok": True})

Either may add a health probe, a top-level ``probe()`` function or a ``probe(self)`` method
(see :meth:`WorkerBase.probe`): called every ``probe_interval_s`` (default 30) on one node,
it returns a true value when the worker can work; a false value, an exception or a timeout
is a failed probe, and ``max_probe_failures`` (default 3) of them in a row make the worker
``unhealthy``::

    def probe():
        return ApiClient("orders-db", 8080).invoke("health", "ping") == "pong"

A worker that has done its work says so with :func:`done`: once the current event's outputs
are published the worker is ``finished`` (a natural end, not a stop or a failure)::

    def process(event):
        if event.get_data().get("last"):
            done("processed the last batch")
"""

from wm.devkit.api import DEFAULT_API_PORT, ApiClient, Gateway, ServiceClient
from wm.devkit.commands import ApiCommandWorker, CommandWorker, parse_command_node
from wm.devkit.runtime import Runtime, current_runtime, done, install_runtime
from wm.devkit.transport import HttpTransport, Transport
from wm.devkit.worker import (
    CORRELATION_ID,
    ERROR_TYPE_SUFFIX,
    ApiWorker,
    WorkerBase,
    WorkerResult,
    with_correlation_id,
)
from wm.errors import GatewayError
from wm.events import CloudEvent, make_event, with_attributes

__all__ = [
    "CORRELATION_ID",
    "DEFAULT_API_PORT",
    "ERROR_TYPE_SUFFIX",
    "ApiClient",
    "ApiCommandWorker",
    "ApiWorker",
    "CloudEvent",
    "CommandWorker",
    "Gateway",
    "GatewayError",
    "HttpTransport",
    "Runtime",
    "ServiceClient",
    "Transport",
    "WorkerBase",
    "WorkerResult",
    "current_runtime",
    "done",
    "install_runtime",
    "make_event",
    "parse_command_node",
    "with_attributes",
    "with_correlation_id",
]
