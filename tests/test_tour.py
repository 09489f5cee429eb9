"""The README's 5-minute tour, run as written, as a new user would (issue 29: "everything in
its tour works as written").

``wm up --demo`` runs in a directory of its own, holding what the tour uses from a clone
(``examples/``, and ``.venv`` as the interpreter this suite runs on); the tour's bash blocks
then go to one bash, unchanged, in that directory: ``set -a; . .wm/env; set +a`` points
``wm`` at the system ``wm up`` started. What each step prints is checked for what the tour
says it shows.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, doc, eventually
from tests.test_sandbox_layouts import clean_env

#: Seconds ``wm up`` may take to be up (embedded Redis, migrations, a node, the demo worker).
UP_TIMEOUT_S = 120
#: Seconds the tour may take: a guard against hangs (it takes about 30 s, 5 of them a sleep).
TOUR_TIMEOUT_S = 240
#: Seconds ``wm up`` has to stop everything after a SIGTERM.
STOP_TIMEOUT_S = 60


def tour_script() -> str:
    """The bash blocks of the README's tour, in order, as one script that stops at a failure."""
    tour = doc("README.md").split("## A 5-minute tour\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", tour, re.DOTALL)
    assert len(blocks) >= 3, tour
    return "set -e\n" + "".join(blocks)


def a_clone(into: Path) -> Path:
    """What the tour needs of a clone: its examples, and a ``.venv`` to activate."""
    shutil.copytree(ROOT / "examples", into / "examples")
    prefix = Path(sys.prefix)
    if (prefix / "bin" / "activate").exists():
        (into / ".venv").symlink_to(prefix)
    else:  # the system interpreter: nothing to activate
        (into / ".venv" / "bin").mkdir(parents=True)
        (into / ".venv" / "bin" / "activate").write_text("")
    return into


@pytest.mark.slow
def test_the_readme_tour_works_as_written(tmp_path: Path) -> None:
    clone = a_clone(tmp_path / "clone")
    env = clean_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "wm.cli", "up", "--demo"],
        cwd=clone,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        eventually(lambda: "wm up  demo" in (tmp_path / "up.log").read_text(), UP_TIMEOUT_S)
        done = subprocess.run(
            ["bash", "-c", tour_script()],
            cwd=clone,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TOUR_TIMEOUT_S,
            check=False,
        )
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(STOP_TIMEOUT_S)
        log.close()
    out = done.stdout + done.stderr
    assert done.returncode == 0, out + "\nwm up printed:\n" + (tmp_path / "up.log").read_text()
    for shown in (
        "nodes:        1 alive",  # wm status
        "demo-shout",  # wm worker list
        "reached 1 subscription(s)",  # the publish reached the shout worker
        '{"text":"HELLO"}',  # wm consume: the worker's answer
        "(shout): running, version 2",  # update-code
        "(shout): running, version 1",  # rollback
        "ValueError: no thanks",  # wm dlq list
        "dead letters:  1 not replayed",  # wm worker show boom
        "purged 1 dead letter(s)",
        "(boom): deleted",
    ):
        assert shown in out, f"{shown!r} not printed:\n{out}"
