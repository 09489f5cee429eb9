"""``wm bench`` as a person and a script run it: plain-text help, a progress bar at a terminal
and a summary line, one JSON object with ``--json`` (small numbers: this checks the command,
not the speed). The bench starts its own embedded Redis: no WM_* variable is passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT
from tests.helpers import plain, run_in_terminal
from wm.bench.rig import percentile

#: Messages of each engine round trip: enough to have a p99, few enough to be quick.
MESSAGES = "20"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_")}
    env.pop("COLUMNS", None)
    return env


def _bench(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wm.cli", "bench", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_help_is_plain_text_with_defaults() -> None:
    done = _bench("--help", timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert "``" not in done.stdout and ":func:" not in done.stdout
    assert "usage: wm bench" in done.stdout
    assert "--events N" in done.stdout and "(default: 2000)" in done.stdout
    assert "--json" in done.stdout and "--pool-repeats R" in done.stdout


def test_percentiles_are_the_standard_library_s() -> None:
    samples = [float(n) for n in range(1, 101)]
    assert percentile(samples, 50) == 50.5
    assert percentile(samples, 99) == 99.01
    assert percentile([], 99) == 0.0 and percentile([7.0], 99) == 7.0


def test_json_is_one_object_of_every_phase_run() -> None:
    done = _bench("--events", "20", "--engine-messages", MESSAGES, "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["phases"] == ["task events", "engine round trips"]
    phase = found["task_events"]
    assert (phase["events"], phase["concurrency"]) == (20, 2)
    assert [row["scenario"] for row in phase["scenarios"]] == [
        "bare celery",
        "no group",
        "group",
        "python worker",
    ]
    for row in phase["scenarios"]:
        assert row["events_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
    assert phase["scenarios"][1]["target"] == 0.7
    assert isinstance(phase["scenarios"][1]["met"], bool)
    trips = found["engine_round_trips"]
    assert [(t["engine"], t["worker"]) for t in trips] == [
        ("text/x-python", "returns None"),
        ("text/x-python", "returns one event"),
    ]
    assert all(0 < t["median_us"] <= t["p99_us"] for t in trips)
    # the tables are for people: on standard error, with the node's description
    assert "scenario" in done.stderr and "events/s" in done.stderr
    assert "configured like wm.deliver" in done.stderr


def test_a_terminal_shows_a_progress_bar_and_a_summary() -> None:
    shown = run_in_terminal(
        [sys.executable, "-m", "wm.cli", "bench", "--events", "0", "--engine-messages", MESSAGES],
        _env(),
        columns=100,
        timeout_s=120,
    )
    screen = plain(shown.screen)
    assert shown.code == 0, screen
    assert "text/x-python round trip: returns one event" in screen  # the step under way
    assert "2/2" in screen
    assert "returns None       median" in screen
    assert screen.rstrip().splitlines()[-1].startswith("wm bench: engine round trips in ")


def test_a_pipe_gets_the_tables_and_a_summary_without_a_bar() -> None:
    done = _bench("--events", "0", "--engine-messages", MESSAGES, timeout_s=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.rstrip().splitlines()
    assert lines[-1].startswith("wm bench: engine round trips in "), done.stdout
    assert "returns one event  median" in done.stdout
    assert "━" not in done.stdout + done.stderr and "\x1b[" not in done.stdout + done.stderr
