"""Dead letters you can operate: kept in the database (list, filter, show, replay, purge) and
also published to the ``<topic>-dead`` topic for alerting and sinks."""

from __future__ import annotations

import builtins
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from wm import store
from wm.config import Settings
from wm.dataplane.bus import Bus, Route
from wm.dataplane.message import DeliveryState
from wm.dataplane.queues import worker_queue_name
from wm.errors import (
    DatabaseError,
    DeadLetterNotFound,
    InvalidArgument,
    WorkerNotFound,
    WorkManagerError,
)
from wm.events import make_event
from wm.lifecycle import Status
from wm.names import DEAD_SUFFIX
from wm.state.ledger import Ledger
from wm.store import records
from wm.store.models import DeadLetter, Worker
from wm.views import DeadLetterInfo

logger = logging.getLogger(__name__)
DEAD_LETTER_TYPE = "com.virtufin.workmanager.deadletter"
#: Longest error message kept in a dead letter (characters); the rest is cut, and says so.
MAX_ERROR_MESSAGE_CHARS = 8192
#: Longest envelope kept when the database refused the whole one (characters).
FALLBACK_ENVELOPE_CHARS = 65536
#: Length limit of the short text columns (error type, event id).
_SHORT_TEXT_CHARS = 255
#: Dead letters one purge statement deletes: a large purge goes in steps, each its own short
#: transaction, so it can report progress and never holds one huge lock.
PURGE_BATCH = 500

#: Told how many more dead letters were replayed or purged (``wm dlq``'s progress bar).
Progress = Callable[[int], None]


@dataclass(frozen=True)
class Failure:
    """Everything known about a delivery that is being parked.

    ``key`` is the event key (source + id) when the envelope has one; a malformed envelope
    is identified by its bytes instead.
    """

    topic: str
    worker_id: str | None
    envelope: str
    key: str | None
    event_id: str | None
    error_type: str
    error_message: str
    attempts: int
    version: int | None = None
    sha256: str | None = None
    fence: int | None = None
    first_failure_at: float | None = None

    @property
    def letter_id(self) -> str:
        basis = f"{self.worker_id}\x00{self.key or self.envelope}"
        return hashlib.sha256(basis.encode()).hexdigest()[:32]

    def storable(self, *, envelope_chars: int | None = None) -> Failure:
        """A copy every database accepts: no NUL characters (PostgreSQL's text type refuses
        them, and a worker's error message may hold any), bounded text columns."""
        return replace(
            self,
            envelope=_storable(self.envelope, envelope_chars),
            event_id=_storable(self.event_id, _SHORT_TEXT_CHARS) if self.event_id else None,
            error_type=_storable(self.error_type, _SHORT_TEXT_CHARS),
            error_message=_storable(self.error_message, MAX_ERROR_MESSAGE_CHARS),
        )


def _storable(text: str, limit: int | None) -> str:
    text = text.replace("\x00", "\\x00")
    if limit is None or len(text) <= limit:
        return text
    keep = max(0, limit - 40)  # room for the marker
    return f"{text[:keep]} [cut {len(text) - keep} characters]"


