"""Gateway calls on the wire: ``POST http://{host}:{port}/{service}/{method}``.

Content-Type is application/json and the body is the request data as JSON (``null`` when
omitted). A 2xx response's body is decoded as JSON (an empty body is ``None``); anything
else is a :class:`GatewayError`. Service and method names are restricted to
``[A-Za-z0-9_.-]`` so a name can never change the path. Shared by plain use, the DevKit's
client and the Python engine's host side.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from wm.errors import GatewayError

#: seconds; time limit of one direct HTTP gateway call (plain use).
DEFAULT_TIMEOUT_S = 10.0
#: bytes of an error response quoted in a GatewayError.
_QUOTED_BODY_BYTES = 200
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


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


class Transport(Protocol):
    """Performs one gateway call: ``POST http://{host}:{port}/{service}/{method}``."""

    def call(self, host: str, port: int, service: str, method: str, data: Any) -> Any:
        """Send ``data`` as JSON and return the decoded JSON response."""
        ...
