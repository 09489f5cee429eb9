"""A plain Dramatiq app, the second reference of ``wm bench``'s drain (the message queue a
user weighing Celery-based WorkManager against Dramatiq would run): ``dramatiq
plaindramatiq`` run from this folder. It imports Dramatiq and the standard library only,
never WorkManager: Dramatiq's own Redis broker with its default middleware, an actor that
does nothing, log level WARNING (``--skip-logging`` keeps the CLI's INFO set-up away).

The bench tells it, through the environment, its broker, the namespace of its Redis keys
(so a shared Redis holds only the bench's) and its queue.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker

#: The environment the bench sets (``wm.bench.dramatiqnodes``, whose names these are).
BROKER_ENV, NAMESPACE_ENV, QUEUE_ENV = (
    "PLAIN_DRAMATIQ_BROKER_URL",
    "PLAIN_DRAMATIQ_NAMESPACE",
    "PLAIN_DRAMATIQ_QUEUE",
)
#: The actor the reference drains (``wm.bench.dramatiqnodes.NOOP``).
NOOP = "noop"

logging.basicConfig(level=logging.WARNING)
broker = RedisBroker(
    url=os.environ.get(BROKER_ENV, "redis://127.0.0.1:6379/0"),
    namespace=os.environ.get(NAMESPACE_ENV, "plaindramatiq"),
)
dramatiq.set_broker(broker)


@dramatiq.actor(actor_name=NOOP, queue_name=os.environ.get(QUEUE_ENV, "default"))
def noop(*args: Any, **kwargs: Any) -> None:
    """Nothing: the cost of a message, its actor and its ack."""
