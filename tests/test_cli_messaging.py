"""``wm publish`` (one event and a file of them), ``wm tail`` and ``wm subscriptions`` as an
operator runs them: real processes against real Redis and SQLite, a pseudo-terminal where a
person would look at the output."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli_env import GUARD_S, ROOT, one_error_line, wm, wm_json
from tests.helpers import STUB, Terminal, drain, plain, run_in_terminal, stub
from wm import Settings, WorkManager, store
from wm.events import LIFECYCLE_TOPIC, encode, lifecycle_event, make_event

#: Events in a bulk publish.
BULK = 50
#: Width of the narrow pseudo-terminal of the tail tests, in columns.
NARROW = 60


def depths(env: dict[str, str]) -> dict[str, int]:
    return {s["queue"]: s["depth"] for s in wm_json(env, "subscriptions")}


def events_file(path: Path, events: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in events))
    return path


def bulk(rng: random.Random, topics: tuple[str, ...]) -> list[str]:
    """``BULK`` encoded events whose types (their default topic) are drawn from ``topics``."""
    return [
        encode(make_event(rng.choice(topics), "/bulk", {"n": n}, id=f"evt-{n}"))
        for n in range(BULK)
    ]


# -- bulk publish -----------------------------------------------------------------------------


def test_bulk_publish_sends_every_event_of_a_file_to_its_type(
    env: dict[str, str], tmp_path: Path, rng: random.Random
) -> None:
    orders = wm_json(env, "subscribe", "orders", "sink")["queue"]
    audit = wm_json(env, "subscribe", "audit", "sink")["queue"]
    lines = bulk(rng, ("orders", "audit"))
    to_orders = [json.loads(line)["id"] for line in lines if '"orders"' in line]

    result = wm(env, "publish", "--events-file", str(events_file(tmp_path / "e.jsonl", lines)))

    summary = re.fullmatch(
        rf"published {BULK} events to 2 topic\(s\), reached {BULK} subscription\(s\), "
        r"in \d+\.\d\d s \(\d+/s\)\n",
        result.out,
    )
    assert summary, result.out
    assert result.err == ""  # no progress bar without a terminal
    settings = Settings.from_env(env)
    assert [e["id"] for e in drain(settings, orders, len(to_orders), GUARD_S)] == to_orders
    assert depths(env) == {orders: 0, audit: BULK - len(to_orders)}


def test_bulk_publish_of_a_json_array_on_stdin_to_one_topic_counts_in_json(
    env: dict[str, str], rng: random.Random
) -> None:
    queue = wm_json(env, "subscribe", "orders", "sink")["queue"]
    array = "[" + ",\n".join(bulk(rng, ("a", "b", "c"))) + "]"

    counts = wm_json(
        env, "publish", "--events-file", "-", "--topic", "orders", stdin=array.encode()
    )

    assert {k: counts[k] for k in ("published", "reached", "dropped", "topics")} == {
        "published": BULK,
        "reached": BULK,
        "dropped": 0,
        "topics": {"orders": BULK},
    }
    assert counts["elapsed_s"] >= 0 and counts["events_per_s"] >= 0
    assert depths(env)[queue] == BULK


def test_bulk_publish_reports_events_nobody_hears(env: dict[str, str], tmp_path: Path) -> None:
    lines = [encode(make_event("nobody", "/s", None, id=f"e{n}")) for n in range(3)]
    result = wm(env, "publish", "--events-file", str(events_file(tmp_path / "e.jsonl", lines)))
    assert "published 3 events to 1 topic(s), reached 0 subscription(s)" in result.out
    assert "3 dropped: their topic has no subscriber" in result.out


def test_a_bad_line_is_one_error_naming_it_and_nothing_is_published(
    env: dict[str, str], tmp_path: Path, rng: random.Random
) -> None:
    queue = wm_json(env, "subscribe", "orders", "sink")["queue"]
    lines = bulk(rng, ("orders",))
    lines[6] = '{"type": "orders", "source": "/s"}'  # no id, no specversion
    path = events_file(tmp_path / "e.jsonl", ["", *lines])  # a blank line still counts

    error = one_error_line(wm(env, "publish", "--events-file", str(path), expect=1))

    assert f"{path} line 8: CloudEvent lacks required attribute(s): id, specversion" in error
    assert depths(env)[queue] == 0
    not_json = one_error_line(wm(env, "publish", "--events-file", "-", stdin=b"x\n", expect=1))
    assert "standard input line 1: not a JSON CloudEvent" in not_json
    array = one_error_line(wm(env, "publish", "--events-file", "-", stdin=b"[{}]", expect=1))
    assert "standard input item 1: CloudEvent lacks required attribute(s)" in array
    assert depths(env)[queue] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--events-file", "-", "--type", "t"], "--events-file holds the whole event; drop --type"),
        (["--events-file", "-", "--event-file", "-"], "not both"),
        (["--event-file", "-", "--extension", "a=b"], "drop --extension"),
        (["--type", "t", "--source", "/s", "--data", "1", "--data-file", "-"], "not both"),
        (["--source", "/s"], "give --type and --source"),
    ],
)
def test_conflicting_publish_options_are_usage_errors(
    env: dict[str, str], args: list[str], message: str
) -> None:
    result = wm(env, "publish", *args, expect=2)
    assert message in result.err
    assert "Traceback" not in result.err


def test_bulk_publish_shows_progress_in_a_terminal_only(
    env: dict[str, str], tmp_path: Path, rng: random.Random
) -> None:
    wm(env, "subscribe", "orders", "sink")
    path = events_file(tmp_path / "e.jsonl", bulk(rng, ("orders",)))
    args = [sys.executable, "-m", "wm.cli", "publish", "--events-file", str(path)]

    shown = run_in_terminal(args, env)

    assert shown.code == 0, shown.screen
    screen = plain(shown.screen)
    assert "publishing" in screen and f"{BULK}/{BULK}" in screen
    assert f"published {BULK} events to 1 topic(s)" in screen
    piped = wm(env, "publish", "--events-file", str(path))
    assert "publishing" not in piped.out + piped.err


def test_publish_one_event_keeps_its_output(env: dict[str, str]) -> None:
    wm(env, "subscribe", "orders", "sink")
    one = wm(env, "publish", "--type", "orders", "--source", "/s", "--id", "evt-1")
    assert one.out == "published evt-1 to orders: reached 1 subscription(s)\n"
    dropped = wm_json(env, "publish", "--type", "x", "--source", "/s", "--id", "evt-2")
    assert dropped == {"id": "evt-2", "topic": "x", "reached": 0}


# -- consume ----------------------------------------------------------------------------------


def test_consume_takes_messages_and_peek_leaves_them_in_order(env: dict[str, str]) -> None:
    """Issue 29, point 8: an inbox (a plain subscription) is read with ``wm consume``."""
    wm(env, "subscribe", "orders", "inbox")
    for n in range(3):
        wm(env, "publish", "--type", "orders", "--source", "/s", "--id", f"evt-{n}")

    def ids(*args: str) -> list[str]:
        lines = wm(env, "--json", "consume", "orders", "--name", "inbox", *args).out
        return [json.loads(line)["id"] for line in lines.splitlines()]

    assert ids("--count", "2") == ["evt-0", "evt-1"]
    assert ids("--peek") == ["evt-2"]
    assert ids("--peek") == ["evt-2"]  # still there
    assert depths(env)["orders::sub::inbox"] == 1
    shown = wm(env, "consume", "orders", "--name", "inbox")
    assert re.match(r"\S+\s+orders\s+evt-2\s", shown.out), shown.out
    assert len(shown.out.splitlines()) == 1
    empty = wm(env, "consume", "orders", "--name", "inbox", "--timeout-s", "0.2")
    assert empty.out == ""
    assert "no messages in subscription inbox of topic orders" in empty.err


def test_consume_peek_keeps_the_order_of_a_longer_queue(env: dict[str, str]) -> None:
    wm(env, "subscribe", "orders", "inbox")
    for n in range(5):
        wm(env, "publish", "--type", "orders", "--source", "/s", "--id", f"evt-{n}")
    peeked = wm(env, "--json", "consume", "orders", "--name", "inbox", "--peek", "--count", "3")
    assert [json.loads(line)["id"] for line in peeked.out.splitlines()] == [
        "evt-0",
        "evt-1",
        "evt-2",
    ]
    taken = wm(env, "--json", "consume", "orders", "--name", "inbox")
    assert [json.loads(line)["id"] for line in taken.out.splitlines()] == [
        f"evt-{n}" for n in range(5)
    ]


def test_consume_of_a_missing_subscription_names_it_and_the_fix(env: dict[str, str]) -> None:
    result = wm(env, "consume", "orders", "--name", "nobody", expect=1)
    assert one_error_line(result) == (
        "wm: error: topic 'orders' has no subscription named 'nobody'; create it with: "
        "wm subscribe orders nobody"
    )


# -- tail -------------------------------------------------------------------------------------


def tail_subscribed(env: dict[str, str], topic: str, running: Callable[[], bool]) -> None:
    """Return once a ``wm tail`` of ``topic`` has its temporary subscription."""
    manager = WorkManager(Settings.from_env(env))
    deadline = time.monotonic() + GUARD_S
    while not any("::sub::tail-" in s["queue"] for s in manager.list_subscriptions(topic)):
        assert running(), "wm tail ended before it subscribed"
        assert time.monotonic() < deadline, "wm tail never subscribed"
        time.sleep(0.1)
    store.dispose_engines()


def tail_in_terminal(
    env: dict[str, str], topic: str, event: str, *extra: str, columns: int = NARROW
) -> str:
    """What ``wm tail`` showed in a pseudo-terminal while ``event`` was published."""
    seen: list[Terminal] = []
    args = [sys.executable, "-m", "wm.cli", "tail", topic, "--count", "1", *extra]
    running = threading.Thread(
        target=lambda: seen.append(run_in_terminal(args, env, columns=columns, timeout_s=GUARD_S))
    )
    running.start()
    try:
        tail_subscribed(env, topic, running.is_alive)
        wm(env, "publish", "--event-file", "-", "--topic", topic, stdin=event.encode())
    finally:
        running.join(GUARD_S)
    assert seen and seen[0].code == 0, seen
    return plain(seen[0].screen)


def long_event() -> tuple[str, str]:
    """An event with data far wider than a terminal, and the id it has."""
    event_id = str(uuid.UUID(int=random.Random(7).getrandbits(128)))
    data = {"amount": 12, "note": "n" * 150, "end": "the-end"}
    event = make_event(
        "orders",
        "/shop",
        data,
        id=event_id,
        subject="order-7",
        extensions={"correlationid": "corr-9"},
    )
    return encode(event), event_id


def test_tail_cuts_the_data_to_the_terminal_width(env: dict[str, str]) -> None:
    event, event_id = long_event()
    screen = tail_in_terminal(env, "orders", event)

    lines = screen.splitlines()
    assert lines[0] == "listening on orders (Ctrl-C stops)"
    line = lines[1]
    assert len(line) == NARROW and line.endswith("…")
    assert line.split()[1:5] == ["orders", event_id[:8], "order-7", "corr-9"]
    assert line.split()[0].endswith("Z")
    assert '{"amount":12,' in line
    assert "the-end" not in screen


def test_tail_full_prints_the_whole_data(env: dict[str, str]) -> None:
    event, event_id = long_event()
    screen = tail_in_terminal(env, "orders", event, "--full")

    assert event_id in screen
    data = screen[screen.index("{") :]
    assert json.loads(data) == json.loads(event)["data"]
    assert "…" not in screen


def test_tail_prints_whole_lines_into_a_pipe(env: dict[str, str]) -> None:
    event, event_id = long_event()
    tail = subprocess.Popen(
        [sys.executable, "-m", "wm.cli", "tail", "orders", "--count", "1"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        tail_subscribed(env, "orders", lambda: tail.poll() is None)
        wm(env, "publish", "--event-file", "-", stdin=event.encode())
        out, err = tail.communicate(timeout=GUARD_S)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
    assert tail.returncode == 0, err
    assert err.decode().strip() == "listening on orders (Ctrl-C stops)"
    fields = out.decode().rstrip("\n").split("  ")
    assert fields[1:5] == ["orders", event_id[:8], "order-7", "corr-9"]
    assert json.loads(fields[5]) == json.loads(event)["data"]


def test_tail_shows_a_lifecycle_error_by_worker_name(env: dict[str, str]) -> None:
    worker_id = str(uuid.UUID(int=random.Random(11).getrandbits(128)))
    message = "the engine died: segmentation fault while handling event evt-42"
    data = {  # what wm.dataplane.outbox.record_failure writes
        "group": None,
        "topic": "orders",
        "name": "billing",
        "version": 1,
        "reason": message,
        "error_type": "WorkerCrashed",
        "error_message": message,
    }
    event = encode(lifecycle_event("error", worker_id, data))

    screen = tail_in_terminal(env, LIFECYCLE_TOPIC, event)

    headline = screen.splitlines()[1]
    assert headline.split()[1] == "lifecycle.error"
    assert f"billing ({worker_id[:8]})" in headline
    assert f"error: WorkerCrashed: {message}" in " ".join(screen.split())  # wrapped, not cut


def test_tail_notes_that_it_listens_and_stops_when_quiet(env: dict[str, str]) -> None:
    result = wm(env, "tail", "orders", "--timeout-s", "1")
    assert result.out == ""
    assert result.err.strip() == "listening on orders (Ctrl-C stops)"
    assert wm_json(env, "subscriptions") == []


# -- subscriptions ----------------------------------------------------------------------------


def test_subscriptions_show_a_worker_by_name_beside_its_id(
    env: dict[str, str], tmp_path: Path
) -> None:
    code = tmp_path / "code.json"
    code.write_bytes(stub(output_type="done"))
    create = ["worker", "create", "--topic", "orders", "--mime-type", STUB, "--file", str(code)]
    created = wm_json(env, *create)
    named = wm_json(env, *create, "--name", "billing", "--no-start")
    wm(env, "subscribe", "orders", "sink")

    rows = [line.split() for line in wm(env, "subscriptions").out.splitlines()]

    assert rows[0] == ["TOPIC", "QUEUE", "WORKER", "DEPTH"]
    workers = {tuple(row[2:-1]) for row in rows[1:]}
    assert workers == {(created["id"],), ("billing", f"({named['id']})"), ("-",)}
    listed = wm_json(env, "subscriptions", "--topic", "orders")
    assert {s["worker_id"] for s in listed} == {created["id"], named["id"], None}
