"""Per-worker settings are one typed value (``wm.workersettings``), each field owned by one
delivery feature or by the control plane, and read by no string key anywhere else."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from wm.config import Settings
from wm.dataplane.features import FEATURES
from wm.errors import InvalidArgument
from wm.workersettings import CORE_RULES, OUTPUT_TOPICS, SettingRule, WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [f.name for f in dataclasses.fields(WorkerSettings)]


def test_the_defaults_are_the_documented_ones() -> None:
    settings = WorkerSettings()
    assert (settings.failure_threshold, settings.recovery, settings.max_events) == (5, None, 0)
    # seed 004's decision tree, by kind of failure; the pause while unhealthy is on
    kinds = ("crash", "timeout", "error", "health")
    assert [settings.strategy_for(k) for k in kinds] == ["replace", "retry", "retry", "remove"]
    assert settings.pause_when_unhealthy is True
    assert (settings.breaker_base_delay_s, settings.breaker_max_delay_s) == (2.0, 120.0)
    assert (settings.stop_grace_s, settings.ordering_gap_s, settings.probe_interval_s) == (
        30.0,
        300.0,
        30.0,
    )
    env = Settings.from_env({})
    assert settings.timeout_s_on(env) == env.message_handling_timeout_seconds
    assert settings.max_retries_on(env) == env.max_retries
    assert WorkerSettings(max_retries=0).max_retries_on(env) == 0


@pytest.mark.parametrize(
    ("given", "crash", "timeout", "error"),
    [
        ({}, "replace", "retry", "retry"),
        ({"recovery": "stop"}, "stop", "stop", "stop"),  # as before: one strategy for all
        ({"recovery": "stop", "recovery_on_crash": "remove"}, "remove", "stop", "stop"),
        ({"recovery_on_timeout": "degrade"}, "replace", "degrade", "retry"),
    ],
)
def test_recovery_sets_every_delivery_kind_not_given_its_own(
    given: dict[str, str], crash: str, timeout: str, error: str
) -> None:
    typed = WorkerSettings.parse(given)
    assert [typed.strategy_for(k) for k in ("crash", "timeout", "error")] == [crash, timeout, error]
    assert typed.strategy_for("health") == "remove"  # the health kind has its own only


def test_what_was_stored_reads_back_typed() -> None:
    stored = {"max_retries": 2, "output_topics": ["a", "b"], "isolation": "subprocess"}
    typed = WorkerSettings.of(stored)
    assert (typed.max_retries, typed.output_topics) == (2, ("a", "b"))
    assert dict(typed.engine) == {"isolation": "subprocess"}


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"max_retrys": 3}, "unknown worker setting 'max_retrys'"),
        ({"max_retries": "3"}, "'max_retries' must be a non-negative number"),
        ({"max_retries": True}, "'max_retries' must be a non-negative number"),
        ({"timeout_s": -1}, "'timeout_s' must be a non-negative number"),
        ({"recovery": "reboot"}, "'recovery' must be one of retry, degrade, stop, replace, remove"),
        (
            {"recovery_on_crash": "restart"},
            "'recovery_on_crash' must be one of retry, degrade, stop, replace, remove",
        ),
        ({"recovery_on_timeout": ""}, "'recovery_on_timeout' must be a non-empty string"),
        ({"recovery_on_error": 3}, "'recovery_on_error' must be a non-empty string"),
        # a probe is its own retry
        (
            {"recovery_on_health": "retry"},
            "'recovery_on_health' must be one of remove, degrade, stop, replace",
        ),
        ({"pause_when_unhealthy": "no"}, "'pause_when_unhealthy' must be true or false"),
        ({"pause_when_unhealthy": 0}, "'pause_when_unhealthy' must be true or false"),
        ({OUTPUT_TOPICS: "a"}, "'output_topics' must be a list of topics"),
        ({"isolation": "subprocess"}, "unknown worker setting 'isolation'"),
        (
            {"health_degraded_rate": 0.6},  # above the unhealthy rate's default, 0.5
            "'health_degraded_rate' (0.6) is above 'health_unhealthy_rate' (0.5)",
        ),
        (
            {"health_degraded_rate": 0.1, "health_unhealthy_rate": 0.05},
            "'health_degraded_rate' (0.1) is above 'health_unhealthy_rate' (0.05)",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_key(raw: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(named)):
        WorkerSettings.parse(raw)


def test_an_engine_adds_its_own_settings() -> None:
    rules = {"isolation": SettingRule(text=True, choices=("in-process", "subprocess"))}
    parsed = WorkerSettings.parse({"isolation": "subprocess", "max_events": 3}, rules)
    assert (dict(parsed.engine), parsed.max_events) == ({"isolation": "subprocess"}, 3)


def test_each_feature_owns_fields_that_exist_and_no_field_has_two_owners() -> None:
    owned = [name for feature in FEATURES for name in feature.owns]
    assert sorted(set(owned) - set(FIELDS)) == []
    assert len(owned) == len(set(owned))
    # the rest belong to the control plane or the core: the engine's own, the allow-list,
    # the batch size (the task's boundary, wm.dataplane.batchtask), the business key (the core)
    assert set(FIELDS) - set(owned) == {"engine", "output_topics", "batch_size", "idempotency_key"}
    assert set(CORE_RULES) == set(FIELDS) - {"engine", "output_topics"}


def test_no_module_reads_a_worker_setting_by_its_key() -> None:
    """``settings.get("max_retries")`` and the like: only wm/workersettings.py knows keys."""
    keys = "|".join(name for name in FIELDS if name != "engine")
    read = re.compile(rf"""settings\w*\)?\s*(?:\.get\(|\[)\s*["']({keys})["']""")
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in sorted([*ROOT.glob("wm/**/*.py"), *ROOT.glob("engines/**/*.py")])
        if path.name != "workersettings.py"
        for match in read.finditer(path.read_text())
    ]
    assert found == []
