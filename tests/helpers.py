"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from kombu import Connection
from prometheus_client.parser import text_string_to_metric_families

from wm import Settings

STUB = "application/x-wm-stub"


def free_port() -> int:
    """A loopback port nothing listens on now (picked by the kernel)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def stub(**spec: Any) -> bytes:
    return json.dumps(spec).encode()


def drain(
    settings: Settings, queue: str, count: int, timeout_s: float = 30
) -> list[dict[str, Any]]:
    """Read ``count`` structured CloudEvents from a plain-subscription queue with kombu."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    with Connection(settings.broker_url) as conn:
        simple = conn.SimpleQueue(queue)
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


class _Echo(BaseHTTPRequestHandler):
    """Answers every POST with ``{"path": ..., "got": <the JSON body>}``."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        answer = json.dumps({"path": self.path, "got": json.loads(body or b"null")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A loopback HTTP gateway that echoes what it gets (see ``_Echo``); yields its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
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
