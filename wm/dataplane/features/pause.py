"""The pause of an unhealthy worker (issue 27, point 2; seed 004's ``can_accept_work?``: ready
*and* healthy): while its kept verdict is ``unhealthy`` (``wm.state.health``) and
``pause_when_unhealthy`` is on, no node consumes its queue (``wm.dataplane.node``), and a
delivery already fetched goes back to the queue unattempted: no attempt used, nothing
parked. The verdict is read with the worker's entry, in the delivery's first round trip.
A member of a shared group is not paused: the group's one queue is every member's."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

from wm.dataplane.delivery import Delivery
from wm.dataplane.pipeline import NOTHING, Feature
from wm.dataplane.verdicts import Requeue
from wm.state.connection import text
from wm.state.health import UNHEALTHY, state_key


class HealthPause(Feature):
    owns = ("pause_when_unhealthy", "health_pause_s")

    def facts(self, worker_id: str) -> Sequence[str]:
        return (state_key(worker_id),)

    def admit(self, delivery: Delivery) -> AbstractContextManager[object]:
        meta = delivery.meta
        kept = delivery.facts.get(state_key(meta.id))
        if (
            delivery.share is None  # a shared group's queue is every member's: not paused
            and kept is not None
            and text(kept) == UNHEALTHY
            and delivery.worker_settings.pause_when_unhealthy
        ):
            raise Requeue(f"worker {meta.id} is unhealthy: paused until it is healthy", pause=True)
        return NOTHING
