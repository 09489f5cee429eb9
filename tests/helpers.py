"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

from kombu import Connection
from prometheus_client.parser import text_string_to_metric_families

from wm import Settings, WorkManager, make_event
from wm.bench.cputime import process_cpu_s
from wm.dataplane.queues import subscription_queue
from wm.local.embedded import pid_alive

STUB = "application/x-wm-stub"
#: The process exists and has not ended: the check ``wm up`` waits on.
running = pid_alive
#: The root of the clone: the README (the front page) and docs/ (the manual) are under it.
ROOT = Path(__file__).resolve().parent.parent


def doc(path: str) -> str:
    """One page of the documentation, by its path from the root: ``README.md``,
    ``docs/guides/tenants.md``…"""
    return ROOT.joinpath(path).read_text(encoding="utf-8")


def doc_pages() -> list[Path]:
    """The README and every page of docs/, in a stable order."""
    return [ROOT / "README.md", *sorted(ROOT.joinpath("docs").rglob("*.md"))]


def all_docs() -> str:
    """The whole documentation as one text: the README, then every page of docs/."""
    return "\n".join(page.read_text(encoding="utf-8") for page in doc_pages())


def artefacts(kind: str) -> Path:
    """Where a test keeps what a person may want to look at afterwards (screenshots):
    ``$TEST_ARTEFACTS_DIR/<kind>``, default ``tests/artefacts/<kind>`` (git-ignored). Not a
    ``WM_`` name: WorkManager refuses unknown ``WM_*`` variables in the processes tests start."""
    root = os.environ.get("TEST_ARTEFACTS_DIR") or Path(__file__).resolve().parent / "artefacts"
    where = Path(root) / kind
    where.mkdir(parents=True, exist_ok=True)
    return where


def free_port() -> int:
    """A loopback port nothing listens on now (picked by the kernel)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def idle_cpu_s(pid: int, seconds: float = 1.0) -> float:
    """CPU seconds ``pid`` spends over ``seconds`` of idleness, from a moment after its last
    work (what it may still poll for then has ended)."""
    time.sleep(0.1)
    started = process_cpu_s(pid)
    time.sleep(seconds)
    return process_cpu_s(pid) - started


def stub(**spec: Any) -> bytes:
    return json.dumps(spec).encode()


def publish_numbered(manager: WorkManager, topic: str, count: int, **ext: Any) -> list[str]:
    """Publish ``count`` events ``{"n": 0…}`` to ``topic``; returns their ids in order."""
    ids = []
    for n in range(count):
        event = make_event(topic, "/tests", {"n": n}, extensions=ext or None)
        manager.publish(event)
        ids.append(event.get_id())
    return ids


def drain(
    settings: Settings, queue: str, count: int, timeout_s: float = 30
) -> list[dict[str, Any]]:
    """Read ``count`` structured CloudEvents from a plain-subscription queue with kombu."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    with Connection(settings.broker_url) as conn:
        simple = conn.SimpleQueue(subscription_queue(queue, settings))
        try:
            while len(events) < count and time.monotonic() < deadline:
                try:
                    message = simple.get(timeout=max(0.1, deadline - time.monotonic()))
                except simple.Empty:
                    break
                events.append(json.loads(message.body))
                message.ack()
        finally:
            simple.close()
    return events


def drain_each(
    settings: Settings, queue: str, expected: set[str], timeout_s: float = 180
) -> list[dict[str, Any]]:
    """Read ``queue`` until an event of each id in ``expected`` has come, or ``timeout_s``
    has passed. A repeated one (RabbitMQ may repeat an output after a kill,
    docs/guarantees.md) counts once, so a repeat never ends the wait before a late event."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while (missing := expected - {e["id"] for e in events}) and time.monotonic() < deadline:
        events += drain(settings, queue, len(missing), timeout_s=deadline - time.monotonic())
    return events


def queue_empty(settings: Settings, queue: str, wait_s: float = 1.0) -> bool:
    """True when nothing more arrives in ``queue`` within ``wait_s``."""
    return not drain(settings, queue, 1, timeout_s=wait_s)


def eventually(check: Callable[[], Any], timeout_s: float = 30, interval_s: float = 0.2) -> Any:
    """Poll ``check`` until it returns something truthy; fail with its last value."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s (last value: {value!r})")


