"""The ``tenants`` table: which tenants exist (the default one always does) and their limits."""

from __future__ import annotations

import uuid

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from wm.store.models import ApiToken, Subscription, Tenant, Worker
from wm.store.workers import LIVE
from wm.tenantlimits import NAMES, TenantLimits
from wm.views import TenantInfo


def exists(session: Session, name: str) -> bool:
    return session.get(Tenant, name) is not None


def insert(session: Session, name: str, limits: TenantLimits) -> Tenant:
    tenant = Tenant(name=name, **limits.to_json())
    session.add(tenant)
    session.flush()
    return tenant


def limits_of(row: Tenant | None) -> TenantLimits:
    """The row's limits (none for a tenant without a row: unlimited)."""
    if row is None:
        return TenantLimits()
    return TenantLimits(**{name: getattr(row, name) for name in NAMES})


def locked(session: Session, name: str) -> Tenant | None:
    """The tenant's row, locked until the transaction ends: creations in one tenant check
    its ``max_workers`` one after the other, so concurrent ones never overshoot it."""
    return session.scalars(select(Tenant).where(Tenant.name == name).with_for_update()).first()


def live_workers(session: Session, name: str) -> int:
    query = select(func.count()).select_from(Worker).where(LIVE, Worker.tenant == name)
    return int(session.scalar(query) or 0)


def worker_ids(session: Session, name: str) -> list[uuid.UUID]:
    """Every worker of the tenant (deleted ones too: a node may still hold their facts)."""
    return list(session.scalars(select(Worker.id).where(Worker.tenant == name)).all())


def listing(session: Session) -> list[TenantInfo]:
    """Every tenant with its count of live workers and its limits, by name."""
    counts = dict(
        session.execute(
            select(Worker.tenant, func.count()).where(LIVE).group_by(Worker.tenant)
        ).all()
    )
    rows = session.scalars(select(Tenant).order_by(Tenant.name)).all()
    return [info(t, int(counts.get(t.name, 0))) for t in rows]


def info(row: Tenant, workers: int) -> TenantInfo:
    return TenantInfo(row.name, row.created_at, workers, limits_of(row))


def count(session: Session) -> int:
    return len(session.scalars(select(Tenant.name)).all())


def remaining(session: Session, name: str) -> dict[str, list[str]]:
    """What keeps tenant ``name`` from being deleted: its live workers (by name or id), its
    plain subscriptions (by queue) and its tokens in force (by name); empty kinds left out."""
    workers = session.execute(
        select(Worker.id, Worker.name).where(LIVE, Worker.tenant == name).order_by(Worker.id)
    ).all()
    queues = session.scalars(
        select(Subscription.queue)
        .where(Subscription.tenant == name, Subscription.worker_id.is_(None))
        .order_by(Subscription.queue)
    ).all()
    tokens = session.scalars(
        select(ApiToken.name)
        .where(ApiToken.tenant == name, ApiToken.revoked_at.is_(None))
        .order_by(ApiToken.name)
    ).all()
    found = {
        "live workers": [n or str(i) for i, n in workers],
        "subscriptions": list(queues),
        "tokens in force": list(tokens),
    }
    return {kind: names for kind, names in found.items() if names}


def remove(session: Session, name: str) -> bool:
    """Delete the tenant's row; False if there was none."""
    gone = session.execute(delete(Tenant).where(Tenant.name == name))
    return bool(gone.rowcount)  # type: ignore[attr-defined]
