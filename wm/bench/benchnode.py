"""The ``celery -A wm.bench.benchnode worker -n wmbench-…@host`` entry point: the node
``wm bench`` runs (``wm.bench.rig``).

It is WorkManager's node (``wm.celeryapp``: the same app, pool hooks and tasks) with three
additions. Its control and event exchanges, and on Redis its ready list, are named after the
node (``wm.bench.rig.node_conf``), so on a shared RabbitMQ vhost it hears only the bench's
broadcasts, and on a shared Redis it neither takes nor hides other nodes' messages. It answers
``wm_bench_succeeded``: how many tasks it finished with success, one per task id. Celery
records a success in the same step that acknowledges the message (``task_ready``, then the
ack), so the count is the drain phase's exact end on RabbitMQ, which tells AMQP clients how
many messages are ready but not how many are unacknowledged. And it logs at WARNING, as the
plain Celery reference does (``wm up``'s node logs at INFO: two lines per task).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals
from celery.worker import state as worker_state
from celery.worker.control import inspect_command

from wm.bench.rig import SUCCEEDED_COMMAND, node_conf
from wm.celeryapp import app

__all__ = ["app"]

# Celery keeps the ids of the last 1,000 successes only; the bench counts them all.
worker_state.successful_requests.maxlen = 0


@signals.celeryd_init.connect
def _own_exchanges(sender: str, conf: Any, **_: Any) -> None:
    """Before the node builds its mailbox and event dispatcher."""
    conf.update(node_conf(sender.partition("@")[0], conf))


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _warnings_only(logger: logging.Logger, **_: Any) -> None:
    """In every process of the node, before Celery decides whether to log each task."""
    logger.setLevel(logging.WARNING)


@inspect_command(name=SUCCEEDED_COMMAND)
def _succeeded(state: Any, **_: Any) -> dict[str, int]:
    return {"succeeded": len(worker_state.successful_requests)}
