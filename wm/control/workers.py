"""Finding workers and reading their records: a reference (id, short id or name) to an id,
a worker with its last health verdict, listings, the names a listing labels workers with,
and the audit trail of transitions. Reads only: no data plane."""

from __future__ import annotations

import builtins
import dataclasses
import logging
import uuid
from collections.abc import Iterable

from wm import store
from wm.control.context import Context
from wm.errors import AmbiguousReference, BrokerUnavailable, InvalidArgument, WorkerNotFound
from wm.lifecycle import Status
from wm.state.health import WorkerHealth
from wm.store import workers as rows
from wm.views import TransitionInfo, WorkerInfo

logger = logging.getLogger(__name__)

#: What names a worker: its id, the id's text, a short id, or a name.
Reference = uuid.UUID | str


class Workers:
    def __init__(self, context: Context) -> None:
        self.settings = context.settings

    def resolve(self, reference: Reference, *, deleted: bool = False) -> uuid.UUID:
        """Accept a UUID, its text, a live worker's name, or a unique short id (a prefix of
        at least 6 characters) of a live worker (of any worker with ``deleted``)."""
        if isinstance(reference, uuid.UUID):
            return reference
        try:
            return uuid.UUID(reference)
        except ValueError:
            pass
        with store.session_scope(self.settings) as session:
            found = rows.live_named(session, reference)
            if found is None:
                found = rows.by_short_id(session, reference, deleted=deleted)
        if found is None:
            raise WorkerNotFound(f"no worker with id, short id or name {reference!r}")
        return found

    def stored(self, reference: Reference) -> WorkerInfo:
        """The worker as the database has it (no health: a lookup, not a view)."""
        wid = self.resolve(reference)
        with store.session_scope(self.settings) as session:
            found = rows.info(session, wid)
        if found is None:
            raise WorkerNotFound(f"no worker with id {wid}")
        return found

    def get(self, reference: Reference) -> WorkerInfo:
        return self.with_health([self.stored(reference)])[0]

    def list(
        self, *, topic: str | None = None, group: str | None = None, status: str | None = None
    ) -> builtins.list[WorkerInfo]:
        """Workers matching every given filter, oldest first; deleted ones only if asked."""
        wanted = None if status is None else _status(status)
        with store.session_scope(self.settings) as session:
            found = rows.find(session, topic=topic, group=group, status=wanted)
        return self.with_health(found)

    def names(self, worker_ids: Iterable[Reference | None]) -> dict[str, str | None]:
        """Each worker's name (None if it has none) by its id as text, deleted workers too,
        in one query that asks Redis nothing: how a listing labels the workers it mentions."""
        wanted = {uuid.UUID(str(worker_id)) for worker_id in worker_ids if worker_id}
        if not wanted:
            return {}
        with store.session_scope(self.settings) as session:
            return rows.names(session, wanted)

    def id_of(self, reference: str, *, deleted_names: bool = False) -> str:
        """A worker's id from its id or short id (a deleted worker's too: its dead letters
        stay reachable) or from a live worker's name -- with ``deleted_names``, from a deleted
        worker's name as well, unless several deleted workers had it."""
        try:
            return str(self.resolve(reference, deleted=True))
        except WorkerNotFound:
            if not deleted_names:
                raise
        with store.session_scope(self.settings) as session:
            gone = rows.deleted_named(session, reference)
        if len(gone) == 1:
            return str(gone[0])
        if gone:
            raise AmbiguousReference(
                f"{len(gone)} deleted workers were named {reference!r} "
                f"({', '.join(map(str, gone))}); give the worker's id"
            )
        raise WorkerNotFound(f"no worker with id, short id or name {reference!r}")

    def transitions(self, reference: Reference) -> builtins.list[TransitionInfo]:
        """The audit trail of state changes and code changes, oldest first."""
        wid = self.stored(reference).id
        with store.session_scope(self.settings) as session:
            return rows.transitions(session, wid)

    def with_health(self, infos: builtins.list[WorkerInfo]) -> builtins.list[WorkerInfo]:
        """Each worker's last health verdict (``unknown`` while Redis cannot be asked)."""
        try:
            known = WorkerHealth(self.settings).known([str(i.id) for i in infos])
        except BrokerUnavailable as exc:
            logger.warning("workers' health unknown: %s", exc)
            return infos
        return [dataclasses.replace(i, health=known.get(str(i.id), "unknown")) for i in infos]


def _status(value: str) -> Status:
    try:
        return Status(value)
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise InvalidArgument(f"unknown status {value!r}; known: {known}") from None
