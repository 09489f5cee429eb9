"""The control plane's statements on the subscriptions table: plain subscriptions (named
queues for sinks and observers) and the listing of every subscription. A worker's own
subscription comes and goes with the worker (``wm.store.workers``)."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from wm.store.models import Subscription, Worker


def add_plain(session: Session, topic: str, queue: str, tenant: str) -> None:
    """Subscribe ``queue`` to ``topic`` (a route topic of ``tenant``) unless it is
    subscribed already."""
    found = session.scalar(select(Subscription).where(Subscription.queue == queue))
    if found is None:
        session.add(Subscription(tenant=tenant, topic=topic, queue=queue, worker_id=None))


def remove_plain(session: Session, queue: str) -> bool:
    """Delete the plain subscription of ``queue``; False if there is none."""
    result = session.execute(
        delete(Subscription).where(Subscription.queue == queue, Subscription.worker_id.is_(None))
    )
    return bool(getattr(result, "rowcount", 0))


def tenant_of_queue(session: Session, queue: str) -> str | None:
    """The tenant of the subscription whose queue is ``queue`` (None: no subscription)."""
    found: str | None = session.scalar(
        select(Subscription.tenant).where(Subscription.queue == queue)
    )
    return found


def listed(
    session: Session, tenant: str, topic: str | None
) -> list[tuple[Subscription, Worker | None]]:
    """Every subscription of ``tenant`` (of ``topic``, a route topic) with its worker (None
    for a plain one), by topic and queue."""
    query = (
        select(Subscription, Worker)
        .outerjoin(Worker, Worker.id == Subscription.worker_id)
        .where(Subscription.tenant == tenant)
        .order_by(Subscription.topic, Subscription.queue)
    )
    if topic is not None:
        query = query.where(Subscription.topic == topic)
    return [(sub, worker) for sub, worker in session.execute(query).all()]
