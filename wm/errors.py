"""The one exception tree of WorkManager.

Every error a user of the API or the CLI can see derives from :class:`WorkManagerError`.
Foreign errors (SQLAlchemy, redis, kombu, subprocess, engines) are translated at the
boundary with ``raise ... from exc`` so the message tells the operator what to do.
"""

from __future__ import annotations


class WorkManagerError(Exception):
    """Base class of every error WorkManager raises on purpose."""


class ConfigurationError(WorkManagerError):
    """Raised when an environment variable is unknown or its value is malformed."""


class InvalidArgument(WorkManagerError):
    """Raised when an argument of an API call or CLI command is missing or malformed."""


class WorkerNotFound(WorkManagerError):
    """Raised when no worker has the given id or name."""


class IllegalTransition(WorkManagerError):
    """Raised when a lifecycle operation is not allowed from the worker's current state."""


class ConcurrencyConflict(WorkManagerError):
    """Raised when a worker changed under a concurrent update and the change was not applied."""


class VersionNotFound(WorkManagerError):
    """Raised when a rollback names a code version the worker does not have."""


class EngineNotFound(WorkManagerError):
    """Raised when no engine is registered for a MIME type."""


class EngineUnavailable(WorkManagerError):
    """Raised when an engine is registered but its optional dependency is not installed."""


class InvalidCode(WorkManagerError):
    """Raised when an engine refuses worker code at create or update time."""


class WorkerExecutionError(WorkManagerError):
    """Raised when worker code fails while processing an event."""


class WorkerTimeout(WorkerExecutionError):
    """Raised when worker code exceeds its per-message time limit."""


class CodeSourceError(WorkManagerError):
    """Raised when worker code cannot be obtained (bad base64, fetch failure, size)."""


class SecurityError(CodeSourceError):
    """Raised when a code source is refused by a security rule; ``rule`` names the rule."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"refused by rule {rule!r}: {message}")
        self.rule = rule


class IntegrityError(CodeSourceError):
    """Raised when fetched code does not match its SHA-256 pin."""


class EventDecodeError(WorkManagerError):
    """Raised when bytes or a dict are not a valid CloudEvent."""


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


class LockContention(WorkManagerError):
    """Raised when a group lock could not be acquired within the configured retries."""


class FenceRejected(WorkManagerError):
    """Raised when a holder's lock was stolen and its write is refused by the fence check."""


class DeadLetterNotFound(WorkManagerError):
    """Raised when no dead letter has the given id."""
