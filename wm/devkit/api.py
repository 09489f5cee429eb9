"""Backend calls through the API gateway: ``client.gateway.<service>.<method>(data)``.

URL convention (shared by plain use and the Python engine's host side)::

    POST http://{host}:{port}/{service}/{method}
    Content-Type: application/json
    body: the request data as JSON (``null`` when omitted)

A 2xx response's body is decoded as JSON (an empty body is ``None``); anything else is a
:class:`GatewayError`. Service and method names are restricted to ``[A-Za-z0-9_.-]`` so a
name can never change the path.
"""

from __future__ import annotations

import json
import re
from typing import Any

from wm.devkit.runtime import Transport, current_runtime
from wm.errors import WorkManagerError

#: Port of the API gateway when a command names a host but no port.
DEFAULT_API_PORT = 5002
#: seconds; time limit of one direct HTTP gateway call (plain use).
DEFAULT_TIMEOUT_S = 10.0
#: bytes of an error response quoted in a GatewayError.
_QUOTED_BODY_BYTES = 200
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


class GatewayError(WorkManagerError):
    """Raised in worker code when a gateway call fails, times out or is refused."""


def gateway_path(service: str, method: str) -> str:
    """The request path of ``service.method``; refuses names that could alter the path."""
    for kind, name in (("service", service), ("method", method)):
        if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
            raise GatewayError(f"invalid gateway {kind} name {name!r}: use [A-Za-z0-9_.-]")
    return f"/{service}/{method}"


class HttpTransport:
    """Direct HTTP (plain use and the engine's host side); never used inside the sandbox."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def call(self, host: str, port: int, service: str, method: str, data: Any) -> Any:
        import http.client

        path = gateway_path(service, method)
        body = json.dumps(data).encode("utf-8")
        connection = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        try:
            connection.request("POST", path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise GatewayError(
                f"gateway call {service}.{method} to {host}:{port} failed: {exc}"
            ) from exc
        finally:
            connection.close()
        if not 200 <= response.status < 300:
            quoted = payload[:_QUOTED_BODY_BYTES].decode("utf-8", "replace")
            raise GatewayError(
                f"gateway call {service}.{method} answered HTTP {response.status}: {quoted}"
            )
        return decode_response(payload, f"{service}.{method}")


def decode_response(payload: bytes, what: str) -> Any:
    """The JSON value of a response body (empty is None)."""
    if not payload.strip():
        return None
    try:
        return json.loads(payload)
    except ValueError as exc:
        raise GatewayError(f"gateway call {what} answered with invalid JSON: {exc}") from exc


class ApiClient:
    """A client of the API gateway at ``host:port``.

    ``transport`` is injectable (tests); by default the hosting process's runtime decides at
    call time, so a client made at import time still uses the sandbox's frame transport.
    """

    def __init__(self, host: str, port: int = DEFAULT_API_PORT, transport: Transport | None = None):
        if not isinstance(host, str) or not host:
            raise GatewayError(f"API host must be a non-empty string, not {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise GatewayError(f"API port must be an integer in 1..65535, not {port!r}")
        self.host = host
        self.port = port
        self._transport = transport

    @property
    def gateway(self) -> Gateway:
        """Dynamic access: ``client.gateway.<service>.<method>(data)``."""
        return Gateway(self)

    def invoke(self, service: str, method: str, data: Any = None) -> Any:
        """Call ``method`` of ``service`` with ``data``; return the decoded response."""
        gateway_path(service, method)
        transport = self._transport or current_runtime().transport
        return transport.call(self.host, self.port, service, method, data)

    def __repr__(self) -> str:
        return f"ApiClient({self.host!r}, {self.port})"


class Gateway:
    """``gateway.<service>`` is the :class:`ServiceClient` of that service."""

    def __init__(self, client: ApiClient) -> None:
        self._client = client

    def __getattr__(self, service: str) -> ServiceClient:
        if service.startswith("_"):
            raise AttributeError(service)
        return ServiceClient(self._client, service)


class ServiceClient:
    """``service.<method>(data)`` invokes that method through the gateway."""

    def __init__(self, client: ApiClient, service: str) -> None:
        self._client = client
        self._service = service

    def __getattr__(self, method: str) -> _MethodCall:
        if method.startswith("_"):
            raise AttributeError(method)
        return _MethodCall(self._client, self._service, method)


class _MethodCall:
    def __init__(self, client: ApiClient, service: str, method: str) -> None:
        self._client = client
        self._service = service
        self._method = method

    def __call__(self, data: Any = None) -> Any:
        return self._client.invoke(self._service, self._method, data)
