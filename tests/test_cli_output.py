"""The ``wm`` command's own behaviour, whatever the command: version, help, start-up imports,
tables in a terminal and in a pipe, JSON times."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path

import click
import pytest
import yaml

from tests.cli_env import wm, wm_json
from tests.helpers import plain, run_in_terminal, stub
from tests.test_cli import create
from wm.cli import COMMANDS, cli

WM = [sys.executable, "-m", "wm.cli"]


def _imported(env: dict[str, str], *args: str) -> set[str]:
    """The modules ``wm ARGS`` imported (``-X importtime`` reports each on standard error)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "wm.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def test_version(env: dict[str, str]) -> None:
    assert wm(env, "--version").out.strip() == "wm 0.1.0"


def test_help_lists_every_command_and_shows_defaults(env: dict[str, str]) -> None:
    shown = wm(env, "--help").out
    for command in ("worker", "dlq", "status", "publish", "tail", "completion"):
        assert f"\n  {command} " in shown
    assert "[default: 1000" in " ".join(wm(env, "dlq", "replay", "--help").out.split())


def test_help_imports_no_heavy_library(env: dict[str, str]) -> None:
    imported = _imported(env, "--help")
    assert "click" in imported
    assert not {"sqlalchemy", "celery", "kombu", "redis", "rich", "wm.manager"} & imported


def test_worker_list_loads_no_data_plane(env: dict[str, str]) -> None:
    # Reading the store needs neither Celery nor the data plane: they load on first use.
    imported = _imported(env, "worker", "list")
    assert "sqlalchemy" in imported
    assert (
        not {
            "celery",
            "kombu.messaging",
            "wm.dataplane.bus",
            "wm.dataplane.pending",
            "wm.dataplane.features",
        }
        & imported
    )


@pytest.mark.parametrize("command", [["dlq", "list"], ["dlq", "show", "no-such-letter"]])
def test_reading_dead_letters_loads_no_celery(env: dict[str, str], command: list[str]) -> None:
    # Listing and reading letters needs the store alone; the bus (Celery, kombu's transport)
    # loads on a replay's first send.
    imported = _imported(env, *command)
    assert "sqlalchemy" in imported
    assert not {"celery", "kombu.messaging", "wm.dataplane.bus"} & imported


@pytest.mark.slow
def test_table_fits_a_narrow_terminal_and_colours_only_there(
    env: dict[str, str], tmp_path: Path
) -> None:
    for index in range(3):
        create(env, tmp_path, "--name", f"a-rather-long-worker-name-number-{index}")
    shown = run_in_terminal([*WM, "worker", "list"], env, columns=60)
    assert shown.code == 0, shown.screen
    assert "\x1b[" in shown.screen  # the bold header
    lines = plain(shown.screen).splitlines()
    assert lines and max(len(line) for line in lines) <= 60, "\n".join(lines)
    assert "ID" in lines[0]
    piped = wm(env, "worker", "list").out
    assert "\x1b" not in piped
    # Piped, each worker is one line, whole: ready for grep and awk.
    assert all(f"a-rather-long-worker-name-number-{i}" in piped for i in range(3))
    assert len(piped.splitlines()) == 4


@pytest.mark.slow
def test_json_times_are_rfc3339_with_a_zone(env: dict[str, str], tmp_path: Path) -> None:
    made = create(env, tmp_path, "--name", "zoned")
    for key in ("created_at", "updated_at", "status_since"):
        assert datetime.fromisoformat(made[key]).utcoffset() is not None, made[key]
    for transition in wm_json(env, "worker", "transitions", "zoned"):
        assert datetime.fromisoformat(transition["at"]).utcoffset() is not None


def test_cells_are_data_not_markup(env: dict[str, str], tmp_path: Path) -> None:
    # A cell's square brackets are the operator's text, never a rich style tag.
    shown = wm(env, "config").out
    assert "`[worker=… event=… correlation=… attempt=…]`" in shown
    made = create(env, tmp_path, "--name", "brackets")
    code = tmp_path / "v2.json"
    code.write_bytes(stub(output_type="v2"))
    wm(env, "worker", "update-code", "brackets", "--file", str(code), "--note", "[/x] [true]")
    assert "[/x] [true]" in wm(env, "worker", "history", made["id"]).out


def test_the_listed_help_is_each_command_s_own() -> None:
    # ``wm --help`` lists COMMANDS without importing the commands: it must not drift.
    context = click.Context(cli)
    for name, (_, listed) in COMMANDS.items():
        command = cli.get_command(context, name)
        assert command is not None and command.get_short_help_str(limit=1000) == listed, name


@pytest.mark.parametrize(
    "listing",
    [
        ["worker", "list"],
        ["subscriptions"],
        ["dlq", "list"],
        ["schedule", "list"],
        ["tenant", "list"],
    ],
)
def test_every_listing_prints_yaml_and_json_alike(
    env: dict[str, str], tmp_path: Path, listing: list[str]
) -> None:
    """``-o yaml`` holds what ``--json`` holds; ``-o json`` is ``--json``, before or after
    the command's name; ``-o table`` is what people get by default."""
    create(env, tmp_path, "--name", "formats")
    as_json = wm_json(env, *listing)
    assert yaml.safe_load(wm(env, *listing, "-o", "yaml").out) == as_json
    assert wm_json(env, "-o", "json", *listing) == as_json
    assert wm(env, *listing, "-o", "table").out == wm(env, *listing).out
    error = wm(env, *listing, "-o", "xml", expect=2).err
    assert "'xml' is not one of 'table', 'json', 'yaml'" in error
