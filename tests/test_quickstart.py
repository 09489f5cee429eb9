"""The README's quick start, run literally in a copy of the work tree, as a new user would.

The quick start's own lines go to bash unchanged (``python3 -m venv .venv``, activation,
``pip install -e '.[embedded]' && wm up --demo``), with ``--events 5`` added so that ``wm up``
ends by itself. pip runs for real, only offline: ``PIP_NO_INDEX`` and ``PIP_FIND_LINKS`` point
it at the wheelhouse of tests/test_sandbox_layouts.py. A copy of the work tree, not the
checkout itself, so the new ``.venv`` and ``.wm`` land in a temporary directory.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers import eventually, running
from tests.test_sandbox_layouts import clean_env, copy_work_tree, wheelhouse, wheelhouse_root

#: Demo events ``wm up --demo`` sends before it stops by itself.
EVENTS = 5
#: Seconds the whole quick start may take (venv, offline install, node start, the events).
QUICK_START_TIMEOUT_S = 300
#: Seconds ``wm up`` has to stop everything after a SIGTERM.
STOP_TIMEOUT_S = 60


def quick_start_script() -> str:
    """The README's quick start block, with ``wm up --demo`` told to stop after EVENTS."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1]
    found = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert found, "the README's quick start has no bash block"
    script = found.group(1)
    assert "pip install -e '.[embedded]'" in script and "wm up --demo" in script, script
    return "set -e\n" + script.replace("wm up --demo", f"wm up --demo --events {EVENTS}")


def run_script(script: str, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run ``script`` in its own session; on timeout ``wm up`` is stopped as by an operator."""
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=QUICK_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"the quick start did not finish within {QUICK_START_TIMEOUT_S}s:\n{out}")
    return proc.returncode, out


def started_pids(out: str) -> list[int]:
    """The Redis server and Celery node ``wm up`` reported starting."""
    lines = [line for line in out.splitlines() if line.startswith(("wm up  redis", "wm up  node"))]
    return [int(re.findall(r"pid (\d+)", line)[0]) for line in lines]


@pytest.mark.slow
def test_readme_quick_start_in_a_fresh_virtualenv(
    tmp_path: Path, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    clone = copy_work_tree(tmp_path / "clone")
    python3 = shutil.which("python3")
    assert python3, "no python3 on PATH"
    links = wheelhouse(wheelhouse_root(request.config, tmp_path_factory), python3)
    env = clean_env(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links), PIP_CONFIG_FILE=os.devnull)

    code, out = run_script(quick_start_script(), clone, env)

    assert code == 0, out
    for n in range(1, EVENTS + 1):
        assert f"'text': 'HELLO NUMBER {n}!'}} correlationid=demo-{n}" in out, out
    assert out.rstrip().endswith("stopped"), out
    assert (clone / ".wm" / "workmanager.db").exists()
    pids = started_pids(out)
    assert len(pids) == 2, out
    eventually(lambda: not any(running(pid) for pid in pids), timeout_s=30)
