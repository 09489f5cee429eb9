"""``wm up``: the embedded single-machine system, as a user starts and stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import eventually


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("WM_")}


def _run_up(cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "wm.cli", "up", *args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_demo_shows_events_flowing_and_cleans_up(tmp_path: Path, pool: str) -> None:
    proc = _run_up(tmp_path, "--demo", "--events", "3", "--pool", pool)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "(embedded, pid" in out
    assert f", 2 {'processes' if pool == 'prefork' else 'threads'}, log" in out
    for n in (1, 2, 3):
        assert f"HELLO NUMBER {n}!" in out and f"correlationid=demo-{n}" in out
    assert out.rstrip().endswith("stopped")
    assert (tmp_path / ".wm" / "workmanager.db").exists()
    _assert_nothing_left(out)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_everything(tmp_path: Path, stop: signal.Signals) -> None:
    proc = _run_up(tmp_path)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "ready" in line:
            break
    proc.send_signal(stop)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert "stopping" in out and out.rstrip().endswith("stopped")
    _assert_nothing_left(out)


def _assert_nothing_left(out: str) -> None:
    pids = [
        int(line.split("pid ")[1].split()[0].rstrip(","))
        for line in out.splitlines()
        if line.startswith(("wm up  redis", "wm up  node"))
    ]
    assert len(pids) == 2  # the Redis server and the Celery node

    def gone() -> bool:
        return not any(_alive(pid) for pid in pids)

    eventually(gone, timeout_s=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
