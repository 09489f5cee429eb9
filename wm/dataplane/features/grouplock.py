"""Groups (DESIGN.md §6): in an ``exclusive`` group (the default) members never run at the
same time anywhere; in a ``shared`` one each event runs on one member (``wm.store.shares``
routes it), members in parallel, and the lock is the event's own within the group, so two
copies of one event never run at once.

The call runs under the fenced lock, its lease renewed by a heartbeat meanwhile. The
lock may come from a holder that died after recording its outcome, or this event may have
been processed by another copy while this one waited: the outcome is read as the lock is
taken (one round trip on one Redis server) and a recorded one is republished, never run
again. A lock held through the hand-off window raises
:class:`~wm.errors.LockContention` (see ``contention``). A batch (``wm.dataplane.batching``)
takes one lease for its call, then reads every event's outcome under it in one MGET.

With WM_INFRA_EVENTS on, taking and releasing the lock are told on
``workmanager.infra.grouplock`` (``wm.dataplane.infra``), a steal always."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

from wm.dataplane import infra, tracing
from wm.dataplane.delivery import Delivery
from wm.dataplane.observe import notify
from wm.dataplane.pipeline import NOTHING, Feature
from wm.engine import Engine
from wm.state.connection import redis_errors


class GroupLock(Feature):
    owns = ("group_mode",)

    def around_call(self, delivery: Delivery, engine: Engine) -> AbstractContextManager[object]:
        group = delivery.meta.group
        return _holding(delivery, group) if group else NOTHING

    def around_batch(
        self, deliveries: Sequence[Delivery], engine: Engine
    ) -> AbstractContextManager[object]:
        group = deliveries[0].meta.group
        return _holding_batch(deliveries, group) if group else NOTHING


@contextmanager
def _holding(delivery: Delivery, group: str) -> Iterator[None]:
    """The group's lock around one call, read with the outcome recorded under it."""
    locks = delivery.rt.locks
    item = None if delivery.share is None else f"{delivery.share}:{delivery.key}"
    waited = time.monotonic()
    with tracing.step("lock wait"):
        delivery.lease, raw = locks.take_reading(group, delivery.holder, delivery.outcome_key, item)
    notify("lock_wait", delivery.meta, time.monotonic() - waited)
    lease, bus = delivery.lease, delivery.rt.bus
    infra.lock_taken(bus, lease, delivery.meta.id)
    try:
        with locks.keep_alive(lease, delivery.hold_limit_s) as delivery.heartbeat:
            delivery.recorded = delivery.rt.outcomes.parse(raw)
            yield
    finally:
        released = delivery.released
        if released is None:  # not with the outcome's record
            released = locks.release(lease)
        if released:
            infra.lock_released(bus, lease, delivery.meta.id)


@contextmanager
def _holding_batch(deliveries: Sequence[Delivery], group: str) -> Iterator[None]:
    """One lease of the group's lock around a batch's call, with the outcomes recorded."""
    first = deliveries[0]
    rt = first.rt
    waited = time.monotonic()
    with tracing.step("lock wait"):
        lease = rt.locks.take(group, first.holder)
    notify("lock_wait", first.meta, time.monotonic() - waited)
    infra.lock_taken(rt.bus, lease, first.meta.id)
    try:
        with rt.locks.keep_alive(lease, first.hold_limit_s * len(deliveries)):
            with redis_errors(rt.settings):  # what a previous holder recorded
                found = rt.outcomes.redis.mget([d.outcome_key for d in deliveries])
            for delivery, raw in zip(deliveries, found, strict=True):
                delivery.lease, delivery.recorded = lease, rt.outcomes.parse(raw)
            yield
    finally:
        if rt.locks.release(lease):
            infra.lock_released(rt.bus, lease, first.meta.id)
