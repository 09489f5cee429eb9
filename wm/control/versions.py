"""A worker's code versions: fetching and checking code, adding a version and making it
current (every node reloads it), rolling back to an earlier one, and reading them. A version
is never rewritten; a rollback points ``current_version`` back and is recorded as a
transition and a ``code_updated`` event."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from wm import store
from wm.control.context import Context
from wm.control.workers import Reference, Workers
from wm.engine import WorkerSpec, engine_class
from wm.errors import InvalidArgument, VersionNotFound
from wm.store import records
from wm.store import workers as rows
from wm.store.models import Worker
from wm.views import VersionInfo, WorkerInfo

if TYPE_CHECKING:
    from wm import codesource


class Versions:
    def __init__(self, context: Context, workers: Workers) -> None:
        self.context = context
        self.settings = context.settings
        self.workers = workers

    def fetch(
        self, code: bytes | str | None, url: str | None, sha256: str | None
    ) -> codesource.FetchedCode:
        """The code given inline or at ``url`` (SSRF-guarded), checked against ``sha256``."""
        from wm import codesource  # http.client and ssl: only a change of code needs them

        if (code is None) == (url is None):
            raise InvalidArgument("give exactly one of code= or url=")
        if url is not None:
            return codesource.from_url(url, settings=self.settings, sha256=sha256)
        assert code is not None
        return codesource.from_content(code, settings=self.settings, sha256=sha256)

    def check(self, mime_type: str, code: bytes, spec: WorkerSpec) -> None:
        """Refuse code its engine cannot load, before anything is persisted."""
        engine_class(mime_type)(self.settings).validate(code, spec)

    def update(
        self, reference: Reference, fetched: codesource.FetchedCode, note: str | None
    ) -> WorkerInfo:
        """Add ``fetched`` as the worker's next version and make it current (hot reload)."""
        info = self.workers.stored(reference)
        spec = WorkerSpec(
            str(info.id),
            info.topic,
            info.group,
            info.current_version + 1,
            fetched.sha256,
            info.name,
            info.settings,
            info.tenant,
        )
        self.check(info.mime_type, fetched.code, spec)

        def add(session: Session) -> None:
            worker = records.lock_worker(session, info.id, live=True)
            version = rows.latest_version(session, info.id) + 1
            add_version(session, info.id, version, fetched, note=note)
            self._make_current(session, worker, version, f"code updated to version {version}")

        records.transaction(self.settings, add)
        self.context.changed(info.id)
        return self.workers.get(info.id)

    def _make_current(self, session: Session, worker: Worker, version: int, reason: str) -> None:
        """Point the worker at ``version``: a transition that stays in its state, and the
        ``code_updated`` event."""
        worker.current_version = version
        records.record_transition(
            session,
            worker,
            worker.status,
            worker.status,
            reason,
            version=version,
            event="code_updated",
            actor=self.context.actor,
        )

    def rollback(self, reference: Reference, version: int) -> WorkerInfo:
        """Make an earlier version current again; recorded as a transition and an event."""
        wid = self.workers.resolve(reference)

        def rollback(session: Session) -> None:
            worker = records.lock_worker(session, wid, live=True)
            if not rows.has_version(session, wid, version):
                raise VersionNotFound(f"worker {wid} has no version {version}")
            reason = f"rolled back from version {worker.current_version} to version {version}"
            self._make_current(session, worker, version, reason)

        records.transaction(self.settings, rollback)
        self.context.changed(wid)
        return self.workers.get(wid)

    def history(self, reference: Reference) -> list[VersionInfo]:
        """Every code version, oldest first (a deleted worker's too, by its id, short id or
        name)."""
        wid = self.workers.any_id(reference)
        with store.session_scope(self.settings) as session:
            return rows.versions(session, wid)

    def code(self, reference: Reference, version: int | None = None) -> bytes:
        """The code of ``version`` (default: the current one)."""
        info = self.workers.stored(reference)
        with store.session_scope(self.settings) as session:
            found = rows.code(session, info.id, version or info.current_version)
        if found is None:
            raise VersionNotFound(f"worker {info.id} has no version {version}")
        return found


def add_version(
    session: Session,
    wid: uuid.UUID,
    version: int,
    fetched: codesource.FetchedCode,
    *,
    note: str | None,
) -> None:
    """Store ``fetched`` as version ``version`` of the worker."""
    rows.insert_version(
        session,
        wid,
        version,
        code=fetched.code,
        sha256=fetched.sha256,
        size=fetched.size,
        source_kind=fetched.source_kind,
        url=fetched.url,
        note=note,
    )
