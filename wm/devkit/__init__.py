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
"""

from wm.devkit.api import DEFAULT_API_PORT, ApiClient, Gateway, ServiceClient
from wm.devkit.commands import ApiCommandWorker, CommandWorker, parse_command_node
from wm.devkit.runtime import Runtime, current_runtime, install_runtime
from wm.devkit.transport import GatewayError, HttpTransport, Transport
from wm.devkit.worker import (
    CORRELATION_ID,
    ERROR_TYPE_SUFFIX,
    ApiWorker,
    WorkerBase,
    WorkerResult,
    with_correlation_id,
)
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
    "install_runtime",
    "make_event",
    "parse_command_node",
    "with_attributes",
    "with_correlation_id",
]
