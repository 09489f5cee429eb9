"""The tenant guard (seed 002): a delivery runs only when its event was published in its
worker's tenant.

Every event WorkManager sends into a tenant's queue carries that tenant (the ``wmtenant``
extension, ``wm.events.tenant_of``; absent: the default tenant), stamped by the publish,
by a worker's delivery for its outputs, or by beat for a schedule's firing. A message whose
event names another tenant than the queue's worker was forged, or routed by something other
than WorkManager, into that queue: the guard refuses it

- before any store is touched, from the queue's name alone (``wm.dataplane.queues.
  queue_tenant``) when the broker says which queue it came from, and
- after the worker's directory entry is read (the worker the message names may be another
  tenant's than the queue's), before anything of it is used and before anything is written.

A refused message is dropped, not dead-lettered: it is no delivery of the queue's tenant
(which never published it, and whose replay would be refused again), storing it in that
tenant's dead letters would let one tenant write into another's store and fill it, and
storing it in the tenant it claims would tell that tenant the queue exists. What is left of
it is an ERROR line naming both tenants and the count ``wm_tenant_refusals_total{tenant}``
(the queue's tenant; the claimed one comes from the message, so it is never a label).
"""

from __future__ import annotations

import logging

from wm.dataplane.observe import notify
from wm.dataplane.queues import queue_tenant
from wm.errors import TenantMismatch
from wm.events import CloudEvent, tenant_of
from wm.names import SEPARATOR
from wm.state.directory import WorkerMeta

logger = logging.getLogger(__name__)

#: The observers' kind of a refusal (``wm.dataplane.observe``).
REFUSED = "tenant_refused"


def check_queue(event: CloudEvent, queue: str, worker_id: str) -> None:
    """Refuse ``event`` when the worker queue it came from is another tenant's; a queue
    whose name says no tenant (not a worker queue's, or unknown) is judged by
    :func:`check_worker` alone."""
    tenant = queue_tenant(queue)
    if tenant is not None and tenant != tenant_of(event):
        topic = queue.rpartition(SEPARATOR)[0]
        known = WorkerMeta(worker_id, topic, None, "", "", 0, "")
        _refuse(event, known, f"the queue {queue!r} of tenant {tenant!r}")


def check_worker(event: CloudEvent, meta: WorkerMeta) -> None:
    """Refuse ``event`` when the worker it is for is another tenant's."""
    if meta.tenant != tenant_of(event):
        _refuse(event, meta, f"worker {meta.id} of tenant {meta.tenant!r}")


def _refuse(event: CloudEvent, meta: WorkerMeta, reached: str) -> None:
    claimed = tenant_of(event)
    error = TenantMismatch(
        f"event {event.get_id()!r:.80} was published in tenant {claimed!r:.70} but reached "
        f"{reached}: a message forged or misrouted into another tenant's queue; dropped "
        "without running, recording or publishing anything"
    )
    logger.error("tenant guard: %s", error)
    notify(REFUSED, meta)
    raise error
