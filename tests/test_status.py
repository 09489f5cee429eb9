"""``wm status`` and ``wm worker show`` as an operator runs them: a real node, workers in
several states, a queue that fills while its worker is stopped, a dead letter, a breaker
that opened; then the same commands with a service down."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import env_of
from tests.helpers import STUB, eventually, free_port, plain, run_in_terminal, stub
from wm import Settings, WorkManager
from wm.control.access import Tokens
from wm.control.deadletters import DeadLetters
from wm.events import make_event
from wm.views import Role

ROOT = Path(__file__).resolve().parent.parent
#: Longest one command may take, in seconds: a guard against hangs, not a timing test.
GUARD_S = 60.0
#: Seconds a ``wm`` process may take beyond its ping's timeout (interpreter, imports, queries).
STARTUP_S = 8.0
#: Parked at the first failure, the breaker off: one dead letter per event.
PARK_AT_ONCE = {"max_retries": 0, "failure_threshold": 0}
#: Opens at the first failure and stays open for the whole test.
OPENS_AT_ONCE = {"failure_threshold": 1, "max_retries": 5, "breaker_base_delay_s": 600}


def wm(
    settings: Settings, *args: str, expect: int = 0, **env: str
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "wm.cli", *args],
        env=env_of(settings, **env),
        capture_output=True,
        text=True,
        timeout=GUARD_S,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == expect, (
        f"wm {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
    )
    return done


def wm_json(settings: Settings, *args: str, **env: str) -> Any:
    return json.loads(wm(settings, "--json", *args, **env).stdout)


def terminal(settings: Settings, *args: str) -> str:
    """What ``wm ARGS`` shows a person at an 80-column terminal; every line fits it."""
    shown = run_in_terminal([sys.executable, "-m", "wm.cli", *args], env_of(settings))
    assert shown.code == 0, shown.screen
    screen = plain(shown.screen)
    assert all(len(line) <= 80 for line in screen.splitlines()), screen
    return screen


def one_line(text: str) -> str:
    """``text`` with each run of blanks and line ends as one space (a wrapped cell rejoined)."""
    return " ".join(text.split())


@pytest.mark.slow
def test_status_and_worker_show_tell_an_operator_what_runs_waits_and_fails(
    pg_settings: Settings, start_node: Any
) -> None:
    manager = WorkManager(pg_settings)
    bad = manager.create_worker(
        code=stub(fail="boom"), mime_type=STUB, topic="st.bad", name="bad", settings=PARK_AT_ONCE
    )
    flaky = manager.create_worker(
        code=stub(fail="flake"),
        mime_type=STUB,
        topic="st.flaky",
        name="flaky",
        settings=OPENS_AT_ONCE,
    )
    parked = manager.create_worker(code=stub(), mime_type=STUB, topic="st.wait", name="parked")
    manager.stop_worker(parked.id)
    manager.create_worker(code=stub(), mime_type=STUB, topic="st.idle", name="idle", start=False)
    node = start_node(pg_settings)
    node.consuming(f"st.bad::{bad.id}")
    node.consuming(f"st.flaky::{flaky.id}")

    # bad's failure first: a process adds its first delivery count to Redis at once
    manager.publish(make_event("st.bad", "/t", {"n": 0}))
    eventually(lambda: DeadLetters(pg_settings).list(), timeout_s=GUARD_S)
    manager.publish(make_event("st.flaky", "/t", {"n": 0}))
    for n in range(3):
        manager.publish(make_event("st.wait", "/t", {"n": n}))
    # flaky's attempt goes back to its queue when its breaker opens
    eventually(lambda: manager.status().queued == 4, timeout_s=GUARD_S)

    found = wm_json(pg_settings, "status")
    assert [name.partition("@")[0] for name in found["nodes"]] == ["node1"]
    assert found["workers"] == 4
    assert found["by_status"] == {"created": 1, "running": 1, "stopped": 1, "pending": 1}
    assert sum(found["by_health"].values()) == 4
    assert found["queued"] == 4
    assert [(q["name"], q["topic"], q["depth"]) for q in found["deepest_queues"]] == [
        ("parked", "st.wait", 3),
        ("flaky", "st.flaky", 1),
    ]
    assert found["deepest_queues"][0]["worker_id"] == str(parked.id)
    assert found["dead_letters"] == {"st.bad": 1}
    assert found["unavailable"] == {}
    breakers = {b["name"]: b for b in found["recovery"]["breakers"]}
    assert set(breakers) == {"bad", "flaky"}
    assert breakers["flaky"]["state"] == "open" and breakers["flaky"]["trips"] == 1
    assert breakers["flaky"]["retry_at"] is not None
    assert breakers["bad"]["state"] == "off" and breakers["bad"]["consecutive_failures"] == 1
    # The node sweeps every reconcile period, and is named as the maintaining one.
    assert found["recovery"]["maintaining_node"] in found["nodes"]

    screen = terminal(pg_settings, "status")
    assert "1 alive: node1@" in one_line(screen)
    assert "4: created 1, running 1, stopped 1, pending 1" in screen
    assert "4 messages waiting" in screen
    for heading in ("Deepest queues", "Dead letters not replayed", "Circuit breakers"):
        assert heading in screen
    assert f"parked ({parked.id})" in screen
    assert re.search(r"open +1/1 +1 +[\d.]+ (s|min) +flaky", screen), screen
    assert re.search(r"off +1/- +0 +- +bad", screen), screen
    assert f"({flaky.id})" in screen and "st.bad" in screen  # ids never cut

    shown_bad = wm_json(pg_settings, "worker", "show", "bad")
    assert shown_bad["id"] == str(bad.id) and shown_bad["status"] == "running"
    assert shown_bad["queue"] == f"st.bad::{bad.id}" and shown_bad["queue_depth"] == 0
    assert shown_bad["dead_letters"] == 1
    assert shown_bad["last_error"]["source"] == "dead letter"
    assert shown_bad["last_error"]["error_type"] == "WorkerExecutionError"
    assert "boom" in shown_bad["last_error"]["message"]
    recent = shown_bad["deliveries_last_minute"]
    assert (recent["ok"], recent["failed"]) == (0, 1)
    assert shown_bad["deliveries_window"]["failed"] == 1
    assert shown_bad["unavailable"] == {}

    shown_flaky = wm_json(pg_settings, "worker", "show", "flaky")
    assert shown_flaky["status"] == "pending" and shown_flaky["queue_depth"] == 1
    assert shown_flaky["dead_letters"] == 0
    assert shown_flaky["breaker"]["state"] == "open"
    assert shown_flaky["last_error"]["source"] == "transition"
    assert "circuit breaker opened" in shown_flaky["last_error"]["message"]
    assert "flake" in shown_flaky["last_error"]["message"]

    shown_parked = wm_json(pg_settings, "worker", "show", "parked")
    assert (shown_parked["status"], shown_parked["queue_depth"]) == ("stopped", 3)
    assert shown_parked["last_error"] is None

    screen = one_line(terminal(pg_settings, "worker", "show", "bad"))
    assert "dead letters: 1 not replayed" in screen
    assert "queued: 0" in screen
    assert "(dead letter): WorkerExecutionError:" in screen and "boom" in screen
    assert "last minute: 0 ok, 1 failed since" in screen
    assert "breaker: off: 1 failed in a row" in screen


def test_with_no_node_status_says_so_within_the_ping_timeout(settings: Settings) -> None:
    """On Redis no node keeps a liveness record: the ping is not waited for at all."""
    ping_s = 1.5
    started = time.monotonic()
    found = wm_json(settings, "status", "--ping-timeout", str(ping_s))
    took = time.monotonic() - started
    assert found["nodes"] == [] and found["unavailable"] == {}
    assert found["workers"] == 0 and found["by_status"] == {} and found["queued"] == 0
    assert took < ping_s + STARTUP_S
    screen = terminal(settings, "status")
    shown = one_line(screen)
    assert "nodes: none answered the ping within 1 s" in shown
    assert "workers: 0" in shown and "dead letters: none" in shown


def test_a_service_down_leaves_its_parts_out_and_shows_the_rest(settings: Settings) -> None:
    manager = WorkManager(settings)
    made = manager.create_worker(code=stub(), mime_type=STUB, topic="st.down", name="down")
    nowhere = f"redis://127.0.0.1:{free_port()}/0"

    started = time.monotonic()
    found = wm_json(settings, "status", WM_BROKER_URL=nowhere)
    assert time.monotonic() - started < STARTUP_S  # no retrying an unreachable broker
    assert found["nodes"] is None and found["queued"] is None
    assert found["deepest_queues"] is None
    assert "WM_BROKER_URL" in found["unavailable"]["broker"]
    assert found["workers"] == 1 and found["by_health"] == {"unknown": 1}
    assert found["recovery"] is not None

    shown = wm_json(settings, "worker", "show", "down", WM_BROKER_URL=nowhere)
    assert shown["id"] == str(made.id) and shown["queue_depth"] is None
    assert shown["breaker"]["state"] == "closed"
    assert list(shown["unavailable"]) == ["broker"]

    found = wm_json(settings, "status", WM_BROKER_URL=nowhere, WM_REDIS_URL=nowhere)
    assert found["by_health"] is None and found["recovery"] is None
    assert set(found["unavailable"]) == {"broker", "redis"}
    assert found["by_status"] == {"running": 1}
    people = one_line(wm(settings, "status", WM_BROKER_URL=nowhere, WM_REDIS_URL=nowhere).stdout)
    assert "nodes: unavailable (broker)" in people and "health: unavailable (redis)" in people
    assert people.count("is unreachable") == 2  # each reason once, at the end

    dead = f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none"
    failed = wm(settings, "status", expect=1, WM_DATABASE_URL=dead)
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wm: error: database"), failed.stderr


def test_the_http_api_answers_the_same_status(pg_settings: Settings) -> None:
    from tests.test_api import start_api, stop

    _, token = Tokens(pg_settings).create("status-viewer", Role.VIEWER)
    url, process = start_api(pg_settings)
    try:
        headers = {"Authorization": f"Bearer {token}"}
        reply = httpx.get(f"{url}/v1/status", headers=headers, timeout=GUARD_S)
    finally:
        out = stop(process)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    cli = wm_json(pg_settings, "status")
    assert set(answer) == set(cli)
    assert answer["nodes"] == [] and answer["unavailable"] == {}
    assert "Traceback" not in out


def test_the_command_waits_for_the_ping_as_long_as_the_api_does() -> None:
    from wm.cli.status import PING_TIMEOUT_S as CLI_DEFAULT
    from wm.control.overview import PING_TIMEOUT_S

    assert CLI_DEFAULT == PING_TIMEOUT_S


def test_delivery_counts_start_at_a_minute_and_skip_older_ones() -> None:
    from wm.control.workerdetails import delivery_counts

    counts = {b"100:ok": b"3", b"100:failed": b"1", b"99:ok": b"7", b"101:failed": b"2"}
    found = delivery_counts(counts, 100)
    assert (found.ok, found.failed) == (3, 3)
    assert found.since.timestamp() == 100 * 60


def test_on_rabbitmq_a_missing_queue_counts_as_empty_and_the_rest_are_counted(
    amqp_settings: Settings,
) -> None:
    manager = WorkManager(amqp_settings)
    gone = manager.create_worker(code=stub(), mime_type=STUB, topic="st.gone", name="gone")
    manager.bus.delete_queue(f"st.gone::{gone.id}")  # RabbitMQ closes a channel asked for it
    waiting = manager.create_worker(code=stub(), mime_type=STUB, topic="st.amqp", name="waits")
    manager.stop_worker(waiting.id)
    for n in range(2):
        manager.publish(make_event("st.amqp", "/t", {"n": n}))

    found = wm_json(amqp_settings, "status")  # other test runs' nodes may share the broker
    assert found["queued"] == 2 and found["unavailable"] == {}
    assert [(q["name"], q["depth"]) for q in found["deepest_queues"]] == [("waits", 2)]
    assert wm_json(amqp_settings, "worker", "show", "gone")["queue_depth"] == 0
    for made in (gone, waiting):  # their queues go: the broker is shared
        manager.delete_worker(made.id)
