"""The bench's drain phase on a real node: every scenario's queue filled, drained and
counted (small numbers: this checks the tool, not the speed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wm import Settings
from wm.local import drain


@pytest.mark.slow
def test_the_drain_phase_times_every_scenario_and_counts_redis_commands(
    pg_settings: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    drain.run(pg_settings, tmp_path, events=30, repeats=2, concurrency=2)
    out = capsys.readouterr().out
    assert "30 queued events per scenario, 2 repetitions interleaved" in out
    assert "task events off" in out
    rows = {
        match["name"].strip(): (float(match["rate"]), float(match["commands"]))
        for match in re.finditer(
            r"^(?P<name>[a-z ]+?)\s+(?P<rate>\d+) \(\d+ \d+\)\s+[\d.]+× \[[\d.–]+\]\s+"
            r"(?P<commands>[\d.]+)",
            out,
            flags=re.MULTILINE,
        )
    }
    assert set(rows) == {"bare celery", "no group", "group", "one output"}, out
    assert all(rate > 0 for rate, _ in rows.values())
    # WorkManager adds its own Redis work to what Celery does for a bare task
    bare_commands = rows["bare celery"][1]
    assert all(rows[name][1] > bare_commands for name in ("no group", "group", "one output"))
