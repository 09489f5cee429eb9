"""Groups: members of a group never run at the same time anywhere (DESIGN.md §6).

The call runs under the group's fenced lock, its lease renewed by a heartbeat meanwhile. The
lock may come from a holder that died after recording its outcome, or this event may have
been processed by another copy while this one waited: the outcome is read as the lock is
taken (one round trip on one Redis server) and a recorded one is republished, never run
again. A lock held through the hand-off window raises
:class:`~wm.errors.LockContention` (see ``contention``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from wm.dataplane import tracing
from wm.dataplane.delivery import Delivery
from wm.dataplane.observe import notify
from wm.dataplane.pipeline import Feature
from wm.engine import Engine


class GroupLock(Feature):
    @contextmanager
    def around_call(self, delivery: Delivery, engine: Engine) -> Iterator[None]:
        group = delivery.meta.group
        if not group:
            yield
            return
        locks = delivery.rt.locks
        waited = time.monotonic()
        with tracing.step("lock wait"):
            delivery.lease, raw = locks.take_reading(group, delivery.holder, delivery.outcome_key)
        notify("lock_wait", delivery.meta, time.monotonic() - waited)
        try:
            with locks.keep_alive(delivery.lease, delivery.hold_limit_s):
                delivery.recorded = delivery.rt.outcomes.parse(raw)
                yield
        finally:
            locks.release(delivery.lease)
