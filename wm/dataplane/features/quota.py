"""``max_events``: a worker that has processed its quota is ``finished``.

A natural end, distinct from ``stopped`` (asked for) and ``failed`` (an error): successful
deliveries are counted in Redis (``wm.state.quota``). Each delivery takes a slot before it
runs and gives it back if it does not succeed, so concurrent deliveries never run more than
the quota; the one that fills it moves the worker ``running → finished`` and every node stops
consuming. What is left in the queue stays there: ``start`` runs the worker again with a fresh
quota.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from wm.dataplane import outbox
from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import NOTHING, Feature
from wm.dataplane.verdicts import Requeue
from wm.lifecycle import Status
from wm.state import quota


class Quota(Feature):
    owns = ("max_events",)

    def admit(self, delivery: Delivery) -> AbstractContextManager[object]:
        limit = delivery.worker_settings.max_events
        return _counted(delivery, limit) if limit else NOTHING


@contextmanager
def _counted(delivery: Delivery, limit: int) -> Iterator[None]:
    """One of the worker's ``limit`` slots for the attempt, given back if it fails."""
    settings, worker_id = delivery.rt.settings, delivery.meta.id
    taken = quota.take(settings, worker_id, limit)
    if not taken:
        reason = f"worker {worker_id} has processed its max_events; requeued"
        raise Requeue(reason, pause=True)
    try:
        yield
    except BaseException:
        quota.give_back(settings, worker_id)
        raise
    if taken == limit:
        reason = f"finished: processed its max_events ({limit})"
        wid = uuid.UUID(worker_id)
        outbox.leave_running(settings, delivery.rt.bus, wid, Status.FINISHED, reason, actor="node")
