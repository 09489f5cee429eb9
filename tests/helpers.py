"""Small helpers shared by the tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from kombu import Connection

from wm import Settings

STUB = "application/x-wm-stub"


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
