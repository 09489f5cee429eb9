"""The fair share of a node's pool processes between tenants (issue 28, point 4;
docs/guides/tenants.md "Limits and fair share").

A prefork node takes messages ahead of its pool processes (``WM_PREFETCH_MULTIPLIER`` per
process) and hands them to the processes as they free up, first in, first out (Celery's
``AsynPool.outbound_buffer``). A tenant whose backlog fills that buffer puts every message of
another tenant behind its own: with a fast worker and a multiplier of 4, eight deliveries of
the flooding tenant before each of the other's. Here the buffer is one queue per tenant and
the processes are handed the tenants' messages in turn (:class:`FairBuffer`): a message of a
tenant with nothing else waiting goes to the next process that frees up, whatever another
tenant has buffered. Within one tenant the order is Celery's. With one tenant, it is one
queue: the order, and nearly the cost (a dictionary look-up per message), of Celery's deque.

The tenant of a message is that of its queue (``[<tenant>::]<topic>::<worker id>``, read
from the routing key Celery keeps on the request); messages of other queues (``wm.default``:
control tasks) share the default tenant's turn.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from celery import bootsteps
from celery.concurrency import asynpool, prefork

from wm.names import DEFAULT_TENANT

logger = logging.getLogger(__name__)
#: A tenant whose message the node received within this many seconds competes for it.
ACTIVE_S = 5.0


def queue_tenant(queue: str) -> str:
    """The tenant of a worker queue's name (``[<tenant>::]<topic>::<worker id>``); the
    default tenant for one without a tenant and for other queues."""
    parts = queue.split("::")
    return parts[0] if len(parts) >= 3 else DEFAULT_TENANT


def tenant_of(job: Any) -> str | None:
    """The tenant of a pool job: its queue's, from the Celery request whose callbacks it
    carries; None for a message of no worker queue (``wm.default``: control tasks)."""
    request = getattr(getattr(job, "_accept_callback", None), "__self__", None)
    info = getattr(request, "delivery_info", None) or {}
    queue = str(info.get("routing_key") or "")
    return queue_tenant(queue) if "::" in queue else None


#: True while several tenants' messages come to this node (its main process, the one
#: whose transport takes them): :func:`avoided` then names the tenant taken from last.
_CROWDED = [False]


def crowded() -> bool:
    """Whether tenants compete for this node's pool processes now."""
    return _CROWDED[0]


def avoided(last_tenant: str) -> str:
    """The tenant whose listed queues the next take passes over for another tenant's
    (``wm.dataplane.transport``): the last one taken from, while tenants compete; else
    none (''), and the take is the ready list's round robin over queues as ever."""
    return last_tenant if _CROWDED[0] else ""


