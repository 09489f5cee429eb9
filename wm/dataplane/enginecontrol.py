"""Reaching the engines a worker has loaded in every process of every node: the end of a
``stop`` (DESIGN.md §4).

A worker's engines live in the processes that ran its deliveries (a prefork node's pool
processes, a threads node's one process); Celery's remote control reaches only a node's main
process. So each process that runs deliveries listens on the Redis channel
:data:`CHANNEL` (one daemon thread, started with its runtime) for two commands:

- ``kill``: kill the engine of a worker whose deliveries are in flight here — its sandbox
  child or isolation helper; an engine running inside the process (in-process native or
  .NET code) can only be stopped with the process, so a prefork pool process ends itself
  and the node replaces it. The interrupted deliveries go back to the queue
  (``wm.dataplane.tasks``) and are delivered again when the worker starts.
- ``unload``: close the worker's engine (and its processes); the next start loads it again.

Which deliveries are in flight is asked of the nodes with Celery's ``inspect active``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from wm.config import Settings
from wm.dataplane.app import BROKER_ERRORS
from wm.dataplane.queues import DELIVER_TASK
from wm.state.connection import own_client, redis_errors, redis_for

logger = logging.getLogger(__name__)
#: Redis pub/sub channel of engine commands.
CHANNEL = "wm:engines"
KILL = "kill"
UNLOAD = "unload"
#: Seconds between the checks of a stop waiting for deliveries in flight.
POLL_S = 0.5
#: Seconds each check waits for the nodes' answers.
INSPECT_TIMEOUT_S = 1.0
#: Seconds a listener waits before subscribing again after Redis failed.
RESUBSCRIBE_S = 1.0

Handler = Callable[[str, str], None]


def send(settings: Settings, op: str, worker_id: str) -> int:
    """Ask every process that runs deliveries to ``op`` the worker's engine; returns how
    many processes listen."""
    with redis_errors(settings):
        return int(
            redis_for(settings).publish(CHANNEL, json.dumps({"op": op, "worker": worker_id}))
        )


def in_flight(app: Celery, worker_id: str) -> list[str]:
    """Ids of the deliveries to ``worker_id`` that nodes are running now (Celery's ``inspect
    active``; a node that does not answer within :data:`INSPECT_TIMEOUT_S` is not counted)."""
    try:
        replies = app.control.inspect(timeout=INSPECT_TIMEOUT_S).active() or {}
    except BROKER_ERRORS as exc:
        logger.warning("could not ask the nodes which deliveries run: %s", exc)
        return []
    return [
        str(task.get("id"))
        for tasks in replies.values()
        for task in tasks or ()
        if task.get("name") == DELIVER_TASK and _worker_of(task) == worker_id
    ]


def _worker_of(task: dict[str, Any]) -> str | None:
    args = task.get("args")
    if isinstance(args, list | tuple) and args:
        return str(args[0])
    return None


def wait_idle(app: Celery, worker_id: str, grace_s: float) -> list[str]:
    """Wait up to ``grace_s`` until no node runs a delivery to ``worker_id``; returns the
    ids of those still running then (empty: the worker went idle)."""
    deadline = time.monotonic() + grace_s
    while True:
        running = in_flight(app, worker_id)
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


class Listener(threading.Thread):
    """Calls ``handle(op, worker_id)`` for each command on :data:`CHANNEL`; subscribes again
    after a Redis failure; ends within :data:`POLL_S` of :meth:`stop` (or with its process:
    a daemon)."""

    def __init__(self, settings: Settings, handle: Handler) -> None:
        super().__init__(name="wm-engine-commands", daemon=True)
        self.settings = settings
        self.handle = handle
        self.subscribed = threading.Event()
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._listen()
            except Exception as exc:  # Redis went away: subscribe again
                self.subscribed.clear()
                logger.warning("engine commands: %s; subscribing again", exc)
                self._stopped.wait(RESUBSCRIBE_S)

    def _listen(self) -> None:
        client = own_client(self.settings)
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(CHANNEL)
            self.subscribed.set()
            while not self._stopped.is_set():
                message = pubsub.get_message(timeout=POLL_S)
                if message is None or message.get("type") != "message":
                    continue
                try:
                    command = json.loads(message["data"])
                    op, worker_id = str(command["op"]), str(command["worker"])
                except (ValueError, TypeError, KeyError):
                    logger.warning("engine commands: ignoring malformed %r", message["data"])
                    continue
                self.handle(op, worker_id)
        finally:
            pubsub.close()
            client.close()
