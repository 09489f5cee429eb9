"""The one exception tree of WorkManager.

Every error a user of the API or the CLI can see derives from :class:`WorkManagerError`.
Foreign errors (SQLAlchemy, redis, kombu, subprocess, engines) are translated at the
boundary with ``raise ... from exc`` so the message tells the operator what to do.
"""

from __future__ import annotations

from typing import ClassVar


class WorkManagerError(Exception):
    """Base class of every error WorkManager raises on purpose.

    ``retryable`` is what the delivery policy reads when the error ends an attempt: false
    means no later attempt of the same delivery can succeed, so it is dead-lettered at once.
    """

    retryable: ClassVar[bool] = True


class ConfigurationError(WorkManagerError):
    """Raised when an environment variable is unknown or its value is malformed."""


class InvalidArgument(WorkManagerError):
    """Raised when an argument of an API call or CLI command is missing or malformed."""


class AmbiguousReference(InvalidArgument):
    """Raised when a short id (a prefix) names more than one worker, dead letter, schedule or
    token; the message lists the candidates."""


class WorkerNotFound(WorkManagerError):
    """Raised when no worker has the given id or name (or a delivery's worker was deleted)."""

    retryable = False


class IllegalTransition(WorkManagerError):
    """Raised when a lifecycle operation is not allowed from the worker's current state."""


class ConcurrencyConflict(WorkManagerError):
    """Raised when a worker changed under a concurrent update and the change was not applied."""


class VersionNotFound(WorkManagerError):
    """Raised when a rollback or a replay names a code version the worker does not have."""

    retryable = False


class EngineError(WorkManagerError):
    """Raised when an engine cannot run a worker's code; the subclass says who is at fault."""


class EngineLoadError(EngineError):
    """Raised when a worker's code cannot be loaded on this node. A delivery that meets it
    moves the worker to ``failed`` and keeps the message for when the worker is repaired."""


class EngineNotFound(EngineLoadError):
    """Raised when no engine is registered for a MIME type."""


class EngineUnavailable(EngineLoadError):
    """Raised when an engine is registered but its optional dependency is not installed."""


class InvalidCode(EngineLoadError):
    """Raised when an engine refuses worker code at create, update or load time."""


class WorkerExecutionError(EngineError):
    """Raised when worker code fails while processing an event (retried, then parked).

    ``error_type`` is what the ``worker.error`` lifecycle event reports: this class's name,
    or, for an exception the worker's own code threw in another language, that exception's
    type (a .NET worker's ``System.InvalidOperationException``)."""

    def __init__(self, *args: object, error_type: str | None = None) -> None:
        super().__init__(*args)
        self.error_type = error_type or type(self).__name__


class WorkerTimeout(WorkerExecutionError):
    """Raised when worker code exceeds its per-message time limit."""


class WorkerCrashed(WorkerExecutionError):
    """Raised instead of running an event again whose runs ended with the process running
    them (a crash in code that shares it, such as in-process native code) more often than
    the worker's retries allow: the event is parked rather than killing process after
    process."""

    retryable = False


class OutputRefused(WorkerExecutionError):
    """Raised when worker code returns an event for a topic it may not publish to: a
    reserved topic (lifecycle, dead letters), an invalid name, or one outside the worker's
    ``output_topics``. The same code would return it again, so it is parked at once."""

    retryable = False


class HopLimitExceeded(WorkManagerError):
    """Raised when an event has already passed through WM_MAX_HOPS workers: a chain that
    loops (a worker whose output feeds itself) is parked instead of running for ever."""

    retryable = False


class CodeSourceError(WorkManagerError):
    """Raised when worker code cannot be obtained (bad base64, fetch failure, size)."""


class SecurityError(CodeSourceError):
    """Raised when a code source is refused by a security rule; ``rule`` names the rule."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"refused by rule {rule!r}: {message}")
        self.rule = rule


class IntegrityError(CodeSourceError):
    """Raised when fetched code does not match its SHA-256 pin."""


class MalformedMessage(WorkManagerError):
    """Raised for a message on a WorkManager queue that is no delivery at all (raw bytes, a
    content type the nodes refuse, an unknown task): it is parked with its bytes."""

    retryable = False


class EventDecodeError(WorkManagerError):
    """Raised when bytes or a dict are not a valid CloudEvent."""

    retryable = False


class DatabaseError(WorkManagerError):
    """Raised when the worker store cannot be reached, is not migrated, or refuses a query.

    ``transient`` is true for lock timeouts and serialization failures, which a retry fixes.
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class SubscriptionNotFound(WorkManagerError):
    """Raised when a plain subscription named for removal does not exist."""


class BrokerUnavailable(WorkManagerError):
    """Raised when the message broker or Redis cannot be reached."""


class EmbeddedRedisError(WorkManagerError):
    """Raised when the embedded Redis of ``wm up`` cannot be found, started or stopped."""


class DeadLettered(WorkManagerError):
    """Raised by the consumer task once it parked its message as a dead letter, so Celery
    and Flower see the delivery fail (the message is acknowledged: the dead letter holds it).
    """

    retryable = False


class LockContention(WorkManagerError):
    """Raised when a group lock could not be acquired within the configured retries."""


class FenceRejected(WorkManagerError):
    """Raised when a holder's lock was stolen and its write is refused by the fence check."""


class DeadLetterNotFound(WorkManagerError):
    """Raised when no dead letter has the given id."""


class TokenNotFound(WorkManagerError):
    """Raised when no admin API token in force has the given id or name."""


class ScheduleNotFound(WorkManagerError):
    """Raised when no schedule has the given id."""
