"""Per-worker settings: one frozen, typed value (STYLE.md habit 17).

Stored as the JSON object the operator gave (``workers.settings``: only the keys set), read
everywhere as :class:`WorkerSettings`, whose fields carry their unit, default and rule. An
engine adds the settings it reads (``wm.engine.Engine.worker_settings``); they travel in
:attr:`WorkerSettings.engine`. Anything else is refused at create/update, naming the key.

Each delivery feature (``wm.dataplane.features``) declares the fields it owns; defaults that
come from the node's environment (``timeout_s``, ``max_retries``, ``retry_base_delay_ms``)
are None here and resolved against :class:`wm.config.Settings` by the ``*_on`` methods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from wm.config import Settings
from wm.errors import InvalidArgument
from wm.idempotency import key_source
from wm.names import check_name


@dataclass(frozen=True)
class SettingRule:
    """What one per-worker setting may hold: a non-negative number of ``types``, or with
    ``text``, a non-empty string (one of ``choices`` when given, and one ``valid`` accepts:
    it raises :class:`InvalidArgument` naming what is wrong), or with ``flag``, true or
    false."""

    types: tuple[type, ...] = (int,)
    text: bool = False
    choices: tuple[str, ...] | None = None
    valid: Callable[[str], object] | None = None
    flag: bool = False

    def check(self, key: str, value: Any) -> Any:
        if self.flag:
            if not isinstance(value, bool):
                raise InvalidArgument(f"worker setting {key!r} must be true or false")
            return value
        if self.text:
            if not isinstance(value, str) or not value:
                raise InvalidArgument(f"worker setting {key!r} must be a non-empty string")
            if self.choices is not None and value not in self.choices:
                choices = ", ".join(self.choices)
                raise InvalidArgument(f"worker setting {key!r} must be one of {choices}")
            if self.valid is not None:
                self.valid(value)
            return value
        if isinstance(value, bool) or not isinstance(value, self.types) or value < 0:  # type: ignore[operator]
            raise InvalidArgument(f"worker setting {key!r} must be a non-negative number")
        return value


NUMBER = SettingRule((int, float))
COUNT = SettingRule()
#: Per-worker allow-list: the only topics the worker's outputs may go to.
OUTPUT_TOPICS = "output_topics"
#: Recovery strategies (seed 004); the first is the default of ``recovery``.
STRATEGIES = ("retry", "degrade", "stop", "replace", "remove")
#: Strategies under which the failing delivery goes back to the queue (nothing is parked).
PAUSING = frozenset({"retry", "stop", "remove"})
#: Kinds of failure, each with its strategy (seed 004's ``determine_strategy``): a delivery
#: that ended with its process (``crash``), outlived its time limit (``timeout``) or failed
#: otherwise (``error``) when the circuit breaker trips, and ``health``: max_probe_failures
#: failed probes in a row. Its default strategy when neither it nor ``recovery`` is set.
KIND_DEFAULTS: Mapping[str, str] = MappingProxyType(
    {"crash": "replace", "timeout": "retry", "error": "retry", "health": "remove"}
)
#: A probe is its own retry: the health kind has every strategy but ``retry``.
HEALTH_STRATEGIES = ("remove", "degrade", "stop", "replace")
ORDERINGS = ("none", "key")
#: How the members of a group share its topic's events (DESIGN.md §6); the first is the default.
GROUP_MODES = ("exclusive", "shared")


def _setting(default: Any, rule: SettingRule | None) -> Any:
    return field(default=default, metadata={"rule": rule})


@dataclass(frozen=True)
class WorkerSettings:
    """Every per-worker knob with its default. None: the node's setting of the same name."""

    #: the code's time limit per message (None: MESSAGE_HANDLING_TIMEOUT_SECONDS)
    timeout_s: float | None = _setting(None, NUMBER)
    #: retries before a dead letter (None: WM_MAX_RETRIES)
    max_retries: int | None = _setting(None, COUNT)
    #: the first retry's back-off (None: WM_RETRY_BASE_DELAY_MS), doubling each attempt
    retry_base_delay_ms: int | None = _setting(None, COUNT)
    #: the circuit breaker: failed attempts in a row that open it (0: off)
    failure_threshold: int = _setting(5, COUNT)
    breaker_base_delay_s: float = _setting(2.0, NUMBER)
    breaker_max_delay_s: float = _setting(120.0, NUMBER)
    #: what reaching failure_threshold does (:data:`STRATEGIES`), for every kind of failed
    #: delivery whose own setting below is not given
    recovery: str | None = _setting(None, SettingRule(text=True, choices=STRATEGIES))
    #: the strategy by kind of failure (:data:`KIND_DEFAULTS`; None: ``recovery`` if given,
    #: else the kind's default)
    recovery_on_crash: str | None = _setting(None, SettingRule(text=True, choices=STRATEGIES))
    recovery_on_timeout: str | None = _setting(None, SettingRule(text=True, choices=STRATEGIES))
    recovery_on_error: str | None = _setting(None, SettingRule(text=True, choices=STRATEGIES))
    recovery_on_health: str = _setting(
        KIND_DEFAULTS["health"], SettingRule(text=True, choices=HEALTH_STRATEGIES)
    )
    #: an unhealthy worker's queue is not consumed until it is healthy again
    pause_when_unhealthy: bool = _setting(True, SettingRule(flag=True))
    #: seconds a paused worker with no probe to say it is well waits for a trial
    health_pause_s: float = _setting(30.0, NUMBER)
    #: successful deliveries after which the worker is finished (0: no limit)
    max_events: int = _setting(0, COUNT)
    #: deliveries of the worker running at once across the cluster (0: any)
    max_concurrency: int = _setting(0, COUNT)
    #: "key": events of one partitionkey one at a time, in publish order
    ordering: str = _setting("none", SettingRule(text=True, choices=ORDERINGS))
    #: how long an ordered key waits for a number that never came
    ordering_gap_s: float = _setting(300.0, NUMBER)
    #: how long stop waits for deliveries in flight before it kills the engine
    stop_grace_s: float = _setting(30.0, NUMBER)
    #: health thresholds: error rates over 5 minutes, and failures in a row (0: never)
    health_degraded_rate: float = _setting(0.05, NUMBER)
    health_unhealthy_rate: float = _setting(0.5, NUMBER)
    health_max_consecutive_failures: int = _setting(3, COUNT)
    #: deliveries the 5 minutes must hold before their error rate makes the worker
    #: unhealthy (fewer: degraded at most; failures in a row still count)
    health_min_deliveries: int = _setting(10, COUNT)
    #: the code's health probe: seconds between probes, failed probes that make it unhealthy
    probe_interval_s: float = _setting(30.0, NUMBER)
    max_probe_failures: int = _setting(3, COUNT)
    #: memory of the worker's code, MiB (None: no limit): checked after each delivery on
    #: the pool process (in-process code) or the helper/sandbox processes, replaced past it;
    #: a sandbox child's address space is capped at it too
    max_memory_mb: int | None = _setting(None, COUNT)
    #: events of the worker's queue delivered together in one task run, one engine call
    #: and one Redis round trip per step (None: WM_BATCH_SIZE; 0 or 1: one at a time). On a
    #: Redis broker only; each event keeps its own outcome, retries and dead letter
    batch_size: int | None = _setting(None, COUNT)
    #: "exclusive": every member of the worker's group runs every event, one member at a
    #: time; "shared": each event runs on one member, members in parallel. Every member of
    #: a group gives the same; it needs a group
    group_mode: str = _setting(GROUP_MODES[0], SettingRule(text=True, choices=GROUP_MODES))
    #: where the business key of its events is, an attribute name or a path into the data
    #: (``wm.idempotency``): the outcome is recorded under it, so one business operation
    #: sent again under a new event id runs once (None: the event's identity)
    idempotency_key: str | None = _setting(None, SettingRule(text=True, valid=key_source))
    #: where the session of its events is, an attribute name or a path into the data, as
    #: for idempotency_key: a session's events run on one engine instance while the binding
    #: lives (``wm.dataplane.features.affinity``; None: no affinity)
    session_key: str | None = _setting(None, SettingRule(text=True, valid=key_source))
    #: a session's binding ends after this long without an event of it
    session_idle_s: float = _setting(300.0, NUMBER)
    #: the only topics the outputs may go to (None: any topic that is not reserved)
    output_topics: tuple[str, ...] | None = _setting(None, None)
    #: the engine's own settings (its ``worker_settings`` rules), read by the engine
    engine: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def parse(
        cls, raw: Mapping[str, Any], engine_rules: Mapping[str, SettingRule] | None = None
    ) -> WorkerSettings:
        """Check what an operator gave: known keys, right types, non-negative numbers."""
        rules = {**CORE_RULES, **(engine_rules or {})}
        core: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        for key, value in raw.items():
            if key == OUTPUT_TOPICS:
                core[key] = _topic_list(value)
                continue
            rule = rules.get(key)
            if rule is None:
                known = ", ".join(sorted([*rules, OUTPUT_TOPICS]))
                raise InvalidArgument(f"unknown worker setting {key!r}; known: {known}")
            (core if key in CORE_RULES else engine)[key] = rule.check(key, value)
        return _combined(cls(**core, engine=MappingProxyType(engine)))

    @classmethod
    def of(cls, stored: Mapping[str, Any] | None) -> WorkerSettings:
        """The settings as stored (checked when they were written)."""
        core: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        for key, value in (stored or {}).items():
            if key == OUTPUT_TOPICS:
                core[key] = tuple(value)
            else:
                (core if key in CORE_RULES else engine)[key] = value
        return cls(**core, engine=MappingProxyType(engine))

    def timeout_s_on(self, env: Settings) -> float:
        timeout_s = self.timeout_s
        return float(timeout_s if timeout_s is not None else env.message_handling_timeout_seconds)

    def max_retries_on(self, env: Settings) -> int:
        return int(self.max_retries if self.max_retries is not None else env.max_retries)

    def retry_base_delay_ms_on(self, env: Settings) -> int:
        base = self.retry_base_delay_ms
        return int(base if base is not None else env.retry_base_delay_ms)

    def batch_size_on(self, env: Settings) -> int:
        """Events per task run (at least 1)."""
        size = self.batch_size if self.batch_size is not None else env.batch_size
        return max(1, int(size))

    def breaker_delay_s(self, trips: int) -> float:
        """The circuit breaker's pause after its ``trips``-th opening in a row: base,
        doubling, capped."""
        pause = self.breaker_base_delay_s * 2 ** max(0, trips - 1)
        return float(min(self.breaker_max_delay_s, pause))

    def strategy_for(self, kind: str) -> str:
        """The recovery strategy for a failure of ``kind`` (:data:`KIND_DEFAULTS`)."""
        if kind == "health":
            return self.recovery_on_health
        own = getattr(self, f"recovery_on_{kind}")
        if own is not None:
            return str(own)
        return self.recovery if self.recovery is not None else KIND_DEFAULTS[kind]

    @property
    def ordered(self) -> bool:
        """Events with the same ``partitionkey`` run one at a time, in publish order."""
        return self.ordering == "key"

    @property
    def shared(self) -> bool:
        """The worker's group shares its topic's events among its members (one run each)."""
        return self.group_mode == "shared"


