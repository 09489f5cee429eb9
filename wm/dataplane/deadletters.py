"""Parking a delivery that will not succeed: the dead letter is kept in the database (an
operator lists, replays and purges it through ``wm.control.deadletters``) and published to
the ``<topic>-dead`` topic for alerting and sinks."""

from __future__ import annotations

import base64
import hashlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from wm import store
from wm.config import Settings
from wm.errors import MalformedMessage, StoreUnavailable
from wm.events import make_event
from wm.names import DEAD_SUFFIX, SEPARATOR, split_route_topic
from wm.state.ledger import Ledger
from wm.store.models import DeadLetter
from wm.text import storable

if TYPE_CHECKING:
    from wm.dataplane.bus import Bus

logger = logging.getLogger(__name__)
DEAD_LETTER_TYPE = "com.virtufin.workmanager.deadletter"
#: Longest error message kept in a dead letter (characters); the rest is cut, and says so.
MAX_ERROR_MESSAGE_CHARS = 8192
#: Longest envelope kept when the database refused the whole one (characters).
FALLBACK_ENVELOPE_CHARS = 65536
#: Length limit of the short text columns (error type, event id).
_SHORT_TEXT_CHARS = 255


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
    #: The shared group whose queue the delivery came through (``wm.store.shares``): its
    #: pending ledger holds the delivery, not the worker's.
    share: str | None = None

    @property
    def letter_id(self) -> str:
        basis = f"{self.share or self.worker_id}\x00{self.key or self.envelope}"
        return hashlib.sha256(basis.encode()).hexdigest()[:32]

    def storable(self, *, envelope_chars: int | None = None) -> Failure:
        """A copy every database and log accepts (``wm.text.storable``: a worker's error
        message may hold anything), with bounded text columns."""
        return replace(
            self,
            envelope=storable(self.envelope, envelope_chars),
            event_id=storable(self.event_id, _SHORT_TEXT_CHARS) if self.event_id else None,
            error_type=storable(self.error_type, _SHORT_TEXT_CHARS),
            error_message=storable(self.error_message, MAX_ERROR_MESSAGE_CHARS),
        )


class DeadLetters:
    """Parks failed deliveries (``wm.control.deadletters.DeadLetters`` adds what an operator
    does with them)."""

    def __init__(
        self,
        settings: Settings,
        bus: Bus | None = None,
        make_bus: Callable[[], Bus] | None = None,
    ) -> None:
        self.settings = settings
        self._bus, self._make_bus = bus, make_bus

    @property
    def bus(self) -> Bus:
        """``bus``, or one made on first use (by ``make_bus`` if given): listing and reading
        letters never needs it, and ``wm dlq list`` answers sooner without loading Celery."""
        if self._bus is None and self._make_bus is not None:
            self._bus = self._make_bus()
        elif self._bus is None:
            from wm.dataplane.bus import Bus

            self._bus = Bus(self.settings)
        return self._bus

    def park(self, failure: Failure) -> str:
        """Store (upsert) the dead letter, publish it to ``<topic>-dead``, and settle the
        delivery in the pending ledger (it is done: parked).

        A letter the database refuses (an envelope too large, say) is stored as a bounded
        copy rather than failing again on every redelivery: parking always ends.
        """
        letter_id, sent = failure.letter_id, failure.envelope
        try:
            failure = self._store(letter_id, failure.storable())
        except StoreUnavailable as exc:
            if exc.transient:
                raise
            logger.error("dead letter %s refused (%s); storing a bounded copy", letter_id, exc)
            failure = self._store(
                letter_id, failure.storable(envelope_chars=FALLBACK_ENVELOPE_CHARS)
            )
        self.bus.publish(self._event(failure, letter_id), failure.topic + DEAD_SUFFIX)
        owner = failure.share or failure.worker_id
        if owner and failure.key:
            Ledger(self.settings).settle(owner, failure.key, sent, ran_again=True)
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
            # Locked: a replay in flight holds the row until it has marked it replayed, and
            # this failure must come after that mark, to clear it.
            row = session.get(DeadLetter, letter_id, with_for_update=True)
            if row is None:
                row = DeadLetter(id=letter_id, replay_count=0, first_failure_at=first)
                session.add(row)
            row.tenant = split_route_topic(failure.topic)[0]
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
        del data["first_failure_at"], data["key"], data["share"]
        data["dead_letter_id"] = letter_id
        data["topic"] = split_route_topic(failure.topic)[1]  # as its tenant names it
        return make_event(
            DEAD_LETTER_TYPE,
            "/workmanager/deadletters",
            data,
            id=f"{letter_id}-{failure.attempts}",
            subject=failure.worker_id or failure.topic,
        )


def malformed(queue: str, body: Any, content_type: str | None, reason: str) -> Failure:
    """The dead letter of a message of ``queue`` that is no delivery."""
    topic, _, tail = queue.rpartition(SEPARATOR)
    try:
        worker_id: str | None = str(uuid.UUID(tail))
    except ValueError:  # a plain subscription's queue, ``<topic>::sub::<name>``, or another
        head, _, kind = topic.rpartition(SEPARATOR)
        topic, worker_id = (head if kind == "sub" and head else queue), None
    error = MalformedMessage(f"{reason} (content type {content_type!r}, queue {queue!r})")
    return Failure(
        topic=topic,
        worker_id=worker_id,
        envelope=_text(body),
        key=None,
        event_id=None,
        error_type=type(error).__name__,
        error_message=str(error),
        attempts=1,
    )


def _text(body: Any) -> str:
    """The body as text; bytes that are not UTF-8 as ``base64:`` and their encoding."""
    if isinstance(body, str):
        return body
    raw = body if isinstance(body, bytes) else repr(body).encode()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(raw).decode("ascii")
