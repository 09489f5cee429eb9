"""Flower, as an operator sees it, against a real node: each delivery is named after its
topic and worker, shows the event's id and type and the attempt but not its data, a retried
attempt is RETRY, a dead-lettered delivery FAILURE with the reason; Flower is behind basic
authentication, its password never on a command line."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.conftest import ROOT, env_of
from tests.helpers import STUB, all_docs, drain, eventually, free_port, stub
from wm import DeadLetters, Settings, WorkManager, make_event

AUTH = "operator:s3cret"


def _get(port: int, path: str, auth: str | None = AUTH) -> Any:
    return json.loads(_page(port, path, auth))


def _page(port: int, path: str, auth: str | None = AUTH) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(request, timeout=10) as reply:
        return str(reply.read().decode())


@pytest.fixture
def flower(pg_settings: Settings, tmp_path: Path) -> Any:
    port = free_port()
    log = (tmp_path / "flower.log").open("ab")
    conf = tmp_path / "flowerconfig.py"
    conf.write_text(f"basic_auth = [{AUTH!r}]\n")
    conf.chmod(0o600)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "wm.celeryapp",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            f"--conf={conf}",
        ],
        env=env_of(pg_settings),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def up() -> bool:
        try:
            return _get(port, "/api/workers") is not None
        except (urllib.error.URLError, ConnectionError):
            return False

    try:
        eventually(up, timeout_s=60)
        assert AUTH.split(":")[1] not in " ".join(psutil.Process(process.pid).cmdline())
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Flower's SIGTERM handler raises SystemExit wherever the signal lands; in a
            # finalizer Python prints "Exception ignored" and Flower runs on (as Celery beat
            # did, wm.dataplane.beat). What stops it then is what docker stop sends next.
            process.kill()
            process.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_flower_names_deliveries_hides_data_and_shows_retries_and_dead_letters(
    pg_settings: Settings, start_node: Any, flower: int
) -> None:
    manager = WorkManager(pg_settings)
    out = manager.subscribe("fl.done", "out")
    manager.create_worker(
        code=stub(output_type="fl.done"), mime_type=STUB, topic="fl.in", name="greeter"
    )
    broken = manager.create_worker(
        code=stub(fail="boom"),
        mime_type=STUB,
        topic="fl.bad",
        name="broken",
        # a retry waits 4-8 s: long enough for a loaded machine's Flower to show RETRY (its
        # one failure in one delivery, judged inside the wait, makes it degraded, not paused)
        settings={"max_retries": 1, "retry_base_delay_ms": 8000, "failure_threshold": 0},
    )
    node = start_node(pg_settings)
    node.consuming(f"fl.bad::{broken.id}")
    good = make_event("fl.in", "/t", {"secret": "personal data"})
    bad = make_event("fl.bad", "/t", {"secret": "personal data"})

    def tasks() -> dict[str, Any]:
        return dict(_get(flower, "/api/tasks"))

    # Flower switches task events on when it connects; publish until it sees a delivery
    def seen() -> bool:
        manager.publish(make_event("fl.in", "/t", {"warm": True}))
        return any(t.get("name", "").startswith("deliver fl.in") for t in tasks().values())

    eventually(seen, timeout_s=60, interval_s=1)
    manager.publish(good)
    manager.publish(bad)
    assert drain(pg_settings, out, 1, timeout_s=30)

    def of(event: Any) -> list[dict[str, Any]]:
        return [t for t in tasks().values() if event.get_id() in str(t.get("args"))]

    # the failed attempt waits 4-8 s to be sent again (the same task): RETRY meanwhile
    eventually(lambda: [t for t in of(bad) if t.get("state") == "RETRY"])
    [failed] = eventually(lambda: [t for t in of(bad) if t.get("state") == "FAILURE"])
    assert failed["name"] == "deliver fl.bad → broken"
    assert failed["args"] == f"('event {bad.get_id()} (fl.bad)',)"
    assert failed["kwargs"] == "{'attempt': 2}"
    assert "dead-lettered after 2 attempt(s): WorkerExecutionError: boom" in failed["exception"]
    assert len(DeadLetters(pg_settings).list()) == 1
    [ok] = eventually(lambda: [t for t in of(good) if t.get("state") == "SUCCESS"])
    assert ok["name"] == "deliver fl.in → greeter"
    assert ok["args"] == f"('event {good.get_id()} (fl.in)',)"
    assert ok["kwargs"] == "{'attempt': 1}"
    everything = json.dumps(tasks())
    assert "personal data" not in everything  # no event data unless WM_FLOWER_SHOW_DATA

    with pytest.raises(urllib.error.HTTPError) as refused:
        _get(flower, "/api/tasks", auth=None)
    assert refused.value.code == 401
    _broker_tab_counts_worker_queues(manager, node, flower)


def _broker_tab_counts_worker_queues(manager: WorkManager, node: Any, flower: int) -> None:
    """Issue 29, point 6: the Broker tab said "'redis' broker is not supported" (the nodes'
    own Redis transport named the URL's scheme); it lists each worker queue with the number
    of messages waiting in Redis."""
    slow = manager.create_worker(
        code=stub(sleep_ms=1000), mime_type=STUB, topic="fl.slow", name="slow"
    )
    queue = f"fl.slow::{slow.id}"
    node.consuming(queue)
    for n in range(60):  # a backlog for 30 s: two at a time, a second each
        manager.publish(make_event("fl.slow", "/t", {"n": n}))

    def waiting() -> list[dict[str, Any]]:
        try:  # the nodes' queues, as they are now; Flower asks the nodes and waits for them
            _get(flower, "/api/workers?refresh=1")
            queues = _get(flower, "/api/queues/length")["active_queues"]
        except TimeoutError:  # a loaded machine's reply came after urlopen's 10 s
            return []
        return [q for q in queues if q["name"] == queue and q["messages"] > 0]

    [listed] = eventually(waiting, timeout_s=60)
    page = _page(flower, "/broker")
    assert "not supported" not in page
    assert f"<td>{queue}</td>" in page
    assert "redis://" in page  # the broker's URL, by its scheme
    assert 0 < listed["messages"] <= 60


def test_no_documented_command_gives_flower_a_password() -> None:
    """Finding 11: the README ran Flower with its password as an option, where ``ps`` shows
    it to every user of the machine; its login comes from a file or the environment."""
    assert "--basic-auth" not in all_docs()  # the README and every page of docs/
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = compose["services"]["flower"]["command"]
    assert not [part for part in command if "auth" in part], command
    env_file = (ROOT / "ops" / "compose" / "flower.env").read_text()
    assert "\nFLOWER_BASIC_AUTH=" in env_file
