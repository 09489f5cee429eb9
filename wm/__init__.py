"""WorkManager: deploy user code as long-lived workers that consume and publish CloudEvents.

The public API is re-exported here; everything else is internal. The control-plane classes
are imported on first use, so ``import wm`` stays light (the sandboxed DevKit and the engines
import parts of ``wm`` without pulling in SQLAlchemy or Celery).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from wm.errors import (
    AmbiguousReference,
    BrokerUnavailable,
    CodeSourceError,
    CodeSourceRefused,
    ConcurrencyConflict,
    ConfigurationError,
    Conflict,
    DeadLetterNotFound,
    DeliveryFailed,
    EngineError,
    EngineLoadError,
    EngineNotFound,
    EngineUnavailable,
    EventDecodeError,
    FenceRejected,
    IllegalTransition,
    InvalidArgument,
    InvalidCode,
    LockContention,
    Misconfigured,
    NotFound,
    PinMismatch,
    PublishInterrupted,
    Refused,
    ScheduleNotFound,
    StoreUnavailable,
    SubscriptionNotFound,
    TenantInUse,
    TenantLimitReached,
    TenantNotFound,
    TokenNotFound,
    Unavailable,
    VersionNotFound,
    WorkerExecutionError,
    WorkerNotFound,
    WorkerTimeout,
    WorkManagerError,
)

if TYPE_CHECKING:
    from wm.config import Settings
    from wm.control.deadletters import DeadLetters
    from wm.events import CloudEvent, decode, encode, make_event
    from wm.lifecycle import Status
    from wm.manager import WorkManager
    from wm.views import DeadLetterInfo, ScheduleInfo, TransitionInfo, VersionInfo, WorkerInfo

# Imported on first use too: ``wm --help`` (whose ``wm.cli`` imports ``wm.errors``, and so
# this package) loads no settings, events or CloudEvents library.
_LAZY = {
    "CloudEvent": "wm.events",
    "Settings": "wm.config",
    "Status": "wm.lifecycle",
    "decode": "wm.events",
    "encode": "wm.events",
    "make_event": "wm.events",
    "DeadLetterInfo": "wm.views",
    "DeadLetters": "wm.control.deadletters",
    "ScheduleInfo": "wm.views",
    "WorkManager": "wm.manager",
    "TransitionInfo": "wm.views",
    "VersionInfo": "wm.views",
    "WorkerInfo": "wm.views",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wm' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AmbiguousReference",
    "BrokerUnavailable",
    "CloudEvent",
    "CodeSourceError",
    "CodeSourceRefused",
    "ConcurrencyConflict",
    "ConfigurationError",
    "Conflict",
    "DeadLetterInfo",
    "DeadLetterNotFound",
    "DeadLetters",
    "DeliveryFailed",
    "EngineError",
    "EngineLoadError",
    "EngineNotFound",
    "EngineUnavailable",
    "EventDecodeError",
    "FenceRejected",
    "IllegalTransition",
    "InvalidArgument",
    "InvalidCode",
    "LockContention",
    "Misconfigured",
    "NotFound",
    "PinMismatch",
    "PublishInterrupted",
    "Refused",
    "ScheduleInfo",
    "ScheduleNotFound",
    "Settings",
    "Status",
    "StoreUnavailable",
    "SubscriptionNotFound",
    "TenantInUse",
    "TenantLimitReached",
    "TenantNotFound",
    "TokenNotFound",
    "TransitionInfo",
    "Unavailable",
    "VersionInfo",
    "VersionNotFound",
    "WorkManager",
    "WorkManagerError",
    "WorkerExecutionError",
    "WorkerInfo",
    "WorkerNotFound",
    "WorkerTimeout",
    "decode",
    "encode",
    "make_event",
]
