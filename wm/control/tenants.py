"""Tenants: created explicitly (``wm tenant create``), listed, their limits set (``wm tenant
set``), and the check that a tenant a call names exists. The default tenant always exists: a
single-tenant deployment never names one."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.errors import (
    InvalidArgument,
    TenantInUse,
    TenantLimitReached,
    TenantNotFound,
    Unavailable,
)
from wm.names import DEFAULT_TENANT, check_tenant
from wm.store import tenants as rows
from wm.tenantlimits import TenantLimits
from wm.views import TenantInfo

logger = logging.getLogger(__name__)


def checked(settings: Settings, tenant: object) -> str:
    """``tenant`` if it is a valid name of a tenant that exists; the default tenant is taken
    as existing without asking the database."""
    name = check_tenant(tenant)
    if name != DEFAULT_TENANT:
        with store.session_scope(settings) as session:
            if not rows.exists(session, name):
                raise _missing(name)
    return name


def _missing(name: str) -> TenantNotFound:
    return TenantNotFound(f"no tenant {name!r}; an admin creates it with: wm tenant create {name}")


def create(
    settings: Settings, name: object, limits: Mapping[str, object] | None = None
) -> TenantInfo:
    """A new tenant with ``limits`` (by name; unlimited where not given); one that exists
    already is refused (its name is taken)."""
    name = check_tenant(name)
    checked_limits = TenantLimits().changed(limits or {})
    try:
        with store.session_scope(settings) as session:
            if rows.exists(session, name):
                raise InvalidArgument(f"tenant {name!r} exists already")
            return rows.info(rows.insert(session, name, checked_limits), 0)
    except IntegrityError as exc:  # created concurrently
        raise InvalidArgument(f"tenant {name!r} exists already") from exc


def set_limits(settings: Settings, name: object, limits: Mapping[str, object]) -> TenantInfo:
    """Change the limits ``limits`` names (None: unlimited) and keep the others. Every node
    sees them at its next delivery to one of the tenant's workers: their cached facts carry
    them and are dropped here."""
    name = check_tenant(name)
    if not limits:
        raise InvalidArgument(
            "give at least one limit to set: " + ", ".join(TenantLimits().to_json())
        )
    with store.session_scope(settings) as session:
        row = rows.locked(session, name)
        if row is None:
            raise _missing(name)
        changed = rows.limits_of(row).changed(limits)
        for limit, value in changed.to_json().items():
            setattr(row, limit, value)
        session.flush()
        info = rows.info(row, rows.live_workers(session, name))
        workers = rows.worker_ids(session, name)
    _forget(settings, [str(w) for w in workers])
    return info


def _forget(settings: Settings, worker_ids: list[str]) -> None:
    """Nodes read the workers' facts (with the tenant's limits) afresh; an entry whose
    invalidation is lost expires within a minute (``wm.state.directory``)."""
    from wm.state.directory import Directory  # Redis: only a change needs it

    directory = Directory(settings)
    try:
        for worker_id in worker_ids:
            directory.invalidate(worker_id)
    except Unavailable as exc:
        logger.warning("tenant limits stored; nodes see them within a minute (%s)", exc)


def check_room(session: Session, tenant: str) -> None:
    """Inside a worker's creation: refuse it if the tenant has ``max_workers`` live workers
    already. The tenant's row stays locked until the creation commits."""
    row = rows.locked(session, tenant)
    limit = rows.limits_of(row).max_workers
    if limit is None:
        return
    live = rows.live_workers(session, tenant)
    if live >= limit:
        raise TenantLimitReached(
            f"tenant {tenant!r} has {live} live workers, its max_workers limit is {limit}: "
            f"delete one, or raise the limit (wm tenant set {tenant} --max-workers N)"
        )


def listing(settings: Settings) -> list[TenantInfo]:
    """Every tenant, by name, with its count of live workers and its limits."""
    with store.session_scope(settings) as session:
        return rows.listing(session)


#: Names shown per kind in a refused deletion's message.
SHOWN = 5


def delete(settings: Settings, name: object) -> None:
    """Delete a tenant that has no live workers, plain subscriptions or tokens in force
    (:class:`TenantInUse` names what remains); the default tenant is never deleted. Its
    history stays: deleted workers and their versions, dead letters, audit entries."""
    name = check_tenant(name)
    if name == DEFAULT_TENANT:
        raise TenantInUse(f"the {DEFAULT_TENANT!r} tenant always exists: it cannot be deleted")
    with store.session_scope(settings) as session:
        if not rows.exists(session, name):
            raise TenantNotFound(f"no tenant {name!r}")
        left = rows.remaining(session, name)
        if left:
            raise TenantInUse(
                f"tenant {name!r} is in use, nothing was deleted; first delete or revoke its "
                + "; ".join(f"{kind}: {_some(names)}" for kind, names in left.items())
            )
        rows.remove(session, name)


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown if len(names) <= SHOWN else f"{shown} and {len(names) - SHOWN} more"
