"""The environment of a ``wm`` command under test: a fresh SQLite store (or PostgreSQL
schema), the test Redis's CLI databases, and no WorkManager setting of the calling process.

A pytest plugin (``tests/conftest.py`` loads it), so every test of the command line gets the
fixtures ``env`` (migrated), ``unmigrated_env`` and ``database_url`` by name; ``wm`` runs
the command as a separate process, without a terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.conftest import CLI_BROKER_DB, CLI_STATE_DB, REDIS_HOST, flush_redis, fresh_schema
from wm import Settings, store
from wm.config import settings_table

ROOT = Path(__file__).resolve().parent.parent
#: Redis databases of these tests (broker, state); other suites use other numbers.
BROKER_DB, STATE_DB = CLI_BROKER_DB, CLI_STATE_DB


@pytest.fixture
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """SQLite unless a test asks for ``postgres`` through indirect parametrization."""
    if getattr(request, "param", "sqlite") == "postgres":
        yield fresh_schema(request.getfixturevalue("pg_url"))
        store.dispose_engines()
    else:
        yield f"sqlite:///{tmp_path / 'wm.db'}"


def _base_env(database_url: str) -> dict[str, str]:
    """This process's environment without any WorkManager setting, then the test's own."""
    ours = {variable for variable, _, _ in settings_table()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_") and k not in ours}
    env.update(
        WM_DATABASE_URL=database_url,
        WM_BROKER_URL=f"{REDIS_HOST}/{BROKER_DB}",
        WM_REDIS_URL=f"{REDIS_HOST}/{STATE_DB}",
        WM_LOG_LEVEL="WARNING",
    )
    return env


@pytest.fixture
def unmigrated_env(database_url: str, redis_ok: None) -> Iterator[dict[str, str]]:
    flush_redis(BROKER_DB, STATE_DB)
    yield _base_env(database_url)
    flush_redis(BROKER_DB, STATE_DB)


@pytest.fixture
def env(unmigrated_env: dict[str, str]) -> dict[str, str]:
    """Migrated in this process: a ``wm db upgrade`` process per test costs a second each, and
    ``test_db_upgrade_reaches_head`` runs that command itself."""
    store.upgrade(Settings.from_env(unmigrated_env))
    store.dispose_engines()
    return unmigrated_env


#: Longest one command or wait may take, in seconds: a guard against hangs, not a timing test.
GUARD_S = 60.0


class Result(NamedTuple):
    code: int
    raw: bytes
    err: str

    @property
    def out(self) -> str:
        return self.raw.decode()


def wm(env: dict[str, str], *args: str, stdin: bytes | None = None, expect: int = 0) -> Result:
    """Run ``wm`` as a separate process and check its exit code."""
    done = subprocess.run(
        [sys.executable, "-m", "wm.cli", *args],
        env=env,
        input=stdin,
        capture_output=True,
        timeout=GUARD_S,
        cwd=ROOT,
        check=False,
    )
    result = Result(done.returncode, done.stdout, done.stderr.decode())
    assert result.code == expect, f"wm {' '.join(args)} exited {result.code}:\n{result.err}"
    return result


def wm_json(env: dict[str, str], *args: str, stdin: bytes | None = None) -> Any:
    return json.loads(wm(env, "--json", *args, stdin=stdin).out)


def one_error_line(result: Result) -> str:
    """The single ``wm: error:`` line a failed command prints (no traceback, nothing else)."""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("wm: error: "), result.err
    return lines[0]
