"""Backend calls through the API gateway: ``client.gateway.<service>.<method>(data)``.

The wire convention and the HTTP transport are in :mod:`wm.devkit.transport`.
"""

from __future__ import annotations

from typing import Any

from wm.devkit.runtime import current_runtime
from wm.devkit.transport import Transport, gateway_path
from wm.errors import GatewayError

#: Port of the API gateway when a command names a host but no port.
DEFAULT_API_PORT = 5002


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