def _combined(settings: WorkerSettings) -> WorkerSettings:
    """Refuse settings that are each valid but not together: a shared group's events come
    through one queue for all its members, numbered for none of them and picked one by one."""
    if settings.shared and settings.ordered:
        raise InvalidArgument(
            "worker settings 'group_mode' shared and 'ordering' key do not go together: a "
            "shared group's members take its events in any order"
        )
    if settings.shared and (settings.batch_size or 0) > 1:
        raise InvalidArgument(
            "worker settings 'group_mode' shared and 'batch_size' > 1 do not go together: a "
            "shared group's events are picked by a member one at a time"
        )
    if settings.session_key is not None and (settings.batch_size or 0) > 1:
        raise InvalidArgument(
            "worker settings 'session_key' and 'batch_size' > 1 do not go together: a "
            "session's events run one call at a time on the instance it is bound to"
        )
    degraded, unhealthy = settings.health_degraded_rate, settings.health_unhealthy_rate
    if degraded > unhealthy:
        raise InvalidArgument(
            f"worker setting 'health_degraded_rate' ({degraded:g}) is above "
            f"'health_unhealthy_rate' ({unhealthy:g}): a worker would be unhealthy before it "
            "is degraded; give the degraded rate the lower one"
        )
    return settings


def _topic_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise InvalidArgument(f"worker setting {OUTPUT_TOPICS!r} must be a list of topics")
    return tuple(check_name("output topic", topic) for topic in value)


