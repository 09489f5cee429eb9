"""The delivery features, in the order the pipeline calls their hooks
(``wm.dataplane.pipeline``). This list is the one place that names them: adding a feature is
one module here and one line below. Features never import each other."""

from __future__ import annotations

from wm.dataplane.features.affinity import SessionAffinity
from wm.dataplane.features.breaker import Breaker
from wm.dataplane.features.contention import Contention
from wm.dataplane.features.crashes import CrashCount
from wm.dataplane.features.engineload import EngineLoad
from wm.dataplane.features.errorevents import ErrorEvents
from wm.dataplane.features.grouplock import GroupLock
from wm.dataplane.features.health import Health
from wm.dataplane.features.hops import HopLimit
from wm.dataplane.features.interruption import Interruption
from wm.dataplane.features.metrics import Metrics
from wm.dataplane.features.ordering import Ordering
from wm.dataplane.features.pause import HealthPause
from wm.dataplane.features.quota import Quota
from wm.dataplane.features.replacement import Replacement
from wm.dataplane.features.retries import Retries
from wm.dataplane.features.slots import ConcurrencySlots
from wm.dataplane.features.tenantlimits import TenantLimits
from wm.dataplane.features.tracing import Tracing
from wm.dataplane.pipeline import Feature

FEATURES: tuple[Feature, ...] = (
    Replacement(),  # a settled message of a replaced process is acked; max_memory_mb
    HealthPause(),  # pause_when_unhealthy: an unhealthy worker's delivery goes back unattempted
    Quota(),  # max_events: one of the worker's slots, or requeued; the last one finishes it
    Ordering(),  # ordering=key: in its turn; a success or a dead letter ends the turn
    Tracing(),  # the delivery's span
    HopLimit(),  # WM_MAX_HOPS: a chain of workers that may loop is stopped
    CrashCount(),  # runs that ended with their process: parked past max_retries
    GroupLock(),  # a group's fenced lock around the call; an outcome found under it is reused
    ConcurrencySlots(),  # max_concurrency across the cluster
    TenantLimits(),  # the tenant's max_concurrency and rate_limit; waits are no failures
    Contention(),  # no lock, slot or turn: sent again later, no attempt used
    SessionAffinity(),  # session_key: a session's calls on the instance it is bound to
    Interruption(),  # killed by a stop: requeued, no failure
    Metrics(),  # how attempts end, for the observers
    EngineLoad(),  # code that cannot load here: the worker fails, the message waits
    ErrorEvents(),  # worker.error for every failed attempt
    Health(),  # the outcome tally behind a worker's health
    Breaker(),  # failure_threshold failures in a row: the recovery strategy
    Retries(),  # backoff and jitter up to max_retries, then the dead letter
)
