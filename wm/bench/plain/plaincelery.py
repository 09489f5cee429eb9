"""A plain Celery app, the reference of ``wm bench``'s drain: ``celery -A plaincelery worker``
run from this folder. It imports Celery and the standard library only, never WorkManager, so
the reference is what a user would write: ``acks_late``, JSON, Celery's prefetch multiplier
of 4, kombu's own Redis transport, no result backend, a task that does nothing.

The bench tells it, through the environment, its broker and the names of its control and
event exchanges (so a shared vhost or Redis hears only the bench's broadcasts). It answers
two inspect commands: how many tasks it finished with success (the end of a drain on
RabbitMQ, as ``wm.bench.benchnode`` does) and which modules named ``wm`` it has loaded (the
bench checks there are none).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from celery import Celery
from celery.worker import state as worker_state
from celery.worker.control import inspect_command

#: The environment the bench sets: the broker, and the prefix of the exchanges' names.
BROKER_ENV, PREFIX_ENV = "PLAIN_CELERY_BROKER_URL", "PLAIN_CELERY_PREFIX"
#: The task the reference drains.
NOOP = "plain.noop"

_prefix = os.environ.get(PREFIX_ENV, "plaincelery")
app = Celery("plaincelery")
app.conf.update(
    broker_url=os.environ.get(BROKER_ENV, "redis://127.0.0.1:6379/0"),
    broker_connection_retry_on_startup=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=4,
    task_serializer="json",
    accept_content=["json"],
    result_backend=None,
    task_ignore_result=True,
    worker_send_task_events=False,
    control_exchange=_prefix,
    event_exchange=f"{_prefix}.events",
)

# Celery keeps the ids of the last 1,000 successes only; the bench counts them all.
worker_state.successful_requests.maxlen = 0


@app.task(name=NOOP)
def noop(*args: Any, **kwargs: Any) -> None:
    """Nothing: the cost of a message, its task and its ack."""


@inspect_command(name="plain_succeeded")
def _succeeded(state: Any, **_: Any) -> dict[str, int]:
    return {"succeeded": len(worker_state.successful_requests)}


@inspect_command(name="plain_wm_modules")
def _wm_modules(state: Any, **_: Any) -> dict[str, list[str]]:
    loaded = [name for name in sys.modules if name == "wm" or name.startswith("wm.")]
    return {"modules": sorted(loaded)}
