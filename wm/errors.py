"""The one exception tree of WorkManager.

Every error a user of the API or the CLI can see derives from :class:`WorkManagerError`, and
each concrete error sits under exactly one group that says what the caller can do about it:

- :class:`NotFound` -- nothing has that id or name;
- :class:`Conflict` -- the thing is not in a state that allows the change, or changed under it;
- :class:`Refused` -- what the call was given (an argument, code, a code source, an event) is
  refused as it is;
- :class:`Unavailable` -- the database, the broker, Redis or a node cannot be reached;
- :class:`Misconfigured` -- this machine's setup (a setting, an install, a port) is wrong;
- :class:`DeliveryFailed` -- one delivery of an event ended in the data plane.

A boundary maps a whole group in one line: the admin API to an HTTP status
(``wm.ops.api.ERROR_STATUS``), the CLI to an exit code (``wm.cli.EXIT_CODES``). Foreign
errors (SQLAlchemy, redis, kombu, subprocess, engines) are translated at the boundary with
``raise ... from exc`` so the message tells the operator what to do, and no class here takes
the name of one of those libraries' exceptions.
"""

from __future__ import annotations

from typing import ClassVar


class WorkManagerError(Exception):
    """Raised, as one of its subclasses, for every error WorkManager raises on purpose.

    ``retryable`` is what the delivery policy reads when the error ends an attempt: false
    means no later attempt of the same delivery can succeed, so it is dead-lettered at once.
    """

    retryable: ClassVar[bool] = True


# -- the groups ----------------------------------------------------------------------------


class NotFound(WorkManagerError):
    """Raised when nothing has the id or name a call gives."""


class Conflict(WorkManagerError):
    """Raised when a change is not allowed in the current state, or the state changed under
    it: read again, then decide."""


class Refused(WorkManagerError):
    """Raised when what a call was given -- an argument, worker code, a code source, an
    event -- is refused as it is: the same call fails again until the input, or this node's
    engines, change."""


class Unavailable(WorkManagerError):
    """Raised when a service WorkManager needs -- the database, the broker, Redis, a node --
    cannot be reached or refused the operation; the message names the setting to check. The
    data plane requeues a delivery that meets it: no failure of the worker's."""


class Misconfigured(WorkManagerError):
    """Raised when this machine's setup is wrong -- a setting, a missing program, a port or a
    directory taken -- so nothing works until the operator fixes it."""


class DeliveryFailed(WorkManagerError):
    """Raised in the data plane when one delivery of an event ends without success: the
    worker's code failed, the message is no delivery, or another delivery holds what it
    needs. ``retryable`` tells the delivery policy whether a later attempt can succeed."""


#: Every group, in the order a boundary tries them; each concrete error is under exactly one.
GROUPS: tuple[type[WorkManagerError], ...] = (
    NotFound,
    Conflict,
    Refused,
    Unavailable,
    Misconfigured,
    DeliveryFailed,
)


# -- not found -----------------------------------------------------------------------------


class WorkerNotFound(NotFound):
    """Raised when no worker has the given id or name (or a delivery's worker was deleted)."""

    retryable = False


class VersionNotFound(NotFound):
    """Raised when a rollback or a replay names a code version the worker does not have."""

    retryable = False


class SubscriptionNotFound(NotFound):
    """Raised when a plain subscription named for removal does not exist."""


class DeadLetterNotFound(NotFound):
    """Raised when no dead letter has the given id."""


class TokenNotFound(NotFound):
    """Raised when no admin API token in force has the given id or name."""


class ScheduleNotFound(NotFound):
    """Raised when no schedule has the given id."""


class TenantNotFound(NotFound):
    """Raised when a call names a tenant that was never created (``wm tenant create``)."""


# -- conflict ------------------------------------------------------------------------------


class IllegalTransition(Conflict):
    """Raised when a lifecycle operation is not allowed from the worker's current state."""


