"""The statements an operator's look at dead letters runs: filter, count, find by short id,
delete, and the counts the status views show. Parking a letter is the data plane's
(``wm.dataplane.deadletters``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from wm.errors import DeadLetterNotFound, InvalidArgument
from wm.names import DEFAULT_TENANT
from wm.store import records
from wm.store.models import DeadLetter
from wm.views import DeadLetterInfo


@dataclass(frozen=True)
class Filter:
    """Which dead letters a call means: every filter given must match."""

    topic: str | None = None
    #: A worker's id (as text).
    worker_id: str | None = None
    error_type: str | None = None
    #: Letters replayed already match too.
    include_replayed: bool = True
    #: Only this tenant's letters (``topic``: a route topic of it).
    tenant: str = DEFAULT_TENANT

    def where(self, query: Any) -> Any:
        query = query.where(DeadLetter.tenant == self.tenant)
        if self.topic is not None:
            query = query.where(DeadLetter.topic == self.topic)
        if self.worker_id is not None:
            try:
                query = query.where(DeadLetter.worker_id == uuid.UUID(self.worker_id))
            except ValueError:
                raise InvalidArgument(
                    f"worker filter {self.worker_id!r} is not a worker id"
                ) from None
        if self.error_type is not None:
            query = query.where(DeadLetter.error_type == self.error_type)
        if not self.include_replayed:
            query = query.where(DeadLetter.replayed_at.is_(None))
        return query


def find(session: Session, selected: Filter, limit: int) -> list[DeadLetterInfo]:
    """The letters selected, oldest failure first, at most ``limit``."""
    query = selected.where(select(DeadLetter)).order_by(DeadLetter.last_failure_at).limit(limit)
    return [records.dead_letter_info(r) for r in session.scalars(query).all()]


def count(session: Session, selected: Filter) -> int:
    query = selected.where(select(DeadLetter))
    return int(session.scalar(select(func.count()).select_from(query.subquery())) or 0)


def row(session: Session, letter_id: str, tenant: str, *, lock: bool = False) -> DeadLetter:
    """The tenant's dead letter with this id, or the one whose id starts with it (a short
    id); another tenant's is not found, exactly as a missing one."""
    found = session.get(DeadLetter, letter_id, with_for_update=lock)
    if found is None:
        mine = DeadLetter.tenant == tenant
        full = records.by_prefix(session, DeadLetter.id, letter_id, "dead letter", mine)
        found = None if full is None else session.get(DeadLetter, full, with_for_update=lock)
    if found is None or found.tenant != tenant:
        raise DeadLetterNotFound(f"no dead letter with id or short id {letter_id!r}")
    return found


def ids(session: Session, selected: Filter, letter_ids: list[str] | None) -> list[str]:
    """The full ids of the letters selected and (if given) named, each of which must exist."""
    query = selected.where(select(DeadLetter.id))
    if letter_ids is not None:
        named = [row(session, i, selected.tenant).id for i in letter_ids]
        query = query.where(DeadLetter.id.in_(named))
    return list(session.scalars(query.order_by(DeadLetter.id)))


def remove(session: Session, letter_ids: list[str]) -> int:
    """Delete these letters; returns how many there were."""
    result = session.execute(delete(DeadLetter).where(DeadLetter.id.in_(letter_ids)))
    return int(getattr(result, "rowcount", 0) or 0)


# -- what the status views count --------------------------------------------------------------


def waiting_by_topic(session: Session, tenant: str | None = None) -> dict[str, int]:
    """Letters not replayed (of ``tenant`` unless None), per route topic."""
    query = select(DeadLetter.topic, func.count()).where(DeadLetter.replayed_at.is_(None))
    if tenant is not None:
        query = query.where(DeadLetter.tenant == tenant)
    rows = session.execute(query.group_by(DeadLetter.topic).order_by(DeadLetter.topic)).all()
    return {topic: int(n) for topic, n in rows}


def waiting_of(session: Session, wid: uuid.UUID) -> int:
    """The worker's letters not replayed."""
    query = (
        select(func.count())
        .select_from(DeadLetter)
        .where(DeadLetter.worker_id == wid, DeadLetter.replayed_at.is_(None))
    )
    return int(session.scalar(query) or 0)


def newest_of(session: Session, wid: uuid.UUID) -> DeadLetterInfo | None:
    """The worker's letter that failed last."""
    query = select(DeadLetter).where(DeadLetter.worker_id == wid)
    found = session.scalars(query.order_by(DeadLetter.last_failure_at.desc()).limit(1)).first()
    return None if found is None else records.dead_letter_info(found)


def mark_replayed(letter: DeadLetter, at: datetime) -> None:
    """Count a replay of ``letter`` (its row, read in this session)."""
    letter.replay_count += 1
    letter.replayed_at = at
