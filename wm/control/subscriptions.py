"""Plain subscriptions: named durable queues fed by a topic, for sinks and observers that any
kombu client can read (``wm tail`` reads a temporary one through :meth:`receive`), and the
listing of every subscription with its queue's depth."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from sqlalchemy.orm import Session

from wm import store
from wm.control.context import Context
from wm.dataplane.app import broker_errors
from wm.dataplane.bus import Route
from wm.dataplane.queues import plain_queue_name, subscription_queue
from wm.dataplane.routes import route_of
from wm.errors import SubscriptionNotFound
from wm.names import check_name
from wm.store import records
from wm.store import subscriptions as rows

#: How long one wait for a message lasts while receiving, in seconds (bounds how long a
#: reader takes to notice Ctrl-C).
POLL_S = 1.0


class Subscriptions:
    def __init__(self, context: Context) -> None:
        self.context = context
        self.settings = context.settings

    def subscribe(self, topic: str, name: str) -> str:
        """A named durable queue fed by ``topic`` that any kombu client can read; idempotent.

        Returns the queue name. Messages are structured-mode CloudEvent JSON.
        """
        queue = plain_queue_name(check_name("topic", topic), check_name("subscription name", name))
        records.transaction(self.settings, lambda session: rows.add_plain(session, topic, queue))
        self.context.bus.add_route(topic, Route(queue, None))
        return queue

    def unsubscribe(self, topic: str, name: str, *, delete_queue: bool = True) -> None:
        """Remove a plain subscription and (by default) its queue with what it holds."""
        queue = plain_queue_name(topic, name)

        def remove(session: Session) -> None:
            if not rows.remove_plain(session, queue):
                raise SubscriptionNotFound(f"topic {topic!r} has no subscription named {name!r}")

        records.transaction(self.settings, remove)
        self.context.bus.remove_route(topic, queue, delete_queue=delete_queue)

    def list(self, topic: str | None = None) -> list[dict[str, Any]]:
        """Every subscription (worker and plain) with its queue depth."""
        with store.session_scope(self.settings) as session:
            found = [  # a shared group's member with its group's queue
                (sub.topic, sub.queue if w is None else route_of(w).queue, sub.worker_id)
                for sub, w in rows.listed(session, topic)
            ]
        return [
            {
                "topic": t,
                "queue": q,
                "worker_id": str(w) if w else None,
                "depth": self.context.bus.queue_depth(q),
            }
            for t, q, w in found
        ]

    def receive(
        self, queue: str, *, count: int | None = None, idle_s: float | None = None
    ) -> Generator[str | bytes, None, None]:
        """The messages of a subscription's queue as they arrive (each one's body), until
        ``count`` were received or none came for ``idle_s`` seconds (None: for ever). A
        message is acknowledged once the caller asks for the next one, or for no more."""
        seen = 0
        # A kombu Connection to WM_BROKER_URL with the transport options publishers use.
        app = self.context.bus.app
        with broker_errors(self.settings), app.connection_for_read() as conn:
            simple = conn.SimpleQueue(subscription_queue(queue))
            try:
                while count is None or seen < count:
                    message = _next_message(simple, idle_s)
                    if message is None:
                        return
                    yield message.body
                    message.ack()
                    seen += 1
            finally:
                simple.close()


def _next_message(simple: Any, idle_s: float | None) -> Any:
    """The next message, or None once ``idle_s`` passed without one (None: wait forever)."""
    deadline = None if idle_s is None else time.monotonic() + idle_s
    while True:
        wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if wait <= 0:
            return None
        try:
            return simple.get(block=True, timeout=wait)
        except simple.Empty:
            continue