class FairBuffer:
    """The jobs waiting for a pool process, a queue per tenant, handed out a tenant at a time
    (round robin over the tenants with jobs waiting). The deque's methods that
    ``AsynPool`` uses: ``append``, ``popleft``, ``appendleft`` (a job put back: first again),
    ``clear``, ``len``, truth and ``in``."""

    def __init__(self, active_s: float = ACTIVE_S) -> None:
        self.active_s = active_s
        self._queues: dict[str, deque[Any]] = {}
        self._turns: deque[str] = deque()  # tenants with jobs, the next one's turn first
        self._size = 0
        #: When each tenant's last message came (those of the last ACTIVE_S seconds).
        self._seen: dict[str, float] = {}
        #: Told True when a second tenant competes for the node, False when one is left.
        self.on_crowded: Callable[[bool], None] | None = None
        self.crowded = False

    def append(self, job: Any) -> None:
        tenant = tenant_of(job)
        self._queue(tenant or DEFAULT_TENANT, first=False).append(job)
        self._size += 1
        if tenant is not None:
            self._saw(tenant)

    def _saw(self, tenant: str) -> None:
        """Note the tenant's message; tell ``on_crowded`` when the node goes from one
        tenant's messages to several's in ``active_s``, or back. One tenant: a dict write."""
        now = time.monotonic()
        self._seen[tenant] = now
        if len(self._seen) < 2 and not self.crowded:
            return
        self._seen = {t: at for t, at in self._seen.items() if now - at <= self.active_s}
        crowded = len(self._seen) > 1
        if crowded != self.crowded:
            self.crowded = _CROWDED[0] = crowded
            if self.on_crowded is not None:
                self.on_crowded(crowded)

    def appendleft(self, job: Any) -> None:
        self._queue(tenant_of(job) or DEFAULT_TENANT, first=True).appendleft(job)
        self._size += 1

    def _queue(self, tenant: str, *, first: bool) -> deque[Any]:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
            if first:
                self._turns.appendleft(tenant)
            else:
                self._turns.append(tenant)
        return queue

    def popleft(self) -> Any:
        """The next job of the tenant whose turn it is; that tenant goes to the back."""
        if not self._turns:
            raise IndexError("pop from an empty FairBuffer")
        tenant = self._turns.popleft()
        queue = self._queues[tenant]
        job = queue.popleft()
        if queue:
            self._turns.append(tenant)
        else:
            del self._queues[tenant]
        self._size -= 1
        return job

    def clear(self) -> None:
        self._queues.clear()
        self._turns.clear()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Any]:
        for queue in list(self._queues.values()):
            yield from queue

    def __contains__(self, job: object) -> bool:
        return any(job in queue for queue in self._queues.values())


class FairPrefetch(bootsteps.StartStopStep):
    """Consumer bootstep: while several tenants' messages come to the node (within
    :data:`ACTIVE_S`), it takes one message ahead per pool process instead of
    ``WM_PREFETCH_MULTIPLIER``: a flooding tenant's messages taken ahead are what another
    tenant's message waits behind, in the node's own loop. Back to the multiplier when one
    tenant is left. Messages waiting for their time (a retry's countdown) keep their own
    allowance: the prefetch moves by a difference, as Celery moves it for them."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.taken_off = 0

    def start(self, parent: Any) -> None:
        buffer = _buffer(parent)
        if buffer is None or parent.qos is None:
            return
        self.taken_off, buffer.crowded, _CROWDED[0] = 0, False, False
        qos, processes = parent.qos, max(1, int(getattr(parent.pool, "num_processes", 1)))
        multiplier = max(1, int(parent.app.conf.worker_prefetch_multiplier or 1))
        ahead = processes * (multiplier - 1)  # the messages taken ahead beyond one each

        def crowded(now: bool) -> None:
            if now:  # only the multiplier's part: what waiting retries added stays theirs
                before = qos.value
                qos.decrement_eventually(ahead)
                self.taken_off = before - qos.value
            else:
                qos.increment_eventually(self.taken_off)
                self.taken_off = 0
            qos.update()
            logger.info(
                "fair share: %s tenant(s) compete; prefetch %d",
                "several" if now else "one",
                qos.value,
            )

        buffer.on_crowded = crowded

    def stop(self, parent: Any) -> None:
        buffer = _buffer(parent)
        if buffer is not None:
            buffer.on_crowded = None


def _buffer(consumer: Any) -> FairBuffer | None:
    """The node's :class:`FairBuffer` (in the pool Celery's ``TaskPool`` wraps), if it has one."""
    found = getattr(getattr(consumer.pool, "_pool", None), "outbound_buffer", None)
    return found if isinstance(found, FairBuffer) else None


class FairAsynPool(asynpool.AsynPool):
    """Celery's prefork pool with the tenants' turns (:class:`FairBuffer`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbound_buffer = FairBuffer()  # before the event loop's handlers bind it


class FairTaskPool(prefork.TaskPool):
    Pool = FairAsynPool


class FairShare(bootsteps.Step):
    """Worker bootstep: a node on Celery's prefork pool uses :class:`FairTaskPool` (set in
    ``__init__``, which every step runs before any creates its part, the pool included)."""

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        if getattr(parent, "pool_cls", None) is prefork.TaskPool:
            parent.pool_cls = FairTaskPool