class DeadLetters:
    def __init__(self, settings: Settings, bus: Bus | None = None) -> None:
        self.settings = settings
        self.bus = bus or Bus(settings)

    def park(self, failure: Failure) -> str:
        """Store (upsert) the dead letter, publish it to ``<topic>-dead``, and settle the
        delivery in the pending ledger (it is done: parked).

        A letter the database refuses (an envelope too large, say) is stored as a bounded
        copy rather than failing again on every redelivery: parking always ends.
        """
        letter_id, sent = failure.letter_id, failure.envelope
        try:
            failure = self._store(letter_id, failure.storable())
        except DatabaseError as exc:
            if exc.transient:
                raise
            logger.error("dead letter %s refused (%s); storing a bounded copy", letter_id, exc)
            failure = self._store(
                letter_id, failure.storable(envelope_chars=FALLBACK_ENVELOPE_CHARS)
            )
        self.bus.publish(self._event(failure, letter_id), failure.topic + DEAD_SUFFIX)
        if failure.worker_id and failure.key:
            Ledger(self.settings).settle(failure.worker_id, failure.key, sent, ran_again=True)
        logger.warning(
            "dead-lettered %s for worker %s: %s: %s",
            failure.event_id,
            failure.worker_id,
            failure.error_type,
            failure.error_message,
        )
        return letter_id

    def _store(self, letter_id: str, failure: Failure) -> Failure:
        now = datetime.now(UTC)
        first = (
            datetime.fromtimestamp(failure.first_failure_at, UTC)
            if failure.first_failure_at
            else now
        )
        with store.session_scope(self.settings) as session:
            row = session.get(DeadLetter, letter_id)
            if row is None:
                row = DeadLetter(id=letter_id, replay_count=0, first_failure_at=first)
                session.add(row)
            row.topic, row.envelope = failure.topic, failure.envelope
            row.event_id = failure.event_id
            row.worker_id = uuid.UUID(failure.worker_id) if failure.worker_id else None
            row.error_type, row.error_message = failure.error_type, failure.error_message
            row.attempts, row.version = failure.attempts, failure.version
            row.sha256 = failure.sha256
            row.fence, row.last_failure_at, row.replayed_at = failure.fence, now, None
        return failure

    def _event(self, failure: Failure, letter_id: str) -> Any:
        data = asdict(failure)
        del data["first_failure_at"], data["key"]
        data["dead_letter_id"] = letter_id
        return make_event(
            DEAD_LETTER_TYPE,
            "/workmanager/deadletters",
            data,
            id=f"{letter_id}-{failure.attempts}",
            subject=failure.worker_id or failure.topic,
        )

    def list(
        self,
        *,
        topic: str | None = None,
        worker_id: str | None = None,
        error_type: str | None = None,
        include_replayed: bool = False,
        limit: int = 100,
    ) -> builtins.list[DeadLetterInfo]:
        with store.session_scope(self.settings) as session:
            query = self._filtered(topic, worker_id, error_type, include_replayed)
            rows = session.scalars(query.order_by(DeadLetter.last_failure_at).limit(limit)).all()
            return [records.dead_letter_info(r) for r in rows]

    def count(
        self,
        *,
        topic: str | None = None,
        worker_id: str | None = None,
        error_type: str | None = None,
        include_replayed: bool = False,
    ) -> int:
        """How many dead letters match (a purge by filter deletes replayed ones too)."""
        query = self._filtered(topic, worker_id, error_type, include_replayed)
        with store.session_scope(self.settings) as session:
            return int(session.scalar(select(func.count()).select_from(query.subquery())) or 0)

    def get(self, letter_id: str) -> DeadLetterInfo:
        """The dead letter with this id or short id (a unique prefix of 6 characters or more)."""
        with store.session_scope(self.settings) as session:
            return records.dead_letter_info(_row(session, letter_id))

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
        row = _row(session, letter_id, lock=True)
        worker = session.get(Worker, row.worker_id) if row.worker_id else None
        if worker is None or worker.status == Status.DELETED:
            raise WorkerNotFound(f"dead letter {letter_id}: its worker is gone; purge it instead")
        options: dict[str, Any] = {}
        if to_version == "same" and row.version is not None:
            options["kwargs"] = DeliveryState(pin_version=row.version).kwargs()
        route = Route(worker_queue_name(worker.topic, str(worker.id)), str(worker.id))
        self.bus.send(row.envelope, [route], **options)
        row.replay_count += 1
        row.replayed_at = datetime.now(UTC)

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
        selected = self._purge_selection(letter_ids, topic, worker_id, error_type)
        purged = 0
        for start in range(0, len(selected), PURGE_BATCH):
            batch = selected[start : start + PURGE_BATCH]
            with store.session_scope(self.settings) as session:
                result = session.execute(delete(DeadLetter).where(DeadLetter.id.in_(batch)))
                purged += int(getattr(result, "rowcount", 0) or 0)
            if progress is not None:
                progress(len(batch))
        return purged

    def _purge_selection(
        self,
        letter_ids: builtins.list[str] | None,
        topic: str | None,
        worker_id: str | None,
        error_type: str | None,
    ) -> builtins.list[str]:
        with store.session_scope(self.settings) as session:
            query = _where(select(DeadLetter.id), topic, worker_id, error_type)
            if letter_ids is not None:
                ids = [_row(session, letter_id).id for letter_id in letter_ids]
                query = query.where(DeadLetter.id.in_(ids))
            return builtins.list(session.scalars(query.order_by(DeadLetter.id)))

    @staticmethod
    def _filtered(
        topic: str | None, worker_id: str | None, error_type: str | None, include_replayed: bool
    ) -> Any:
        query = _where(select(DeadLetter), topic, worker_id, error_type)
        if not include_replayed:
            query = query.where(DeadLetter.replayed_at.is_(None))
        return query


def _row(session: Session, letter_id: str, *, lock: bool = False) -> DeadLetter:
    """The dead letter with this id, or the one whose id starts with it (a short id)."""
    row = session.get(DeadLetter, letter_id, with_for_update=lock)
    if row is None:
        full = records.by_prefix(session, DeadLetter.id, letter_id, "dead letter")
        row = None if full is None else session.get(DeadLetter, full, with_for_update=lock)
    if row is None:
        raise DeadLetterNotFound(f"no dead letter with id or short id {letter_id!r}")
    return row


def _where(query: Any, topic: str | None, worker_id: str | None, error_type: str | None) -> Any:
    if topic is not None:
        query = query.where(DeadLetter.topic == topic)
    if worker_id is not None:
        try:
            query = query.where(DeadLetter.worker_id == uuid.UUID(worker_id))
        except ValueError:
            raise InvalidArgument(f"worker filter {worker_id!r} is not a worker id") from None
    if error_type is not None:
        query = query.where(DeadLetter.error_type == error_type)
    return query
