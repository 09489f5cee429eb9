"""WorkManager: deploy user code as long-lived workers that consume and publish CloudEvents.

The public API is re-exported here; everything else is internal.
"""

from wm.config import Settings
from wm.deadletters import DeadLetterInfo, DeadLetters
from wm.errors import (
    BrokerUnavailable,
    CodeSourceError,
    ConcurrencyConflict,
    ConfigurationError,
    DeadLetterNotFound,
    EngineNotFound,
    EngineUnavailable,
    EventDecodeError,
    FenceRejected,
    IllegalTransition,
    IntegrityError,
    InvalidArgument,
    InvalidCode,
    LockContention,
    SecurityError,
    VersionNotFound,
    WorkerExecutionError,
    WorkerNotFound,
    WorkerTimeout,
    WorkManagerError,
)
from wm.events import CloudEvent, decode, encode, make_event
from wm.lifecycle import Status
from wm.manager import WorkManager
from wm.views import TransitionInfo, VersionInfo, WorkerInfo

__all__ = [
    "BrokerUnavailable",
    "CloudEvent",
    "CodeSourceError",
    "ConcurrencyConflict",
    "ConfigurationError",
    "DeadLetterInfo",
    "DeadLetterNotFound",
    "DeadLetters",
    "EngineNotFound",
    "EngineUnavailable",
    "EventDecodeError",
    "FenceRejected",
    "IllegalTransition",
    "IntegrityError",
    "InvalidArgument",
    "InvalidCode",
    "LockContention",
    "SecurityError",
    "Settings",
    "Status",
    "TransitionInfo",
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
