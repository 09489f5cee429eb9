"""Command workers: ``CommandWorker[E]`` and ``ApiCommandWorker[E]`` over an Enum ``E``.

The event data is a JSON object whose ``"command"`` names a member of ``E``: the wire name
is the member's identifier in lower case, matched case-insensitively. The base parses,
dispatches to :meth:`CommandWorker.handle` and answers failures with error responses whose
messages are exactly:

* ``Failed to parse command JSON`` — data is not JSON, is JSON ``null``, or is not an object;
* ``Missing 'command' field`` — the object has no ``command`` (or it is ``null``);
* ``Unknown command: <command>`` — no member of ``E`` has that name;
* ``Internal error: <message>`` — ``handle`` raised.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, ClassVar, Generic, TypeVar, get_args, get_origin

from wm.devkit.api import DEFAULT_API_PORT, ApiClient
from wm.devkit.worker import WorkerBase, WorkerResult
from wm.errors import GatewayError
from wm.events import CloudEvent

E = TypeVar("E", bound=Enum)

PARSE_ERROR = "Failed to parse command JSON"
MISSING_COMMAND = "Missing 'command' field"
UNKNOWN_COMMAND = "Unknown command: {command}"
INTERNAL_ERROR = "Internal error: {message}"


def parse_command_node(data: Any) -> dict[str, Any] | None:
    """The command object of ``data`` (a dict already, or JSON text or bytes); else None."""
    if isinstance(data, dict):
        return data
    if not isinstance(data, str | bytes | bytearray):
        return None
    try:
        node = json.loads(data)
    except ValueError:  # includes UnicodeDecodeError
        return None
    return node if isinstance(node, dict) else None


def _enum_argument(cls: type) -> type[Enum] | None:
    """The Enum a subclass was parameterised with, from ``__orig_bases__``."""
    for base in getattr(cls, "__orig_bases__", ()):
        origin = get_origin(base)
        if isinstance(origin, type) and issubclass(origin, CommandWorker):
            for argument in get_args(base):
                if isinstance(argument, type) and issubclass(argument, Enum):
                    return argument
    return None


def _wire_names(command_type: type[Enum]) -> dict[str, Enum]:
    names: dict[str, Enum] = {}
    for member in command_type:
        wire = member.name.lower()
        if wire in names:
            raise TypeError(
                f"{command_type.__name__} has members {names[wire].name!r} and {member.name!r} "
                "with the same wire name"
            )
        names[wire] = member
    return names


class CommandWorker(WorkerBase, Generic[E]):
    """Dispatches ``{"command": "<name>", ...}`` to :meth:`handle` with the Enum member."""

    #: The Enum of commands, found from ``class W(CommandWorker[MyEnum])``.
    command_type: ClassVar[type[Enum] | None] = None
    _wire: ClassVar[dict[str, Enum]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found = _enum_argument(cls)
        if found is not None:
            cls.command_type = found
            cls._wire = _wire_names(found)

    def __init__(self, response_type: str, source: str) -> None:
        super().__init__(response_type, source)
        if self.command_type is None:
            raise TypeError(
                f"{type(self).__name__} must subclass CommandWorker[YourCommandEnum] "
                "so the command type is known"
            )

    def process(self, event: CloudEvent) -> WorkerResult:
        node = parse_command_node(event.get_data())
        if node is None:
            return self.error(event, PARSE_ERROR)
        command = node.get("command")
        if command is None:
            return self.error(event, MISSING_COMMAND)
        member = self._wire.get(command.lower()) if isinstance(command, str) else None
        if member is None:
            return self.error(event, UNKNOWN_COMMAND.format(command=command))
        try:
            self.before_handle(node)
            return self.handle(event, member, node)  # type: ignore[arg-type]
        except Exception as exc:  # the contract: any failure becomes an error response
            message = str(exc) or type(exc).__name__
            self.log("command %s failed: %s", member.name, message, level="error")
            return self.error(event, INTERNAL_ERROR.format(message=message))

    def before_handle(self, node: dict[str, Any]) -> None:
        """Hook run before :meth:`handle` (``ApiCommandWorker`` configures its client)."""

    def handle(self, event: CloudEvent, command: E, node: dict[str, Any]) -> WorkerResult:
        """Handle one parsed command; ``node`` is the whole command object."""
        raise NotImplementedError("CommandWorker.handle() must be implemented.")


class ApiCommandWorker(CommandWorker[E]):
    """A command worker whose :attr:`api` follows each command's ``api_host``/``api_port``.

    ``api_host`` in a command (port from ``api_port``, default 5002) creates or reconfigures
    the client; without it the constructor's host, if any, is used.
    """

    def __init__(
        self,
        response_type: str,
        source: str,
        *,
        api_host: str | None = None,
        api_port: int = DEFAULT_API_PORT,
    ) -> None:
        super().__init__(response_type, source)
        self._api = ApiClient(api_host, api_port) if api_host is not None else None

    @property
    def api(self) -> ApiClient:
        """The gateway client for the current command."""
        if self._api is None:
            raise GatewayError(
                "no API host configured: send 'api_host' in the command or pass api_host"
            )
        return self._api

    def before_handle(self, node: dict[str, Any]) -> None:
        host = node.get("api_host")
        if host is None:
            return
        port = node.get("api_port", DEFAULT_API_PORT)
        if self._api is None or (self._api.host, self._api.port) != (host, port):
            self._api = ApiClient(host, port)