def wm_cli(settings: Settings, *args: str, stdin: str | None = None) -> Any:
    """Run ``wm --json ARGS`` against ``settings``; its JSON output (None when empty)."""
    from tests.conftest import env_of

    result = subprocess.run(
        [sys.executable, "-m", "wm.cli", "--json", *args],
        input=stdin,
        env=env_of(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.strip() else None


class Received(NamedTuple):
    """One request the loopback server got."""

    method: str
    path: str
    host: str | None
    body: bytes

    def json(self) -> Any:
        """The body as JSON (None when empty)."""
        return json.loads(self.body or b"null")


class Exchange(BaseHTTPRequestHandler):
    """One request to :func:`http_server`: recorded, then answered by the server's route."""

    server: _LoopbackServer
    received: Received

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    @property
    def stopping(self) -> threading.Event:
        """Set when the server stops: a route that answers slowly ends then."""
        return self.server.stopping

    def reply(self, status: int, body: bytes = b"", **headers: str) -> None:
        """Answer ``status`` with ``body``; header names spelled ``Content_Length``."""
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def reply_json(self, value: Any, status: int = 200) -> None:
        body = json.dumps(value).encode()
        self.reply(status, body, Content_Type="application/json", Content_Length=str(len(body)))

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.received = Received(self.command, self.path, self.headers.get("Host"), body)
        self.server.requests.append(self.received)
        with contextlib.suppress(OSError):  # the client hung up, as a refusal mid-body does
            self.server.route(self)

    def log_message(self, format: str, *args: Any) -> None:
        pass


#: How :func:`http_server` answers a request.
Route = Callable[[Exchange], None]


def echo(exchange: Exchange) -> None:
    """Answers ``{"path": ..., "got": <the JSON body>}``: the gateway of most tests."""
    exchange.reply_json({"path": exchange.path, "got": exchange.received.json()})


class _LoopbackServer(ThreadingHTTPServer):
    daemon_threads = False  # server_close waits for every answer in flight

    def __init__(self, route: Route) -> None:
        super().__init__(("127.0.0.1", 0), Exchange)
        self.route = route
        self.requests: list[Received] = []
        self.stopping = threading.Event()


@dataclass
class Loopback:
    """A running :func:`http_server`: its port, what it got, the names TLS clients sent."""

    port: int
    requests: list[Received]
    server_names: list[str | None] = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"


@contextlib.contextmanager
def http_server(route: Route = echo, tls: ssl.SSLContext | None = None) -> Iterator[Loopback]:
    """The tests' one HTTP server: on a free loopback port, answering each request with
    ``route`` (:func:`echo` unless told) and recording it; HTTPS with ``tls``."""
    httpd = _LoopbackServer(route)
    loopback = Loopback(httpd.server_address[1], httpd.requests)
    if tls is not None:
        tls.sni_callback = lambda sock, name, ctx: loopback.server_names.append(name)
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield loopback
    finally:
        httpd.stopping.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class Terminal(NamedTuple):
    """What a command wrote to a pseudo-terminal (standard output and error together)."""

    code: int
    screen: str


def run_in_terminal(
    args: list[str], env: dict[str, str], *, columns: int = 80, timeout_s: float = 60
) -> Terminal:
    """Run ``args`` with a pseudo-terminal of ``columns`` columns as its standard input,
    output and error, the way a person at a terminal runs it; returns everything it showed
    (ANSI sequences included) and its exit code."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    clean = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    process = subprocess.Popen(
        args, stdin=follower, stdout=follower, stderr=follower, env={**clean, "TERM": "xterm"}
    )
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal closed, everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
        if time.monotonic() > deadline:
            process.kill()
            break
    os.close(leader)
    code = process.wait(timeout=timeout_s)
    return Terminal(code, b"".join(chunks).decode(errors="replace"))


def plain(screen: str) -> str:
    """``screen`` without ANSI escape sequences and carriage returns."""
    import re

    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", screen)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made by openssl in ``directory``."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def command_calls(server: Any) -> Counter[str]:
    """Commands a Redis server has run, by name (``INFO commandstats``, which counts the
    commands a script runs too)."""
    stats = server.info("commandstats")
    return Counter({name[len("cmdstat_") :]: int(value["calls"]) for name, value in stats.items()})
