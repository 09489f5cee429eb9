"""``wm up``: the embedded single-machine system, as a user starts and stops it."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import eventually, free_port, running


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("WM_")}


def _run_up(
    cwd: Path, *args: str, env: dict[str, str] | None = None, stderr: int = subprocess.STDOUT
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "wm.cli", "up", *args],
        cwd=cwd,
        env=env or _env(),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


@pytest.mark.parametrize("stale", ["WM_BROKER_URL", "WM_REDIS_URL", "WM_DATABASE_URL"])
def test_a_stale_url_from_the_environment_is_one_error_line(tmp_path: Path, stale: str) -> None:
    """What `set -a; . .wm/env; set +a` leaves after that `wm up` stopped: URLs of a Redis
    that is gone. `wm up` says which variable, masks the password, and keeps `.wm/env`."""
    home = tmp_path / ".wm"
    home.mkdir()
    written = "WM_BROKER_URL=redis://127.0.0.1:1/0\n"
    (home / "env").write_text(written)
    server = f"redis://:s3cret@127.0.0.1:{free_port()}"
    env = _env()
    env.update(WM_BROKER_URL=f"{server}/0", WM_REDIS_URL=f"{server}/1")
    if stale == "WM_DATABASE_URL":  # a directory that cannot be made: a file is in the way
        (tmp_path / "file").write_text("")
        env.update(WM_DATABASE_URL=f"sqlite:///{tmp_path / 'file' / 'wm.db'}")
        del env["WM_BROKER_URL"], env["WM_REDIS_URL"]
    elif stale == "WM_REDIS_URL":
        del env["WM_BROKER_URL"]
    proc = _run_up(tmp_path, env=env, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"wm: error: {stale}="), err
    assert "is unreachable (" in lines[0] and "unset it to let wm up start its own" in lines[0]
    assert "s3cret" not in err
    if stale != "WM_DATABASE_URL":
        assert f"{stale}=redis://:**@127.0.0.1:" in lines[0], err
    assert (home / "env").read_text() == written
    assert sorted(p.name for p in home.iterdir()) == ["env"]  # no Redis, node or database


def test_no_env_file_is_written_for_a_system_that_never_came_up(tmp_path: Path) -> None:
    env = _env()
    env.update(WM_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0")
    proc = _run_up(tmp_path, "--json", env=env, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == "", out + err
    assert err.startswith("wm: error: WM_BROKER_URL=") and err.count("\n") == 1, err
    assert not (tmp_path / ".wm" / "env").exists()


@pytest.mark.slow
def test_json_prints_the_environment_once_up_and_people_s_lines_on_stderr(
    tmp_path: Path,
) -> None:
    # The database's URL from a file, as a secret is handed over: the node gets the URL.
    database = f"sqlite:///{tmp_path / 'from-file.db'}"
    (tmp_path / "db-url").write_text(database + "\n")
    env = {**_env(), "WM_DATABASE_URL_FILE": str(tmp_path / "db-url")}
    proc = _run_up(tmp_path, "--json", env=env, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        first = proc.stdout.readline()  # the process waits in the foreground meanwhile
        answer = json.loads(first)
        env_file = tmp_path / ".wm" / "env"
        assert answer["env_file"] == str(env_file)
        assert env_file.stat().st_mode & 0o777 == 0o600  # URLs may hold passwords
        written = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
        assert answer["env"] == written
        assert sorted(written) == [
            "WM_BROKER_URL",
            "WM_DATABASE_URL",
            "WM_HEALTH_PORT",
            "WM_REDIS_URL",
        ]
        assert written["WM_DATABASE_URL"] == database
        assert written["WM_BROKER_URL"].startswith("redis://127.0.0.1:")
        assert answer["node"]["name"].startswith("wm-up@")
        assert running(answer["node"]["pid"])
    finally:
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert rest == ""  # one JSON object, nothing else on standard output
    assert "wm up  node       celery pid" in err and err.rstrip().endswith("stopped")
    _assert_nothing_left(err)


@pytest.mark.slow
def test_the_env_file_names_the_database_from_any_directory(tmp_path: Path) -> None:
    """The default database is a relative path; ``.wm/env`` names it absolutely, so a
    shell that sourced it finds the same store from another directory."""
    home, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    proc = _run_up(home, "--json", stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        json.loads(proc.stdout.readline())
        written = dict(
            line.split("=", 1) for line in (home / ".wm" / "env").read_text().splitlines()
        )
        database = home / ".wm" / "workmanager.db"
        assert written["WM_DATABASE_URL"] == f"sqlite:///{database}"
        listed = subprocess.run(
            [sys.executable, "-m", "wm.cli", "worker", "list", "--json"],
            cwd=elsewhere,
            env={**_env(), **written},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
        assert not (elsewhere / ".wm").exists()  # no second, empty store
        asked = subprocess.run(  # the first node's health endpoint, from the same file
            [sys.executable, "-m", "wm.cli", "health", "--json"],
            cwd=elsewhere,
            env={**_env(), **written},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert asked.returncode in (0, 1), asked.stderr  # healthy, or degraded (no sandbox)
        assert json.loads(asked.stdout)["node"].startswith("wm-up@")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_an_empty_sqlite_store_names_the_file_a_relative_path_led_to(tmp_path: Path) -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "wm.cli", "worker", "list"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 1
    line = listed.stderr.strip()
    assert line.startswith("wm: error: database sqlite:///.wm/workmanager.db has no "), line
    assert f"from here it is the file {tmp_path / '.wm' / 'workmanager.db'};" in line, line
    assert "`wm up` writes it to .wm/env" in line and listed.stderr.count("\n") == 1


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
@pytest.mark.parametrize(
    "stop",
    [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
    ids=["ctrl-c", "sigterm", "terminal-closed"],
)
def test_a_signal_stops_everything(tmp_path: Path, stop: signal.Signals) -> None:
    proc = _run_up(tmp_path)
    lines = _until(proc, "ready")
    proc.send_signal(stop)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert "stopping" in out and out.rstrip().endswith("stopped")
    _assert_nothing_left(out)


@pytest.mark.slow
def test_a_second_ctrl_c_while_stopping_kills_the_nodes_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """Ctrl-C again while the nodes finish: they are killed at once, and the stop goes on
    to its end (Redis stopped, nothing left) rather than being cut short."""
    proc = _run_up(tmp_path)
    lines = _until(proc, "ready")
    proc.send_signal(signal.SIGINT)
    lines += _until(proc, "stopping")
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert out.rstrip().endswith("stopped") and "Traceback" not in out, out
    _assert_nothing_left(out)


def _until(proc: subprocess.Popen[str], text: str) -> list[str]:
    """The lines ``wm up`` prints up to the first that holds ``text``."""
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            break
    return lines


def _assert_nothing_left(out: str) -> None:
    """The Redis server and every process of each node's group (its pool processes and
    beat) have ended."""
    pids = [
        int(line.split("pid ")[1].split()[0].rstrip(","))
        for line in out.splitlines()
        if line.startswith(("wm up  redis", "wm up  node"))
    ]
    assert len(pids) >= 2  # the Redis server and the Celery nodes

    def gone() -> bool:
        return not any(running(pid) or _group_members(pid) for pid in pids)

    eventually(gone, timeout_s=30)


def _group_members(group: int) -> list[int]:
    """The live (not zombie) processes of the process group ``group``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_an_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    """Under ``nohup wm up &`` the terminal closing must not stop it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "wm.cli", "up"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # as nohup does
    )
    lines = _until(proc, "ready")
    proc.send_signal(signal.SIGHUP)
    assert proc.stdout is not None
    said, _, _ = select.select([proc.stdout], [], [], 3.0)  # a stop would say "stopping"
    assert not said and proc.poll() is None, "".join(lines)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0 and out.rstrip().endswith("stopped"), out
    _assert_nothing_left(out)


def test_one_prefork_node_per_concurrency_cores_by_default() -> None:
    from wm.local.up import default_nodes

    assert [default_nodes(2, "prefork", cores) for cores in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 8]
    assert default_nodes(4, "prefork", 16) == 4 and default_nodes(2, "threads", 16) == 1


@pytest.mark.slow
def test_several_nodes_serve_the_demo_and_all_stop(tmp_path: Path) -> None:
    proc = _run_up(tmp_path, "--demo", "--events", "3", "--nodes", "2")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert out.count("wm up  node       celery pid") == 2, out
    assert "cores      2 nodes of 2 processes each (--nodes)" in out
    for n in (1, 2, 3):
        assert f"HELLO NUMBER {n}!" in out
    assert (tmp_path / ".wm" / "node-2.log").exists()
    assert out.rstrip().endswith("stopped")
    _assert_nothing_left(out)
