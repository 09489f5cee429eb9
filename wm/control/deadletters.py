"""Dead letters as an operator works with them: list, filter, count, show, replay (rate
limited) and purge (in batches). The data plane parks them (the base class,
``wm.dataplane.deadletters``); a letter outlives its worker."""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.dataplane import deadletters as parking
from wm.dataplane.message import DeliveryState
from wm.dataplane.routes import worker_route
from wm.errors import InvalidArgument, WorkerNotFound, WorkManagerError
from wm.lifecycle import Status
from wm.names import DEFAULT_TENANT, route_topic
from wm.store import deadletters as letters
from wm.store import records
from wm.store.models import Worker
from wm.views import DeadLetterInfo

if TYPE_CHECKING:
    from wm.dataplane.bus import Bus

#: Dead letters one purge statement deletes: a large purge goes in steps, each its own short
#: transaction, so it can report progress and never holds one huge lock.
PURGE_BATCH = 500
#: Told how many more dead letters were replayed or purged (``wm dlq``'s progress bar).
Progress = Callable[[int], None]


class DeadLetters(parking.DeadLetters):
    """A tenant's dead letters (``tenant``: the default one unless given); another tenant's
    are not found, exactly as missing ones."""

    def __init__(
        self,
        settings: Settings,
        bus: Bus | None = None,
        tenant: str = DEFAULT_TENANT,
        make_bus: Callable[[], Bus] | None = None,
    ):
        super().__init__(settings, bus, make_bus)
        self.tenant = tenant

    def _filter(
        self,
        topic: str | None,
        worker_id: str | None,
        error_type: str | None,
        include_replayed: bool,
    ) -> letters.Filter:
        route = None if topic is None else route_topic(self.tenant, topic)
        return letters.Filter(route, worker_id, error_type, include_replayed, self.tenant)

    def list(
        self,
        *,
        topic: str | None = None,
        worker_id: str | None = None,
        error_type: str | None = None,
        include_replayed: bool = False,
        limit: int = 100,
    ) -> builtins.list[DeadLetterInfo]:
        """The letters matching every filter given, oldest failure first."""
        selected = self._filter(topic, worker_id, error_type, include_replayed)
        with store.session_scope(self.settings) as session:
            return letters.find(session, selected, limit)

    def count(
        self,
        *,
        topic: str | None = None,
        worker_id: str | None = None,
        error_type: str | None = None,
        include_replayed: bool = False,
    ) -> int:
        """How many dead letters match (a purge by filter deletes replayed ones too)."""
        selected = self._filter(topic, worker_id, error_type, include_replayed)
        with store.session_scope(self.settings) as session:
            return letters.count(session, selected)

    def get(self, letter_id: str) -> DeadLetterInfo:
        """The dead letter with this id or short id (a unique prefix of 6 characters or more)."""
        with store.session_scope(self.settings) as session:
            return records.dead_letter_info(letters.row(session, letter_id, self.tenant))

    def replay(
        self,
        letter_ids: builtins.list[str],
        *,
        to_version: str = "current",
        rate_per_s: float = 50.0,
        progress: Progress | None = None,
    ) -> int:
        """Send dead letters back to their worker's queue, at most ``rate_per_s`` per second.

        ``to_version`` is ``current`` (the worker's current code) or ``same`` (the version
        that failed). ``progress`` is told of each letter sent.
        """
        if to_version not in ("current", "same"):
            raise InvalidArgument("to_version must be 'current' or 'same'")
        if rate_per_s <= 0:
            raise InvalidArgument("rate_per_s must be positive")
        interval, sent = 1.0 / rate_per_s, 0
        for letter_id in letter_ids:
            started = time.monotonic()
            try:
                with store.session_scope(self.settings) as session:
                    self._replay_one(session, letter_id, to_version)
            except WorkManagerError as exc:
                raise type(exc)(f"{exc} ({sent} of {len(letter_ids)} replayed before)") from exc
            sent += 1
            if progress is not None:
                progress(1)
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
        return sent

    def _replay_one(self, session: Session, letter_id: str, to_version: str) -> None:
        row = letters.row(session, letter_id, self.tenant, lock=True)
        worker = session.get(Worker, row.worker_id) if row.worker_id else None
        if worker is None or worker.status == Status.DELETED:
            raise WorkerNotFound(f"dead letter {letter_id}: its worker is gone; purge it instead")
        route = worker_route(str(worker.id), worker.topic, worker.group, dict(worker.settings))
        options: dict[str, Any] = {}
        if to_version == "same" and row.version is not None:
            if route.share is not None:
                raise InvalidArgument(
                    f"dead letter {letter_id}: its worker is a member of shared group "
                    f"{route.share!r}, whose members may run other versions; replay it to "
                    "the current version"
                )
            options["kwargs"] = DeliveryState(pin_version=row.version).kwargs()
        # Marked (and the row written, under its lock) before the letter goes out: a node
        # that fails it again waits for this commit, then clears the mark. Marked after, a
        # fast second failure would be hidden as "replayed".
        letters.mark_replayed(row, datetime.now(UTC))
        session.flush()
        self.bus.send(row.envelope, [route], **options)

    def purge(
        self,
        letter_ids: builtins.list[str] | None = None,
        *,
        topic: str | None = None,
        worker_id: str | None = None,
        error_type: str | None = None,
        progress: Progress | None = None,
    ) -> int:
        """Delete the dead letters named (by id or short id, each of which must exist: a
        typo deletes nothing) and matching every filter given, :data:`PURGE_BATCH` at a
        time; ``progress`` is told of each batch deleted."""
        if letter_ids is None and topic is None and worker_id is None and error_type is None:
            raise InvalidArgument("purge needs dead-letter ids or at least one filter")
        selected = self._filter(topic, worker_id, error_type, True)
        with store.session_scope(self.settings) as session:
            chosen = letters.ids(session, selected, letter_ids)
        purged = 0
        for start in range(0, len(chosen), PURGE_BATCH):
            batch = chosen[start : start + PURGE_BATCH]
            with store.session_scope(self.settings) as session:
                purged += letters.remove(session, batch)
            if progress is not None:
                progress(len(batch))
        return purged