class RecoveryRunning(Conflict):
    """Raised when recovery is asked for while another holds the recovery lease
    (``workmanager/recovery/leader``): one recovery at a time; ask again once it is done."""


class TenantInUse(Conflict):
    """Raised when a tenant to delete still has live workers, subscriptions or tokens in
    force (each is named), or is the default tenant, which always exists."""


class TenantLimitReached(Conflict):
    """Raised when a worker would take its tenant past its ``max_workers`` limit
    (``wm tenant set NAME --max-workers N`` raises it; deleting a worker frees one)."""


class ConcurrencyConflict(Conflict):
    """Raised when a worker changed under a concurrent update and the change was not applied."""


# -- refused -------------------------------------------------------------------------------


class InvalidArgument(Refused):
    """Raised when an argument of an API call or CLI command is missing or malformed."""


class AmbiguousReference(InvalidArgument):
    """Raised when a short id (a prefix) names more than one worker, dead letter, schedule or
    token; the message lists the candidates."""


class EventDecodeError(Refused):
    """Raised when bytes or a dict are not a valid CloudEvent."""

    retryable = False


class CodeSourceError(Refused):
    """Raised when worker code cannot be obtained (bad base64, fetch failure, size)."""


class CodeSourceRefused(CodeSourceError):
    """Raised when a code source is refused by a security rule; ``rule`` names the rule."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"refused by rule {rule!r}: {message}")
        self.rule = rule


class PinMismatch(CodeSourceError):
    """Raised when fetched code does not match its SHA-256 pin; the message names both
    digests."""


class EngineError(WorkManagerError):
    """Raised when an engine cannot run a worker's code; the subclass says who is at fault.

    Not a group: what the caller can do differs, so :class:`EngineLoadError` is also
    :class:`Refused` and :class:`WorkerExecutionError` is also :class:`DeliveryFailed`."""


class EngineLoadError(EngineError, Refused):
    """Raised when a worker's code cannot be loaded on this node. A delivery that meets it
    moves the worker to ``failed`` and keeps the message for when the worker is repaired."""


class EngineNotFound(EngineLoadError):
    """Raised when no engine is registered for a MIME type."""


class EngineUnavailable(EngineLoadError):
    """Raised when an engine is registered but its optional dependency is not installed."""


class InvalidCode(EngineLoadError):
    """Raised when an engine refuses worker code at create, update or load time."""


# -- unavailable ---------------------------------------------------------------------------


class StoreUnavailable(Unavailable):
    """Raised when the worker store (the database) cannot be reached, is not migrated, or
    refuses a query.

    ``transient`` is true for lock timeouts and serialization failures, which a retry fixes.
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class BrokerUnavailable(Unavailable):
    """Raised when the message broker or Redis cannot be reached."""


class PublishInterrupted(BrokerUnavailable):
    """Raised when ``publish_many`` could not publish a batch: the first ``sent`` events were
    published (``reached``: the subscriptions each reached), the others were not (publishing
    them again is safe: deliveries to workers are idempotent by event id)."""

    def __init__(self, message: str, reached: list[int]) -> None:
        super().__init__(message)
        self.reached = reached
        self.sent = len(reached)


class NodeUnavailable(Unavailable):
    """Raised when a node does not answer: its health endpoint (``wm health``), or the node
    ``wm up`` started, which exited or stayed silent."""


# -- misconfigured -------------------------------------------------------------------------


class ConfigurationError(Misconfigured):
    """Raised when an environment variable is unknown, or its value is malformed or cannot
    work here (a port taken, a database number a Redis Cluster does not have)."""


class MissingDependency(Misconfigured):
    """Raised when a feature needs a module this installation lacks; the message names the
    extra to install (an engine's own dependency raises :class:`EngineUnavailable`)."""


class EmbeddedRedisError(Misconfigured):
    """Raised when the embedded Redis of ``wm up`` cannot be found, started or stopped."""


