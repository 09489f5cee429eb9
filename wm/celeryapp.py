"""The ``celery -A wm.celeryapp`` entry point: the app, the hooks of a node's pool
processes, and the node's health and metrics endpoints (``wm.ops``). Nothing imports this
module; definitions live in :mod:`wm.dataplane` and :mod:`wm.ops`."""

from __future__ import annotations

from typing import Any

from celery import signals

from wm.config import Settings
from wm.dataplane.app import make_app
from wm.dataplane.node import on_process_init, on_process_shutdown, on_shutting_down
from wm.ops import metrics, tracing
from wm.ops.health import HealthServer

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
    metrics.prepare(Settings.from_env())


app = make_app()
app.steps["worker"].add(HealthServer)
tracing.configure()  # OTEL_TRACES_EXPORTER: spans of publishes and deliveries
