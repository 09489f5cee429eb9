"""The ``celery -A wm.celeryapp`` entry point: the app, the hooks of a node's pool
processes, and the node's health and metrics endpoints (``wm.ops``). Nothing imports this
module; definitions live in :mod:`wm.dataplane` and :mod:`wm.ops`."""

from __future__ import annotations

import logging
from typing import Any

from celery import signals
from celery.utils.log import get_multiprocessing_logger

from wm.config import Settings, misspelt
from wm.dataplane import logcontext
from wm.dataplane.app import make_app
from wm.dataplane.fairshare import FairPrefetch, FairShare
from wm.dataplane.node import (
    arm_shutdown_grace,
    on_process_init,
    on_process_shutdown,
    on_shutting_down,
)
from wm.ops import logs, metrics, tracing
from wm.ops.health import HealthServer

logger = logging.getLogger(__name__)

# Connected here, in the module ``celery -A`` imports first: the worker imports the
# ``include`` modules only later, after the pool has forked.


@signals.worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    on_process_init()


@signals.worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    on_process_shutdown()
    metrics.on_process_exit()
    tracing.flush()


@signals.worker_shutting_down.connect
def _on_shutting_down(how: str = "", **_: Any) -> None:
    on_shutting_down(how)


@signals.celeryd_init.connect
def _on_node_init(**_: Any) -> None:
    # A node's main process, before its pool forks (multiprocess metrics); not every
    # ``celery -A wm.celeryapp`` command (inspect, purge, flower) that shares its environment.
    settings = Settings.from_env()
    metrics.prepare(settings)
    arm_shutdown_grace(settings)


@signals.celeryd_after_setup.connect
def _on_node_ready(**_: Any) -> None:
    # After Celery's logging is set up: the node's log shows a misspelt setting's name.
    for warning in misspelt():
        logger.warning(warning)


@signals.after_setup_logger.connect
def _on_setup_logger(logger: logging.Logger, **_: Any) -> None:
    # Celery's handlers, kept: WM_LOG_FORMAT=json swaps their formatter (every process of
    # the node, ``beat`` too), and lines logged during a delivery carry its fields.
    logs.install_on_node(Settings.from_env(), [logger, get_multiprocessing_logger()])


@signals.after_setup_task_logger.connect
def _on_setup_task_logger(logger: logging.Logger, **_: Any) -> None:
    logs.install_on_node(Settings.from_env(), [logger])


@signals.task_prerun.connect
def _on_task_prerun(task_id: str, **_: Any) -> None:
    # The delivery's log fields last the whole task: Celery's line about its end has them.
    logcontext.begin_task(task_id)


@signals.task_postrun.connect
def _on_task_postrun(task_id: str, **_: Any) -> None:
    logcontext.end_task(task_id)


app = make_app()
app.steps["worker"].add(HealthServer)
app.steps["worker"].add(FairShare)  # the tenants' turns at the pool processes
app.steps["consumer"].add(FairPrefetch)  # a shallow prefetch while tenants compete
tracing.configure()  # OTEL_TRACES_EXPORTER: spans of publishes and deliveries