#: The rules of the core's settings, by key (``output_topics`` is checked on its own).
CORE_RULES: Mapping[str, SettingRule] = MappingProxyType(
    {
        f.name: f.metadata["rule"]
        for f in dataclasses.fields(WorkerSettings)
        if f.metadata.get("rule") is not None
    }
)


def with_group_mode(settings: Mapping[str, Any] | None, group_mode: str | None) -> dict[str, Any]:
    """``settings`` with ``group_mode`` given on its own (``wm worker create --group-mode``,
    the API's ``group_mode``), which must agree with one among them."""
    merged = dict(settings or {})
    if group_mode is None:
        return merged
    given = merged.setdefault("group_mode", group_mode)
    if given != group_mode:
        raise InvalidArgument(
            f"group_mode {group_mode!r} and worker setting 'group_mode' {given!r} disagree: "
            "give one"
        )
    return merged


def validate_worker_settings(
    raw: Mapping[str, Any], engine_rules: Mapping[str, SettingRule] | None = None
) -> dict[str, Any]:
    """Check ``raw`` (:meth:`WorkerSettings.parse`); returns what to store: the keys given."""
    topics = WorkerSettings.parse(raw, engine_rules).output_topics
    return {
        key: list(topics or ()) if key == OUTPUT_TOPICS else value for key, value in raw.items()
    }
