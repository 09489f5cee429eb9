"""The README's test command on a machine that lacks something: ``scripts/test`` checks first
(``scripts/preflight.py``) and says in one line what is missing and how to get it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis

from tests.helpers import eventually, free_port

ROOT = Path(__file__).resolve().parent.parent


def _run(*command: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(command),
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_service_that_does_not_answer_is_one_line_with_its_remedy(tmp_path: Path) -> None:
    port = free_port()
    venv = tmp_path / "venv"
    ran = _run(
        "bash",
        "scripts/test",
        TEST_AMQP_URL=f"amqp://g:g@127.0.0.1:{port}//",
        **{"WM_CI_VENV": str(venv)},
    )
    assert ran.returncode == 1, ran.stdout + ran.stderr
    [line] = [x for x in ran.stderr.splitlines() if "RabbitMQ" in x]
    assert line == (
        f"preflight: RabbitMQ does not answer on 127.0.0.1:{port} (TEST_AMQP_URL): start it "
        "with `sudo rabbitmq-server -detached` (sudo bash .ci/run installs and starts "
        "everything), or point TEST_AMQP_URL at one"
    )
    assert not venv.exists()  # nothing installed, nothing run, after a failed check


def test_a_redis_that_is_installed_but_not_running_is_started() -> None:
    port = free_port()
    ran = _run(sys.executable, "scripts/preflight.py", TEST_REDIS_HOST=f"redis://127.0.0.1:{port}")
    client = redis.Redis(port=port)
    try:
        assert f"started a Redis on 127.0.0.1:{port}" in ran.stdout, ran.stdout + ran.stderr
        assert client.ping()
        assert not [x for x in ran.stderr.splitlines() if "Redis does not answer" in x]
    finally:
        client.shutdown(nosave=True)
    eventually(lambda: _gone(port), timeout_s=10)


def _gone(port: int) -> bool:
    try:
        redis.Redis(port=port, socket_connect_timeout=0.2).ping()
    except redis.ConnectionError:
        return True
    return False


def test_the_package_list_is_what_ci_installs() -> None:
    """``.ci/run`` installs what ``--packages`` names: on this machine, after it ran, none."""
    ran = _run(sys.executable, "scripts/preflight.py", "--packages")
    assert ran.returncode == 0
    if os.environ.get("CI"):
        assert ran.stdout.strip() == ""
    assert "python3 scripts/preflight.py --packages" in (ROOT / ".ci" / "run").read_text()
