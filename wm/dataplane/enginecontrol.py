"""Reaching the engines a worker has loaded in every process of every node: the end of a
``stop`` (DESIGN.md §4).

A worker's engines live in the processes that ran its deliveries (a prefork node's pool
processes, a threads node's one process); Celery's remote control reaches only a node's main
process. So each process that runs deliveries listens on the deployment's Redis channel
(:func:`channel`; one daemon thread, started with its runtime) for three commands:

- ``ask``: answer how many deliveries to the worker run here (a field of the reply hash the
  command names). ``PUBLISH`` says how many processes listen, so the asker knows when every
  one has answered; one that does not answer in time counts as running one (it may be
  stuck in the worker's code).
- ``kill``: kill the engine of a worker whose deliveries are in flight here — its sandbox
  child or isolation helper; an engine running inside the process (in-process native or
  .NET code) can only be stopped with the process, so a prefork pool process ends itself
  and the node replaces it. The interrupted deliveries go back to the queue
  (``wm.dataplane.tasks``) and are delivered again when the worker starts.
- ``unload``: close the worker's engine (and its processes); the next start loads it again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from wm.config import Settings, deployment_name
from wm.state.connection import own_client, redis_errors, redis_for, text

logger = logging.getLogger(__name__)
ASK, KILL, UNLOAD = "ask", "kill", "unload"
#: Seconds between the checks of a stop waiting for deliveries in flight.
POLL_S = 0.5
#: Seconds an ``ask`` waits for every listening process to answer.
ANSWER_TIMEOUT_S = 3.0
#: Seconds a listener waits before subscribing again after Redis failed.
RESUBSCRIBE_S = 1.0

#: ``handle(op, worker id)``: for ``ask``, the deliveries to that worker running here.
Handler = Callable[[str, str], int | None]


def channel(settings: Settings) -> str:
    """The Redis pub/sub channel of engine commands. Channels are server-wide, not per
    database number, so it carries the deployment's name: a process of another deployment
    on the same server would count as listening and never answer where the asker looks."""
    return f"wm:{deployment_name(settings)}:engines"


def send(settings: Settings, op: str, worker_id: str, **extra: Any) -> int:
    """Ask every process that runs deliveries to ``op`` the worker's engine; returns how
    many processes listen."""
    command = json.dumps({"op": op, "worker": worker_id, **extra})
    with redis_errors(settings):
        return int(redis_for(settings).publish(channel(settings), command))


def in_flight(settings: Settings, worker_id: str) -> int:
    """Deliveries to ``worker_id`` running now, as every listening process answers; one
    that does not answer within :data:`ANSWER_TIMEOUT_S` counts as one."""
    reply = f"wm:engines:answers:{{{uuid.uuid4().hex}}}"
    listening = send(settings, ASK, worker_id, reply=reply)
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    redis = redis_for(settings)
    while True:
        with redis_errors(settings):
            answers = redis.hgetall(reply)
        if len(answers) >= listening or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    with redis_errors(settings):
        redis.delete(reply)
    silent = max(0, listening - len(answers))
    if silent:
        logger.warning(
            "%d of %d processes did not say whether they run worker %s: counted as running it",
            silent,
            listening,
            worker_id,
        )
    return silent + sum(int(text(count)) for count in answers.values())


def wait_idle(settings: Settings, worker_id: str, grace_s: float) -> int:
    """Wait up to ``grace_s`` until no process runs a delivery to ``worker_id``; returns how
    many still ran then (0: the worker went idle)."""
    deadline = time.monotonic() + grace_s
    while True:
        running = in_flight(settings, worker_id)
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


class Listener(threading.Thread):
    """Calls ``handle(op, worker_id)`` for each command on :func:`channel`; subscribes again
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
            pubsub.subscribe(channel(self.settings))
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
                answer = self.handle(op, worker_id)
                if op == ASK and isinstance(command.get("reply"), str):
                    pipe = client.pipeline(transaction=False)
                    pipe.hset(command["reply"], str(os.getpid()), answer or 0)
                    pipe.expire(command["reply"], 60)
                    pipe.execute()
        finally:
            pubsub.close()
            client.close()
