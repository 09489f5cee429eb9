"""Host side: gateway calls made on behalf of a worker that has no network of its own.

Every engine uses it: a sandboxed Python worker's ``api.gateway.<service>.<method>(data)``
arrives as a GATEWAY frame, a native worker calls ``host->gateway_call``. The call is
performed here, only for hosts listed in WM_GATEWAY_ALLOWED_HOSTS, with the URL convention
of :mod:`wm.devkit.transport` (``POST http://host:port/service/method``, JSON both ways) and
a time limit of WM_GATEWAY_TIMEOUT_S (less if the message's own deadline is nearer). The
worker gets the decoded JSON response or a GatewayError with the reason.
"""

from __future__ import annotations

import logging
from typing import Any

from wm.config import Settings
from wm.devkit.transport import HttpTransport, gateway_path
from wm.errors import GatewayError

logger = logging.getLogger(__name__)

#: seconds; a gateway call is not started with less time than this left.
MIN_CALL_TIME_S = 0.05


class GatewayCaller:
    """Performs the gateway calls of one engine's workers."""

    def __init__(self, settings: Settings) -> None:
        self._allowed = frozenset(host.lower() for host in settings.gateway_allowed_hosts)
        self._timeout_s = settings.gateway_timeout_s

    def reply(self, request: dict[str, Any], remaining_s: float, worker_id: str) -> dict[str, Any]:
        """The reply to ``request``: ``{"ok": True, "data": ...}`` or ``{"ok": False,
        "error": ...}``, the reason (logged)."""
        try:
            data = self.call(request, remaining_s)
        except GatewayError as exc:
            logger.info("worker %s: gateway call refused or failed: %s", worker_id, exc)
            return {"ok": False, "error": str(exc)}
        return {"ok": True, "data": data}

    def call(self, request: dict[str, Any], remaining_s: float) -> Any:
        """Perform ``request`` (``host``, ``port``, ``service``, ``method``, ``data``) within
        ``remaining_s``; the decoded JSON answer, or :class:`GatewayError` naming the reason."""
        host, port = request.get("host"), request.get("port")
        service, method = request.get("service"), request.get("method")
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
            raise GatewayError("gateway request needs a string host and an integer port")
        if not isinstance(service, str) or not isinstance(method, str):
            raise GatewayError("gateway request needs string service and method names")
        gateway_path(service, method)
        if host.lower() not in self._allowed:
            allowed = ", ".join(sorted(self._allowed)) or "none"
            raise GatewayError(
                f"gateway host {host!r} is not allowed; add it to WM_GATEWAY_ALLOWED_HOSTS "
                f"(allowed now: {allowed})"
            )
        timeout_s = min(self._timeout_s, remaining_s)
        if timeout_s < MIN_CALL_TIME_S:
            raise GatewayError("no time left for the gateway call within the message time limit")
        return HttpTransport(timeout_s).call(host, port, service, method, request.get("data"))
