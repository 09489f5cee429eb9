"""``wm bench --commands-repeats``: the read-command phase builds its store and times every
read command of ``wm`` (small numbers: this checks the phase, not the speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import pytest

from tests.conftest import PG_ADMIN_URL, ROOT
from wm.bench import commands
from wm.cli import cli

#: Commands that change something, stream, serve, run the system or ask a node over HTTP:
#: not the phase's. Every other command of ``wm`` must be timed by it.
NOT_READS = {
    "wm worker create", "wm worker update-code", "wm worker start", "wm worker stop",
    "wm worker suspend", "wm worker resume", "wm worker delete", "wm worker rollback",
    "wm schedule add", "wm schedule remove", "wm publish", "wm tail", "wm subscribe",
    "wm unsubscribe", "wm dlq replay", "wm dlq purge", "wm db upgrade", "wm up", "wm recover",
    "wm health", "wm bench", "wm api", "wm tenant create", "wm tenant set", "wm tenant delete",
    "wm session unbind", "wm token create", "wm token revoke", "wm completion",
}  # fmt: skip


def _leaves(command: click.Command, path: str) -> list[str]:
    if not isinstance(command, click.Group):
        return [path]
    ctx = click.Context(command)
    found = []
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        assert sub is not None
        found += _leaves(sub, f"{path} {name}")
    return found


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_")}
    return subprocess.run(
        [sys.executable, "-m", "wm.cli", "bench", "--events", "0", "--engine-messages", "0",
         *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def _timed(built: commands.Store) -> set[str]:
    """The commands the phase times, as ``wm GROUP COMMAND`` without their arguments."""
    names = set()
    for argv in commands.read_commands(built):
        top = cli.get_command(click.Context(cli), argv[0])
        names.add(" ".join(["wm", *argv[: 2 if isinstance(top, click.Group) else 1]]))
    return names


def test_every_read_command_of_wm_is_timed() -> None:
    built = commands.Store(1, 1, 1, 1, 1, 1, 1, 1, "w", "l", "t", "s")
    timed = _timed(built)
    for leaf in _leaves(cli, "wm"):
        # a group's leaf has two words after wm; a top-level command one
        key = " ".join(leaf.split()[:3])
        assert key in NOT_READS or key in timed, f"{leaf} is neither timed nor a change"
    assert {"wm --help", "wm status", "wm worker list", "wm subscriptions"} <= timed


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_the_phase_times_every_command_against_its_target(database: str) -> None:
    args = ["--commands-repeats", "1", "--commands-workers", "3", "--json"]
    if database == "postgres":
        args += ["--commands-database-url", PG_ADMIN_URL]
    done = _bench(*args)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["phases"] == ["read commands"]
    phase = found["commands"]
    assert phase["load_average"] >= 0
    assert phase["database"] == ("PostgreSQL" if database == "postgres" else "SQLite")
    assert phase["store"].startswith("3 workers, 9 versions, ")
    assert "12 dead letters, 1 schedules, 20 plain subscriptions" in phase["store"]
    rows = phase["commands"]
    assert [r["command"].split()[:2] for r in rows][:3] == [
        ["wm", "--help"], ["wm", "--version"], ["wm", "status"],
    ]  # fmt: skip
    assert len(rows) == len(commands.read_commands(commands.Store(*[0] * 8, "w", "l", "t", "s")))
    for row in rows:
        assert 0 < row["median_s"] <= row["max_s"] and row["cpu_s"] > 0, row
        assert 0 < row["api_median_s"] <= row["api_max_s"], row
        assert row["target_s"] == (0.1 if row["command"] == "wm --help" else 0.5)
    # the table is for people: on standard error, every command on a line of its own
    for row in rows:
        assert row["command"] in done.stderr


def test_a_database_url_that_is_not_postgresql_is_refused() -> None:
    done = _bench("--commands-repeats", "1", "--commands-database-url", "mysql://x/y")
    assert done.returncode == 2
    assert "--commands-database-url 'mysql://x/y' is no postgresql:// URL" in done.stderr