# -- delivery failed -----------------------------------------------------------------------


class WorkerExecutionError(EngineError, DeliveryFailed):
    """Raised when worker code fails while processing an event (retried, then parked).

    ``error_type`` is what the ``worker.error`` lifecycle event reports: this class's name,
    or, for an exception the worker's own code threw in another language, that exception's
    type (a .NET worker's ``System.InvalidOperationException``). ``process_exited``: the
    process running the code (a sandbox, a helper) ended during the call: seed 004's
    "process exit" kind of failure (``recovery_on_crash``)."""

    def __init__(
        self, *args: object, error_type: str | None = None, process_exited: bool = False
    ) -> None:
        super().__init__(*args)
        self.error_type = error_type or type(self).__name__
        self.process_exited = process_exited


class WorkerTimeout(WorkerExecutionError):
    """Raised when worker code exceeds its per-message time limit. ``stray``: the call could
    not be stopped and its code still runs in this process (a .NET task spinning after an
    ``await``); the data plane replaces the process once the delivery has ended."""

    def __init__(self, *args: object, stray: bool = False) -> None:
        super().__init__(*args)
        self.stray = stray


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


class OutputTooLarge(OutputRefused):
    """Raised when the events a worker returned for one message exceed
    ``WM_MAX_OUTPUT_BYTES`` (the same cap for every engine). Parked at once."""


class GatewayError(DeliveryFailed):
    """Raised in worker code when a gateway call fails, times out or is refused; uncaught, it
    fails the delivery like any error of the worker's code (an outage of the platform is
    :class:`Unavailable` instead, and requeues the delivery)."""


class HopLimitExceeded(DeliveryFailed):
    """Raised when an event has already passed through WM_MAX_HOPS workers: a chain that
    loops (a worker whose output feeds itself) is parked instead of running for ever."""

    retryable = False


class IdempotencyKeyMissing(DeliveryFailed):
    """Raised when an event lacks the business key its worker declares (``idempotency_key``):
    it is parked at once, never run, since running it could repeat a business operation."""

    retryable = False


class MalformedMessage(DeliveryFailed):
    """Raised for a message on a WorkManager queue that is no delivery at all (raw bytes, a
    content type the nodes refuse, an unknown task): it is parked with its bytes."""

    retryable = False


class DeliveryLimitExceeded(DeliveryFailed):
    """Raised when RabbitMQ gave a message up after WM_AMQP_DELIVERY_LIMIT deliveries of a
    quorum queue without an acknowledgement: it is parked, not dropped."""

    retryable = False


class RequeueLimitExceeded(DeliveryFailed):
    """Raised when a message went back to its queue unsettled (the platform unavailable, a
    failure no one could judge) for longer than WM_REQUEUE_LIMIT_S: it is parked, naming the
    last cause, instead of looping for ever."""

    retryable = False


class TenantMismatch(DeliveryFailed):
    """Raised by the tenant guard when a delivery's event was published in another tenant
    than the worker whose queue it reached (a message forged or misrouted into another
    tenant's queue): it is refused before any store is touched, and dropped
    (docs/guides/tenants.md "What is isolated and what is shared")."""

    retryable = False


class DeadLettered(DeliveryFailed):
    """Raised by the consumer task once it parked its message as a dead letter, so Celery
    and Flower see the delivery fail (the message is acknowledged: the dead letter holds it).
    """

    retryable = False


class LockContention(DeliveryFailed):
    """Raised when a group lock could not be acquired within the configured retries."""


class TenantThrottled(DeliveryFailed):
    """Raised when a delivery finds its tenant at its ``max_concurrency`` or over its
    ``rate_limit``: it waits in the broker for ``delay_s`` seconds (never a failure, no
    retry used)."""

    def __init__(self, message: str, delay_s: float) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class FenceRejected(DeliveryFailed):
    """Raised when a holder's lock was stolen and its write is refused by the fence check."""
