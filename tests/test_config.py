"""Settings: typed, frozen, and strict about the environment."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from wm import ConfigurationError, Settings
from wm.config import settings_table


def test_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.group_lock_retry_base_delay_ms == 500
    assert settings.group_lock_max_retries == 3000
    assert settings.worker_recovery_lease_ttl_seconds == 300
    assert "json" in settings.python_allowed_packages


def test_values_are_parsed() -> None:
    settings = Settings.from_env(
        {
            "GROUP_LOCK_MAX_RETRIES": "7",
            "WORKER_RECOVERY_ON_START": "false",
            "PYTHON_ALLOWED_PACKAGES": "json, numpy ,",
        }
    )
    assert settings.group_lock_max_retries == 7
    assert settings.worker_recovery_on_start is False
    assert settings.python_allowed_packages == ("json", "numpy")


@pytest.mark.parametrize(
    ("name", "value", "expects"),
    [
        ("GROUP_LOCK_MAX_RETRIES", "abc", "a non-negative integer"),
        ("GROUP_LOCK_MAX_RETRIES", "-1", "a non-negative integer"),
        ("WORKER_RECOVERY_ON_START", "maybe", "true or false"),
        ("MESSAGE_HANDLING_TIMEOUT_SECONDS", "soon", "a non-negative number"),
        ("WM_ENGINE_SPIN_US", "20000", "0 to 10000 microseconds"),
        ("WM_ENGINE_SPIN_US", "soon", "0 to 10000 microseconds"),
    ],
)
def test_malformed_values_name_the_variable(name: str, value: str, expects: str) -> None:
    with pytest.raises(ConfigurationError, match=f"{name}=.*expected {expects}"):
        Settings.from_env({name: value})


def test_unknown_wm_variable_is_refused_with_a_hint() -> None:
    with pytest.raises(ConfigurationError, match=r"WM_BROKER_UR\..*Did you mean WM_BROKER_URL"):
        Settings.from_env({"WM_BROKER_UR": "redis://x"})


def test_settings_are_frozen() -> None:
    settings = Settings.from_env({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_retries = 1  # type: ignore[misc]
    assert settings.replace(max_retries=1).max_retries == 1
    with pytest.raises(ConfigurationError):
        settings.replace(nope=1)


def test_every_setting_is_documented() -> None:
    rows = settings_table()
    assert len(rows) == len(dataclasses.fields(Settings))
    assert all(doc for _, _, doc in rows)


def test_start_up_stops_on_a_malformed_value() -> None:
    """A Celery node refuses to start with a malformed setting, naming it."""
    env = {"GROUP_LOCK_MAX_RETRIES": "abc", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", "import celeryconfig"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "GROUP_LOCK_MAX_RETRIES='abc' is malformed" in result.stderr


def test_urls_can_come_from_files(tmp_path: Path) -> None:
    secret = tmp_path / "db-url"
    secret.write_text("postgresql+psycopg://wm:s3cret@db/wm\n")
    settings = Settings.from_env({"WM_DATABASE_URL_FILE": str(secret)})
    assert settings.database_url == "postgresql+psycopg://wm:s3cret@db/wm"
    with pytest.raises(ConfigurationError, match="set WM_BROKER_URL or WM_BROKER_URL_FILE"):
        Settings.from_env({"WM_BROKER_URL": "redis://x", "WM_BROKER_URL_FILE": str(secret)})
    with pytest.raises(ConfigurationError, match="WM_REDIS_URL_FILE='/nowhere' cannot be read"):
        Settings.from_env({"WM_REDIS_URL_FILE": "/nowhere"})
    with pytest.raises(ConfigurationError, match="unknown setting WM_MAX_RETRIES_FILE"):
        Settings.from_env({"WM_MAX_RETRIES_FILE": str(secret)})


def test_a_url_is_given_itself_or_by_its_file() -> None:
    from wm.config import given

    assert given("WM_BROKER_URL", {"WM_BROKER_URL_FILE": "/run/secrets/broker"})
    assert given("WM_BROKER_URL", {"WM_BROKER_URL": "redis://x"})
    assert not given("WM_BROKER_URL", {"WM_REDIS_URL": "redis://x"})
    assert not given("WM_MAX_RETRIES", {"WM_MAX_RETRIES_FILE": "/x"})
