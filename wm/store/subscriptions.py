"""The control plane's statements on the subscriptions table: plain subscriptions (named
queues for sinks and observers) and the listing of every subscription. A worker's own
subscription comes and goes with the worker (``wm.store.workers``)."""

from __future__ import annotations

import uuid

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from wm.store.models import Subscription


def add_plain(session: Session, topic: str, queue: str) -> None:
    """Subscribe ``queue`` to ``topic`` unless it is subscribed already."""
    found = session.scalar(select(Subscription).where(Subscription.queue == queue))
    if found is None:
        session.add(Subscription(topic=topic, queue=queue, worker_id=None))


def remove_plain(session: Session, queue: str) -> bool:
    """Delete the plain subscription of ``queue``; False if there is none."""
    result = session.execute(
        delete(Subscription).where(Subscription.queue == queue, Subscription.worker_id.is_(None))
    )
    return bool(getattr(result, "rowcount", 0))


def listed(session: Session, topic: str | None) -> list[tuple[str, str, uuid.UUID | None]]:
    """Topic, queue and worker id (None for a plain one) of every subscription (of
    ``topic``), by topic and queue."""
    query = select(Subscription).order_by(Subscription.topic, Subscription.queue)
    if topic is not None:
        query = query.where(Subscription.topic == topic)
    return [(s.topic, s.queue, s.worker_id) for s in session.scalars(query).all()]
