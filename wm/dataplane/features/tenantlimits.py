"""A tenant's ``max_concurrency`` and ``rate_limit`` across the cluster (issue 28, point 4;
``wm.state.tenantlimits``). The limits come with the worker's facts
(``WorkerMeta.tenant_limits``, from the directory's cached entry), so a tenant without them,
the default one included, pays no round trip and no script: the feature is one attribute
read. A delivery of a limited tenant takes its slot and its place in the rate in one script
around the call (a recorded outcome republished takes neither); one that finds every slot
taken, or comes too early for the rate, waits in the broker: it is sent again later as a
new message and this one acknowledged, so its pool process moves on. Such a wait is no
failure: no attempt, retry or circuit-breaker count is used, it is never dead-lettered
(whatever GROUP_LOCK_MAX_RETRIES says: the tenant's limit, not a stuck holder, is why it
waits) and it is counted apart (``wm_tenant_throttled_total``). Over the rate, the wait is
the bucket's (until the delivery conforms) spread over up to as much again, so waiters do
not all come back in the same instant; for a slot, the group lock's back-off."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from wm.dataplane.delivery import Delivery
from wm.dataplane.observe import notify, observed
from wm.dataplane.pipeline import NOTHING, Feature
from wm.dataplane.verdicts import Resend, Verdict
from wm.engine import Engine
from wm.errors import TenantThrottled
from wm.state.locks import retry_delay_ms


class TenantLimits(Feature):
    def around_run(self, delivery: Delivery) -> AbstractContextManager[object]:
        """Every tenant's deliveries running, for ``wm_tenant_in_flight`` (nothing to do
        when no observer is registered: the health port is off)."""
        return _running(delivery) if observed() else NOTHING

    def around_call(self, delivery: Delivery, engine: Engine) -> AbstractContextManager[object]:
        limits = delivery.meta.tenant_limits
        if not limits:
            return NOTHING
        concurrency, rate = limits.get("max_concurrency"), limits.get("rate_limit")
        tenant, gate = delivery.meta.tenant, delivery.rt.tenant_gate
        refused = gate.admit(tenant, delivery.holder, delivery.hold_limit_s, concurrency, rate)
        if refused is None:
            return gate.holding(tenant, delivery.holder, concurrency)
        if refused.full:
            ceiling_ms = retry_delay_ms(delivery.rt.settings, delivery.state.lock_waits)
            delay_s = random.uniform(ceiling_ms / 2, ceiling_ms) / 1000
            why = f"runs {concurrency} deliveries already (max_concurrency)"
        else:
            delay_s = refused.wait_ms * random.uniform(1.0, 2.0) / 1000
            why = f"is over its rate_limit of {rate:g} events/s"
        raise TenantThrottled(f"tenant {tenant!r} {why}", delay_s)

    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        if not isinstance(error, TenantThrottled):
            return None
        notify("tenant_throttled", delivery.meta)
        state = delivery.state.waited(time.time())
        return Resend(error.delay_s, state, error, counts=False)


@contextmanager
def _running(delivery: Delivery) -> Iterator[None]:
    notify("tenant_running", delivery.meta, 1.0)
    try:
        yield
    finally:
        notify("tenant_running", delivery.meta, -1.0)
