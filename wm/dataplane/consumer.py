"""The node's message consumer: Celery's, except for messages that are no delivery.

Celery drops what it cannot run with a log line: a body it cannot decode or may not accept
(pickle, text/plain, raw bytes), a message without a task, a task nobody registered. On a
WorkManager queue nothing may be lost, so each of these is parked as a dead letter with its
bytes and the reason, then acknowledged. If parking fails (the database is down), the
message goes back to its queue for a later try.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

from wm.config import Settings
from wm.dataplane.bus import Bus
from wm.dataplane.deadletters import DeadLetters, malformed
from wm.errors import WorkManagerError

logger = logging.getLogger(__name__)


class Consumer(CeleryConsumer):
    """``worker_consumer`` of a node (see ``wm.dataplane.app.celery_settings``)."""

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self._park(message, f"the message cannot be decoded: {exc}")

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self._park(message, "the message is not a task message (no task name in it)")

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        name = (message.headers or {}).get("task", "?")
        self._park(message, f"no task named {name!r} is registered on this node")

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._park(message, f"the task message is invalid: {exc}")

    def _park(self, message: Any, reason: str) -> None:
        queue = str((message.delivery_info or {}).get("routing_key") or "unknown")
        try:
            settings = Settings.from_env()
            letters = DeadLetters(settings, Bus(settings, self.app))
            letters.park(malformed(queue, message.body, message.content_type, reason))
        except WorkManagerError as exc:
            logger.error("could not park a malformed message of %s (%s); requeued", queue, exc)
            message.reject(requeue=True)
            return
        message.ack()
