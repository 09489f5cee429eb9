"""The ``celery -A wm.celeryapp`` entry point: the app and the hooks of a node's pool
processes. Nothing imports this module; definitions live in :mod:`wm.dataplane`."""

from __future__ import annotations

from typing import Any

from celery import signals

from wm.dataplane.app import make_app
from wm.dataplane.node import on_process_init, on_process_shutdown
from wm.ops.health import HealthServer

# Connected here, in the module ``celery -A`` imports first: the worker imports the
# ``include`` modules only later, after the pool has forked.


@signals.worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    on_process_init()


@signals.worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    on_process_shutdown()


app = make_app()
app.steps["worker"].add(HealthServer)
