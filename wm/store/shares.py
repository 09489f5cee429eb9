"""Shared groups (``group_mode=shared``, DESIGN.md §6): the members of a group on one topic
compete for the topic's events, and each event runs on one of them.

A share has no row of its own: it is the live members of a group on a topic whose setting
says ``shared``. Its id is derived from the topic and the group, a UUID, so its one queue is
named like a worker's (``<topic>::<share id>``) and its deliveries carry it where a worker's
carry the worker's id. The pending ledger, the recorded outcomes and the output ids of its
events belong to the share, not to the member that ran them: a redelivery that another
member picks up finds the outcome and republishes it instead of running again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from wm.errors import InvalidArgument
from wm.lifecycle import Status
from wm.store.models import Worker
from wm.workersettings import GROUP_MODES, WorkerSettings

#: The namespace of share ids (uuid5 of ``<topic>\n<group>``); never changes.
_NAMESPACE = uuid.UUID("5f2c3a9e-7d41-4b8a-9c0e-2a6b1d8f4e73")
_LIVE = Worker.status != Status.DELETED.value


def share_id(topic: str, group: str) -> str:
    """The id of the share of ``group`` on ``topic``."""
    return str(uuid.uuid5(_NAMESPACE, f"{topic}\n{group}"))


def share_of(topic: str, group: str | None, settings: Mapping[str, Any] | None) -> str | None:
    """The share a worker with these facts takes part in; None for any other worker."""
    if group and WorkerSettings.of(settings).shared:
        return share_id(topic, group)
    return None


def owner_of(worker: Worker) -> str:
    """Whose queue, pending ledger and outcomes the worker's deliveries use: its share's, or
    its own."""
    return share_of(worker.topic, worker.group, worker.settings) or str(worker.id)


@dataclass(frozen=True)
class Share:
    """A share as the data plane caches it: its id, topic and group, and its live members."""

    id: str
    topic: str
    group: str
    members: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps(
            {"id": self.id, "topic": self.topic, "group": self.group, "members": self.members}
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> Share:
        found = json.loads(raw)
        return cls(found["id"], found["topic"], found["group"], tuple(found["members"]))


def find(session: Session, share: str) -> Share | None:
    """The share with this id and its live members; None when it has none (or no such share
    was ever made). Its id names no column, so the live grouped workers are looked through."""
    rows = session.execute(
        select(Worker.id, Worker.topic, Worker.group, Worker.settings)
        .where(Worker.group.is_not(None), _LIVE)
        .order_by(Worker.created_at, Worker.id)
    ).all()
    members = [
        (str(wid), topic, group)
        for wid, topic, group, settings in rows
        if share_of(topic, group, settings) == share
    ]
    if not members:
        return None
    _, topic, group = members[0]
    return Share(share, topic, group, tuple(wid for wid, _, _ in members))


def check_group(group: str | None, mode: str) -> None:
    """Refuse a ``group_mode`` other than the default on a worker without a group."""
    if not group and mode != GROUP_MODES[0]:
        raise InvalidArgument(
            f"worker setting 'group_mode' {mode} needs a group: give the worker one"
        )


def lock_group(session: Session, group: str | None) -> None:
    """On PostgreSQL, hold a lock on the group's name until the transaction ends: members
    join and leave one at a time (SQLite writes one transaction at a time anyway)."""
    if group and session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"wm:group:{group}"))))


def check_mode(session: Session, group: str | None, mode: str) -> None:
    """Refuse a new member of ``group`` whose ``group_mode`` differs from its live members':
    a group is exclusive or shared as a whole. Run in the transaction that inserts it, under
    the group's lock, so two first members cannot race."""
    check_group(group, mode)
    if not group:
        return
    lock_group(session, group)
    rows = session.execute(
        select(Worker.id, Worker.settings).where(Worker.group == group, _LIVE)
    ).all()
    other = {WorkerSettings.of(settings).group_mode for _, settings in rows} - {mode}
    if other:
        raise InvalidArgument(
            f"group {group!r} is {other.pop()} (group_mode of its {len(rows)} live "
            f"member(s)); a worker with group_mode {mode} cannot join it: give the same "
            "group_mode, or another group"
        )


def others(session: Session, worker: Worker, *, running: bool) -> int:
    """Other live members of the worker's share (running ones only, with ``running``); 0 for
    a worker that is no shared member."""
    share = share_of(worker.topic, worker.group, worker.settings)
    if share is None:
        return 0
    wanted = Worker.status == Status.RUNNING.value if running else _LIVE
    rows = session.execute(
        select(Worker.settings).where(
            Worker.topic == worker.topic,
            Worker.group == worker.group,
            Worker.id != worker.id,
            wanted,
        )
    ).all()
    return sum(1 for (settings,) in rows if WorkerSettings.of(settings).shared)
