"""The Python DevKit in plain use (no sandbox): contract, command dispatch, gateway client."""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from typing import Any

import pytest

import wm.devkit
from tests.helpers import Exchange, echo, http_server
from tests.workers.gateway_commands import PriceLookup
from tests.workers.greeter import Greeter
from tests.workers.orders import OrderCommand, Orders
from wm.devkit import (
    ApiClient,
    ApiCommandWorker,
    ApiWorker,
    CloudEvent,
    CommandWorker,
    GatewayError,
    HttpTransport,
    Runtime,
    WorkerBase,
    install_runtime,
    make_event,
    with_correlation_id,
)


def request(data: Any = None, **extensions: Any) -> CloudEvent:
    return make_event("orders.command", "/tests", data, extensions=extensions or None)


class RecordingTransport:
    def __init__(self, answer: Any = None) -> None:
        self.calls: list[tuple[str, int, str, str, Any]] = []
        self.answer = answer

    def call(self, host: str, port: int, service: str, method: str, data: Any) -> Any:
        self.calls.append((host, port, service, method, data))
        return self.answer


@pytest.fixture
def transport() -> Iterator[RecordingTransport]:
    recorder = RecordingTransport({"ok": True})
    logged: list[tuple[str, str]] = []
    install_runtime(
        Runtime(log=lambda level, message: logged.append((level, message)), transport=recorder)
    )
    yield recorder
    install_runtime(None)


# --- public surface -----------------------------------------------------------------------------


def test_all_names_are_exported() -> None:
    for name in wm.devkit.__all__:
        assert hasattr(wm.devkit, name), name
    public = {n for n in vars(wm.devkit) if not n.startswith("_") and n[0].isupper()}
    assert public <= set(wm.devkit.__all__)


def test_events_are_built_without_importing_cloudevents() -> None:
    built = make_event("a.b", "/src", {"x": 1})
    assert isinstance(built, wm.devkit.CloudEvent)
    assert built.get_data() == {"x": 1}


# --- WorkerBase ---------------------------------------------------------------------------------


def test_response_and_error_carry_routing_and_correlation_id() -> None:
    worker = Greeter()
    incoming = request({"name": "Ada"}, correlationid="corr-1")

    response = worker.process(incoming)
    error = worker.error(incoming, "boom")

    assert isinstance(response, CloudEvent)
    assert (response.get_type(), response.get_source()) == ("greetings.sent", "/workers/greeter")
    assert response.get_extension("correlationid") == "corr-1"
    assert (error.get_type(), error.get_data()) == ("greetings.sent.error", {"error": "boom"})
    assert error.get_extension("correlationid") == "corr-1"


def test_absent_correlation_id_stays_absent() -> None:
    worker = Greeter()

    response = worker.response(request(), {"a": 1})
    error = worker.error(request(), "boom")

    assert "correlationid" not in response.get_attributes()
    assert "correlationid" not in error.get_attributes()


def test_with_correlation_id_is_a_no_op_when_absent() -> None:
    output = make_event("x", "/y")
    assert with_correlation_id(output, request()) is output
    tagged = with_correlation_id(output, request(correlationid="c"))
    assert tagged.get_extension("correlationid") == "c"


def test_routing_is_passed_to_the_constructor() -> None:
    with pytest.raises(ValueError, match="response_type"):
        WorkerBase("", "/src")
    with pytest.raises(ValueError, match="source"):
        WorkerBase("a.b", "")
    with pytest.raises(NotImplementedError, match=r"WorkerBase.process\(\) must be implemented"):
        WorkerBase("a.b", "/src").process(request())


def test_response_overrides_and_log_levels(transport: RecordingTransport) -> None:
    worker = Greeter()
    response = worker.response(request(), {"a": 1}, event_type="other.type", subject="s-1")
    assert (response.get_type(), response.get_subject()) == ("other.type", "s-1")
    with pytest.raises(ValueError, match="level"):
        worker.log("x", level="loud")


# --- CommandWorker ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"command": "create", "item": "book"}, {"created": "book"}),
        ('{"command": "Create", "item": "pen"}', {"created": "pen"}),
        (b'{"command": "CANCEL", "id": 3}', {"cancelled": 3}),
        ({"command": "refund"}, {"error": "Unknown command: refund"}),
        ({"command": 5}, {"error": "Unknown command: 5"}),
        ({"item": "book"}, {"error": "Missing 'command' field"}),
        ({"command": None}, {"error": "Missing 'command' field"}),
        ("{broken", {"error": "Failed to parse command JSON"}),
        ("null", {"error": "Failed to parse command JSON"}),
        (None, {"error": "Failed to parse command JSON"}),
        (b"\xff\xfe", {"error": "Failed to parse command JSON"}),
        ("[1, 2]", {"error": "Failed to parse command JSON"}),
        ({"command": "explode"}, {"error": "Internal error: the order exploded"}),
    ],
)
def test_command_dispatch_and_exact_error_messages(
    transport: RecordingTransport, data: Any, expected: dict[str, Any]
) -> None:
    result = Orders().process(request(data, correlationid="c-7"))
    output = result[0] if isinstance(result, list) else result

    assert isinstance(output, CloudEvent)
    assert output.get_data() == expected
    assert output.get_extension("correlationid") == "c-7"


def test_command_enum_is_discovered_from_the_generic_base() -> None:
    assert Orders.command_type is OrderCommand
    assert PriceLookup.command_type is not None
    assert PriceLookup.command_type.__name__ == "Lookup"


