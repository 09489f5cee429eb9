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
from wm.names import route_group
from wm.store import workers as rows
from wm.views import SessionInfo, TransitionInfo, WorkerInfo
from wm.workersettings import WorkerSettings

logger = logging.getLogger(__name__)

#: What names a worker: its id, the id's text, a short id, or a name.
Reference = uuid.UUID | str


class Workers:
    def __init__(self, context: Context) -> None:
        self.context = context
        self.settings = context.settings

    @property
    def tenant(self) -> str:
        return self.context.tenant

    def resolve(self, reference: Reference, *, deleted: bool = False) -> uuid.UUID:
        """Accept a UUID, its text, a live worker's name, or a unique short id (a prefix of
        at least 6 characters) of a live worker (of any worker with ``deleted``), of this
        tenant: another tenant's worker is not found, exactly as a missing one."""
        wid = _as_uuid(reference)
        if wid is not None:
            return self._own(wid)
        assert isinstance(reference, str)
        with store.session_scope(self.settings) as session:
            found = rows.live_named(session, self.tenant, reference)
            if found is None:
                found = rows.by_short_id(session, self.tenant, reference, deleted=deleted)
        if found is None:
            raise WorkerNotFound(f"no worker with id, short id or name {reference!r}")
        return found

    def _own(self, wid: uuid.UUID) -> uuid.UUID:
        """``wid`` unless it is another tenant's worker, which is not found as a worker no
        one has (a missing id goes on, to be not found where it is looked up)."""
        with store.session_scope(self.settings) as session:
            tenant = rows.tenant_of(session, wid)
        if tenant is not None and tenant != self.tenant:
            raise WorkerNotFound(f"no worker with id {wid}")
        return wid

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
            route = self.context.route_filter(topic)
            found = rows.find(
                session,
                tenant=self.tenant,
                topic=route,
                group=route_group(self.tenant, group),
                status=wanted,
            )
        return self.with_health(found)

    def names(
        self, worker_ids: Iterable[Reference | None], *, all_tenants: bool = False
    ) -> dict[str, str | None]:
        """Each worker's name (None if it has none) by its id as text, deleted workers too,
        in one query that asks Redis nothing: how a listing labels the workers it mentions.
        Another tenant's worker is left out, as a missing one, unless ``all_tenants``."""
        wanted = {uuid.UUID(str(worker_id)) for worker_id in worker_ids if worker_id}
        if not wanted:
            return {}
        with store.session_scope(self.settings) as session:
            return rows.names(session, wanted, None if all_tenants else self.tenant)

    def any_id(self, reference: Reference) -> uuid.UUID:
        """The id of a worker that exists, live or deleted, by its id, short id or name
        (:meth:`id_of`): what the history of a deleted worker is asked by."""
        wid = uuid.UUID(self.id_of(str(reference), deleted_names=True))
        with store.session_scope(self.settings) as session:
            if rows.tenant_of(session, wid) != self.tenant:  # missing, or another tenant's
                raise WorkerNotFound(f"no worker with id {wid}")
        return wid

    def id_of(self, reference: str, *, deleted_names: bool = False) -> str:
        """A worker's id from its id or short id (a deleted worker's too: its dead letters
        stay reachable) or from a live worker's name -- with ``deleted_names``, from a deleted
        worker's name as well, unless several deleted workers had it.

        An id is taken as given: it only ever filters this tenant's dead letters, where
        another tenant's worker's id finds none, exactly as a missing one (refusing it, as
        :meth:`resolve` does, would tell the two apart)."""
        wid = _as_uuid(reference)
        if wid is not None:
            return str(wid)
        try:
            return str(self.resolve(reference, deleted=True))
        except WorkerNotFound:
            if not deleted_names:
                raise
        with store.session_scope(self.settings) as session:
            gone = rows.deleted_named(session, self.tenant, reference)
        if len(gone) == 1:
            return str(gone[0])
        if gone:
            raise AmbiguousReference(
                f"{len(gone)} deleted workers were named {reference!r} "
                f"({', '.join(map(str, gone))}); give the worker's id"
            )
        raise WorkerNotFound(f"no worker with id, short id or name {reference!r}")

    def transitions(self, reference: Reference) -> builtins.list[TransitionInfo]:
        """The audit trail of state changes and code changes, oldest first (a deleted
        worker's too, by its id, short id or name: :meth:`id_of`)."""
        wid = self.any_id(reference)
        with store.session_scope(self.settings) as session:
            return rows.transitions(session, wid)

    def session(self, reference: Reference, session: str) -> SessionInfo:
        """Where the worker's session is bound (docs/guides/session-affinity.md)."""
        from wm.state.affinity import Affinity

        wid = self.stored(reference).id  # a missing id is not found here, as another tenant's
        instance, left_s = Affinity(self.settings).binding(str(wid), _session(session))
        return SessionInfo(wid, session, instance, left_s)

    def unbind_session(self, reference: Reference, session: str) -> bool:
        """End the session's binding: its next event binds to whichever instance takes it
        (and starts from that instance's memory). False when it had none."""
        from wm.state.affinity import Affinity

        wid = self.stored(reference).id
        return Affinity(self.settings).unbind(str(wid), _session(session))

    def with_health(self, infos: builtins.list[WorkerInfo]) -> builtins.list[WorkerInfo]:
        """Each worker's last health verdict (``unknown`` while Redis cannot be asked)."""
        from wm.state.health import UNKNOWN, WorkerHealth

        try:
            known = WorkerHealth(self.settings).known([str(i.id) for i in infos])
        except BrokerUnavailable as exc:
            logger.warning("workers' health unknown: %s", exc)
            return infos
        return [_judged(i, known.get(str(i.id), UNKNOWN)) for i in infos]


def _judged(info: WorkerInfo, health: str) -> WorkerInfo:
    """``info`` with its health, and paused while unhealthy if it pauses then."""
    from wm.state.health import UNHEALTHY

    pauses = WorkerSettings.of(info.settings).pause_when_unhealthy
    running = info.status == Status.RUNNING
    paused = UNHEALTHY if health == UNHEALTHY and pauses and running else None
    return dataclasses.replace(info, health=health, paused=paused)


def _as_uuid(reference: Reference) -> uuid.UUID | None:
    if isinstance(reference, uuid.UUID):
        return reference
    try:
        return uuid.UUID(reference)
    except ValueError:
        return None


def _status(value: str) -> Status:
    try:
        return Status(value)
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise InvalidArgument(f"unknown status {value!r}; known: {known}") from None


def _session(session: object) -> str:
    if not isinstance(session, str) or not session:
        raise InvalidArgument(f"a session must be a non-empty string, not {session!r}")
    return session
