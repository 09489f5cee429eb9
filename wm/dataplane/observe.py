"""What happens to deliveries, told to whoever measures it.

The data plane calls :func:`notify` at each step of a delivery; observers (the node's
metrics, ``wm.ops.metrics``) register with :func:`register`. The data plane never imports
its observers, and an observer that fails is logged, never allowed to fail a delivery.

Kinds, each with the worker's facts and a value: ``delivered`` (an attempt reached the
worker), ``succeeded``, ``failed`` (an attempt failed), ``retried``, ``dead_lettered``,
``fence_refused`` (a write refused under a lost lease), ``duplicate`` (a recorded outcome
republished instead of running again), ``breaker_opened`` (the circuit breaker paused
it), ``replaced`` (recovery ``replace`` unloaded its engine), ``probe_passed``,
``probe_failed``, ``session_hit`` / ``session_miss`` (a session's event ran on its bound
instance / bound its session anew); with seconds as the value: ``lock_wait``, ``engine``
(the code's run),
``latency`` (from the input's ``time`` to its outputs' publish), ``probe`` (a health
probe's run); with a count as the value, after a
worker's engine was loaded: ``engines`` (the process's loaded engines), ``sandboxes`` (the
processes they keep).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from wm.state.directory import WorkerMeta

logger = logging.getLogger(__name__)

Observer = Callable[[str, WorkerMeta, float], None]
_observers: list[Observer] = []


def register(observer: Observer) -> None:
    _observers.append(observer)


def observed() -> bool:
    """Whether any observer is registered (a delivery's notices reach someone)."""
    return bool(_observers)


def notify(kind: str, meta: WorkerMeta, value: float = 1.0) -> None:
    for observer in _observers:
        try:
            observer(kind, meta, value)
        except Exception:
            logger.exception("delivery observer %r failed on %s", observer, kind)