def test_handle_receives_the_enum_member_and_the_node() -> None:
    seen: list[Any] = []

    class Recorder(CommandWorker[OrderCommand]):
        def __init__(self) -> None:
            super().__init__("r.done", "/r")

        def handle(self, event: CloudEvent, command: OrderCommand, node: dict[str, Any]) -> None:
            seen.append((command, node))

    class Child(Recorder):
        pass

    Child().process(request({"command": "CaNcEl", "id": 1}))

    assert seen == [(OrderCommand.cancel, {"command": "CaNcEl", "id": 1})]


def test_command_worker_without_an_enum_is_refused() -> None:
    class Untyped(CommandWorker):  # type: ignore[type-arg]
        def __init__(self) -> None:
            super().__init__("u.done", "/u")

    with pytest.raises(TypeError, match=r"CommandWorker\[YourCommandEnum\]"):
        Untyped()


def test_ambiguous_wire_names_are_refused() -> None:
    class Clash(Enum):
        start = 1
        START = 2

    with pytest.raises(TypeError, match="same wire name"):

        class Bad(CommandWorker[Clash]):
            pass


def test_handle_must_be_implemented(transport: RecordingTransport) -> None:
    class Lazy(CommandWorker[OrderCommand]):
        def __init__(self) -> None:
            super().__init__("l.done", "/l")

    output = Lazy().process(request({"command": "create"}))

    assert isinstance(output, CloudEvent)
    assert output.get_data() == {
        "error": "Internal error: CommandWorker.handle() must be implemented."
    }


# --- gateway client -----------------------------------------------------------------------------


def test_gateway_attribute_calls_invoke_service_methods() -> None:
    recorder = RecordingTransport({"id": 9})
    client = ApiClient("api.internal", 7000, transport=recorder)

    answer = client.gateway.orders.create({"sku": "A"})

    assert answer == {"id": 9}
    assert recorder.calls == [("api.internal", 7000, "orders", "create", {"sku": "A"})]


@pytest.mark.parametrize(("service", "method"), [("../admin", "x"), ("a", "b/c"), ("", "m")])
def test_gateway_names_cannot_change_the_path(service: str, method: str) -> None:
    client = ApiClient("h", 1, transport=RecordingTransport())
    with pytest.raises(GatewayError, match="invalid gateway"):
        client.invoke(service, method)


def test_api_client_validates_host_and_port() -> None:
    with pytest.raises(GatewayError, match="host"):
        ApiClient("", 5002)
    with pytest.raises(GatewayError, match="port"):
        ApiClient("h", 70000)


def test_api_worker_uses_the_runtime_transport(transport: RecordingTransport) -> None:
    class Forwarder(ApiWorker):
        def __init__(self) -> None:
            super().__init__("api.internal", 6000, "f.done", "/f")

        def process(self, event: CloudEvent) -> CloudEvent:
            return self.response(event, self.api.gateway.stock.reserve(event.get_data()))

    output = Forwarder().process(request({"n": 2}))

    assert transport.calls == [("api.internal", 6000, "stock", "reserve", {"n": 2})]
    assert isinstance(output, CloudEvent) and output.get_data() == {"ok": True}


def test_api_command_worker_follows_the_command_host(transport: RecordingTransport) -> None:
    worker = PriceLookup()

    first = worker.process(request({"command": "price", "sku": "A", "api_host": "h1"}))
    second = worker.process(
        request({"command": "price", "sku": "B", "api_host": "h2", "api_port": 7001})
    )

    assert [c[:2] for c in transport.calls] == [("h1", 5002), ("h2", 7001)]
    assert isinstance(first, CloudEvent) and first.get_data()["via"] == "h1:5002"
    assert isinstance(second, CloudEvent) and second.get_data()["via"] == "h2:7001"


def test_api_command_worker_without_a_host_answers_an_error(
    transport: RecordingTransport,
) -> None:
    output = PriceLookup().process(request({"command": "price", "sku": "A"}))

    assert isinstance(output, CloudEvent)
    assert output.get_data()["error"].startswith("Internal error: no API host configured")
    assert transport.calls == []


def test_api_command_worker_constructor_host_is_the_default(
    transport: RecordingTransport,
) -> None:
    class Fixed(ApiCommandWorker[OrderCommand]):
        def __init__(self) -> None:
            super().__init__("x.done", "/x", api_host="gw.internal")

        def handle(self, event: CloudEvent, command: OrderCommand, node: dict[str, Any]) -> None:
            self.api.invoke("orders", command.name, node)

    Fixed().process(request({"command": "create"}))

    assert transport.calls[0][:4] == ("gw.internal", 5002, "orders", "create")


def _orders_create_only(exchange: Exchange) -> None:
    if exchange.path == "/orders/create":
        echo(exchange)
    else:
        exchange.reply(404, b"no", Content_Length="2")


@pytest.fixture
def api_port() -> Iterator[int]:
    with http_server(_orders_create_only) as server:
        yield server.port


def test_http_transport_follows_the_url_convention(api_port: int) -> None:
    answer = HttpTransport(5).call("127.0.0.1", api_port, "orders", "create", {"a": 1})
    assert answer == {"path": "/orders/create", "got": {"a": 1}}


def test_http_transport_reports_http_errors(api_port: int) -> None:
    with pytest.raises(GatewayError, match="HTTP 404: no"):
        HttpTransport(5).call("127.0.0.1", api_port, "orders", "missing", None)


def test_http_transport_reports_unreachable_hosts() -> None:
    with pytest.raises(GatewayError, match="failed"):
        HttpTransport(1).call("127.0.0.1", 1, "orders", "create", {})


def test_plain_use_defaults_to_http_and_logging(caplog: pytest.LogCaptureFixture) -> None:
    install_runtime(None)
    caplog.set_level("INFO", logger="wm.devkit.runtime")

    Greeter().process(request({"name": "Lin"}))

    assert isinstance(wm.devkit.current_runtime().transport, HttpTransport)
    assert "greeting Lin" in caplog.text
