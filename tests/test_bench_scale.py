"""``wm bench``'s scale phase, small, on Redis: real nodes serve every worker, each figure of the
report is printed and parses, and nothing of the phase is left (no timing is asserted: the
figures are docs/benchmarks.md's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, env_of, make_settings
from wm.state.connection import pooled_client

WORKERS, TOPICS, NODES = 30, 5, 2
FIGURE = r"(\d+(?:\.\d+)?)"


def _bench(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wm.cli", "bench", "--events", "0", "--engine-messages", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(660)  # above the bench's own hang guard
def test_the_scale_phase_serves_every_worker_and_reports_every_figure(
    own_redis: tuple[int, object], tmp_path: Path
) -> None:
    server = f"redis://127.0.0.1:{own_redis[0]}"
    settings = make_settings(
        f"sqlite:///{tmp_path / 'unused.db'}", broker_url=f"{server}/0", redis_url=f"{server}/1"
    )
    out = _bench(
        *("--scale-workers", str(WORKERS), "--scale-topics", str(TOPICS)),
        *("--scale-nodes", str(NODES), "--scale-deliveries", "10", "--scale-repeats", "2"),
        env=env_of(settings),
        timeout=600,  # a hang guard: seven launches of two nodes on a loaded 2-core machine
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"{WORKERS} stub workers over {TOPICS} topics against one, {NODES} nodes" in text
    assert "placement off (WM_PLACEMENT_SPILL=0): every node serving every worker" in text
    # every worker served, twice: after a publish to running nodes and after the nodes' start
    for what in ("after the nodes' launch", "after the publish"):
        assert re.search(rf"every worker served {what}: {FIGURE} s  target < 10 s", text), text
    for side in ("one worker", f"{WORKERS} workers"):
        match = re.search(
            rf"^  {side} +{FIGURE} \({FIGURE} {FIGURE}\) +{FIGURE} +{FIGURE} ms$", text, re.M
        )
        assert match, text
        rate, commands = float(match[1]), float(match[4])
        assert rate > 0 and commands > 0
    assert re.search(rf"many/one: {FIGURE}× \(per repetition {FIGURE}× {FIGURE}×\)", text), text
    assert "too short to time" not in text
    memory = re.search(
        rf"{FIGURE} MiB with no worker, {FIGURE} MiB with {WORKERS} idle workers "
        rf"\(([+-]{FIGURE}) %, ([+-]{FIGURE}) KiB per worker\)  target flat",
        text,
    )
    assert memory and float(memory[1]) > 10 and float(memory[2]) > 10, text
    # the phase deleted its workers: no pending delivery, no queue, no ready list
    state, broker = pooled_client(f"{server}/1"), pooled_client(f"{server}/0")
    assert not list(state.scan_iter("wm:pending:{*")), text
    assert not list(broker.scan_iter("wmbench-*")), text  # worker queues, the ready list


def test_the_scale_phase_refuses_more_topics_than_workers() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_")}
    out = _bench("--scale-workers", "2", "--scale-topics", "3", env=env, timeout=60)
    assert out.returncode == 2 and "--scale-topics must be between 1" in out.stderr
