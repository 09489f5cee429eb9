"""The node's message consumer: Celery's, except for queues that are not its deployment's,
messages that are no delivery and a broker's passing channel errors (which restart it, as a
lost connection does, rather than end the node: ``PASSING_CHANNEL_ERRORS``).

A node consumes a worker's queue only if its own store holds the worker: an ``add_consumer``
broadcast by another deployment that shares the broker (with another WM_DEPLOYMENT, or an
older release on Celery's shared ``celery`` exchange) names a queue no worker of this
deployment owns, and consuming it would take that deployment's events and dead-letter them
here as deliveries to an unknown worker. Such a queue is left alone; its messages wait for
the nodes of its own deployment.

Celery drops what it cannot run with a log line: a body it cannot decode or may not accept
(pickle, text/plain, raw bytes), a message without a task, a task nobody registered. On a
WorkManager queue nothing may be lost, so each of these is parked as a dead letter with its
bytes and the reason, then acknowledged. If parking fails (the database is down), the
message goes back to its queue for a later try.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from contextlib import nullcontext
from functools import cached_property
from typing import Any

from amqp.exceptions import NotFound, ResourceLocked
from celery.worker.consumer import Consumer as CeleryConsumer

from wm import store
from wm.config import Settings
from wm.dataplane.bus import Bus
from wm.dataplane.deadletters import DeadLetters, malformed
from wm.dataplane.queues import is_worker_queue, over_delivery_limit, queue_arguments
from wm.errors import WorkManagerError
from wm.names import SEPARATOR
from wm.store import shares, workers

logger = logging.getLogger(__name__)
#: Celery's consumer's logger.
celery_logger = logging.getLogger("celery.worker.consumer.consumer")
_GIVEN_UP = (
    "RabbitMQ delivered it more than WM_AMQP_DELIVERY_LIMIT times without an "
    "acknowledgement, and gave it up"
)

#: Channel errors a broker gives in a passing state while the consumer (re)starts: a queue
#: whose server was just lost (404 NOT_FOUND, its home node down, until the cluster forgets
#: it) and a mailbox that the connection of a node of the same name, replaced a moment ago,
#: still holds (405 RESOURCE_LOCKED). Celery restarts the consumer on these, as on a lost
#: connection (``broker_channel_error_retry``); any other channel error, such as a queue
#: declared with other arguments (406), still ends the node with its message.
PASSING_CHANNEL_ERRORS = (NotFound, ResourceLocked)


class Consumer(CeleryConsumer):
    """``worker_consumer`` of a node (see ``wm.dataplane.app.celery_settings``)."""

    class Blueprint(CeleryConsumer.Blueprint):
        """Celery's steps but native delayed delivery, which Celery adds with quorum queues:
        it needs topic exchanges (WorkManager routes on a direct one: a retry's countdown
        waits in the node, as on classic queues), and at each reconnect it would try every
        server of a failover URL, a dead one for 17 s, before the node consumes again."""

        default_steps = [
            step for step in CeleryConsumer.Blueprint.default_steps if "DelayedDelivery" not in step
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.channel_errors = PASSING_CHANNEL_ERRORS

    #: Worker queues of running workers, as the node's own store listed them at its last
    #: reconcile (``wm.dataplane.node.reconcile``): known to be ours without asking again.
    own_queues: frozenset[str] = frozenset()

    def add_task_queue(self, queue: str, *args: Any, **options: Any) -> None:
        """Celery's, for every queue but a worker's queue this deployment does not own; the
        queue is declared as every client of the deployment declares it (a quorum queue)."""
        if not self._ours(queue):
            return
        options.setdefault("queue_arguments", queue_arguments(self.settings, queue))
        super().add_task_queue(queue, *args, **options)

    def add_task_queues(self, names: Iterable[str], **options: Any) -> list[str]:
        """:meth:`add_task_queue` for each of ``names`` (each its own routing key), consumed
        together; returns those added. Celery's consumes after each queue, and kombu's
        consume goes over every queue held: a node adding 1,000 queues went over them
        500,000 times. On Redis a queue costs one round trip (``Channel.adding_together``)."""
        cset, queues = self.task_consumer, self.app.amqp.queues
        added = []
        with getattr(cset.channel, "adding_together", nullcontext)():
            for name in names:
                if not self._ours(name) or cset.consuming_from(name):
                    continue
                if name in queues:  # as Celery's: ``queues[name]`` would add a missing one
                    queue = queues.select_add(queues[name])
                else:
                    arguments = queue_arguments(self.settings, name)
                    queue = queues.select_add(
                        name, routing_key=name, queue_arguments=arguments, **options
                    )
                cset.add_queue(queue)
                added.append(name)
            if added:
                cset.consume()
        for name in added:  # Celery's line, which operators and tests look for
            celery_logger.info("Started consuming from %s", name)
        return added

    def _ours(self, queue: str) -> bool:
        return not is_worker_queue(queue) or queue in self.own_queues or owned(queue)

    @cached_property
    def settings(self) -> Settings:
        """The node's settings, read once (a node adding 1,000 queues read them 1,000 times)."""
        return Settings.from_env()

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
        given_up_by = over_delivery_limit(message.headers)
        if given_up_by is not None:  # from a quorum queue (a plain subscription's event)
            queue, reason = given_up_by, _GIVEN_UP
        try:
            letters = DeadLetters(self.settings, Bus(self.settings, self.app))
            letters.park(malformed(queue, message.body, message.content_type, reason))
        except WorkManagerError as exc:
            logger.error("could not park a malformed message of %s (%s); requeued", queue, exc)
            message.reject(requeue=True)
            return
        message.ack()


def owned(queue: str) -> bool:
    """Whether this deployment's store holds the worker of the worker queue ``queue`` (a
    deleted worker too: what reaches its queue is parked here, with its own deployment), or
    the live members of the shared group whose queue it is (``wm.store.shares``)."""
    try:
        worker_id = uuid.UUID(queue.rpartition(SEPARATOR)[2])
        with store.session_scope(Settings.from_env()) as session:
            if workers.names(session, [worker_id]) or shares.find(session, str(worker_id)):
                return True
    except ValueError:
        pass  # no worker's id: no worker of ours
    except WorkManagerError as exc:
        logger.warning("not consuming %s before the store says it is ours: %s", queue, exc)
        return False
    logger.warning(
        "leaving queue %s alone: its worker is not in this deployment's store (another "
        "deployment sharing the broker asked to consume it)",
        queue,
    )
    return False
