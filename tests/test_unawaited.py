"""Writes whose replies nobody waits for (``wm.state.unawaited``), on the real Redis: the
reply is read at the thread's next send, an error in it is logged naming what was sent, a
connection lost before it is logged and the next send connects again, and a forked child
starts with none of its parent's."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.conftest import REDIS_HOST, STATE_DB, flush_redis, make_settings
from tests.helpers import free_port
from wm.state.ledger import Ledger
from wm.state.outcomes import Outcomes
from wm.state.unawaited import UNAWAITED, Unawaited


@pytest.fixture
def client(redis_ok: None) -> redis.Redis:
    flush_redis(STATE_DB)
    return redis.Redis.from_url(f"{REDIS_HOST}/{STATE_DB}")


#: An age no reply reaches in a test: only a send (or settle) reads it.
NEVER = 3600.0


def _kill(client: redis.Redis, name: str) -> None:
    """Close, on the server's side, the one connection named ``name``."""
    [ours] = [c for c in client.client_list() if c["name"] == name]
    client.client_kill_filter(_id=ours["id"])


def test_a_reply_is_read_at_the_next_send_not_before(client: redis.Redis) -> None:
    later = Unawaited(idle_s=NEVER)
    later.send(client, ("SET", "k", "1"), "the first write")
    assert later.unread() == ["the first write"]
    later.send(client, ("INCR", "k"), "the second write")  # reads the first's reply
    assert later.unread() == ["the second write"]
    later.settle()
    assert later.unread() == []
    assert client.get("k") == b"2"  # both ran, in order, on the one connection


def test_an_error_in_a_reply_is_logged_naming_what_was_sent(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    later = Unawaited(idle_s=NEVER)
    client.hset("h", "f", "v")
    later.send(client, ("EVAL", "return redis.call('GET', KEYS[1])", 1, "h"), "the outcome of e1")
    assert not caplog.records  # nobody waited: nothing known yet
    with caplog.at_level(logging.ERROR, logger="wm.state.unawaited"):
        later.send(client, ("SET", "k", "1"), "the outcome of e2")
    [line] = caplog.records
    assert "the outcome of e1 was not written" in line.getMessage()
    assert "WRONGTYPE" in line.getMessage()
    assert "delivers its event again" in line.getMessage()
    later.settle()
    assert client.get("k") == b"1"  # the next write went on


def test_a_connection_lost_before_the_reply_is_logged_and_the_next_send_reconnects(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    later = Unawaited(idle_s=NEVER)
    later.send(client, ("CLIENT", "SETNAME", "wm-unawaited-test"), "the name")
    later.send(client, ("BLPOP", "nothing", 10), "the first write")  # no reply for 10 s
    _kill(client, "wm-unawaited-test")
    with caplog.at_level(logging.WARNING, logger="wm.state.unawaited"):
        later.send(client, ("SET", "k", "2"), "the second write")
    messages = [r.getMessage() for r in caplog.records]
    assert any("the first write may not have been written" in m for m in messages), messages
    later.send(client, ("SET", "k", "3"), "the third write")  # read the second's reply
    later.settle()
    assert client.get("k") == b"3"  # both on the new connection


#: What a replica answers a write with: the error of a failover, for a while.
READONLY = ("EVAL", "return redis.error_reply('READONLY a read only replica')", 0)


def test_a_write_a_failover_refused_has_its_fallback_run(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The fallback (a record's: its ledger entry due at once) runs, and waits, when the
    reply holds a failover's error; an entry settled meanwhile is not added back."""
    later = Unawaited(idle_s=NEVER)
    client.zadd("index", {"pending": 1000.0})
    with caplog.at_level(logging.ERROR, logger="wm.state.unawaited"):
        later.send(client, READONLY, "the outcome of e1", ("ZADD", "index", "XX", 0, "pending"))
        later.send(client, READONLY, "the outcome of e2", ("ZADD", "index", "XX", 0, "settled"))
        later.settle()
    assert client.zscore("index", "pending") == 0  # due at the sweep's next turn
    assert client.zscore("index", "settled") is None
    first, second = (r.getMessage() for r in caplog.records)
    assert first.startswith("the outcome of e1 was not written: a read only replica"), first
    assert "the pending ledger's sweep delivers its event again at its next turn" in first
    assert "the outcome of e2 was not written" in second


def test_commands_sent_together_have_every_reply_read_and_any_refusal_runs_the_fallback(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A record with its outputs' pushes behind it, in one write: every reply is read (the
    next send's replies are its own), and a failover's error in any of them runs the
    fallback (here the second's: the record was written, the push was not)."""
    later = Unawaited(idle_s=NEVER)
    with caplog.at_level(logging.ERROR, logger="wm.state.unawaited"):
        later.send(
            client,
            ("SET", "k", "1"),
            "the outcome of e1",
            ("ZADD", "index", 0, "e1"),
            [READONLY, ("INCR", "k")],
        )
        assert later.unread() == ["the outcome of e1"]
        later.send(client, ("INCR", "k"), "the outcome of e2", None, [("INCR", "k")])
        later.settle()
    assert client.zscore("index", "e1") == 0  # due at the sweep's next turn
    assert client.get("k") == b"4"  # every command ran, in order
    [line] = caplog.records
    assert line.getMessage().startswith("the outcome of e1 was not written: a read only replica")
    assert later.unread() == []
    # an error a command behind meets again runs it too; the first command's does not
    client.hset("h", "f", "v")
    wrong = ("EVAL", "return redis.call('GET', KEYS[1])", 1, "h")
    later.send(client, ("SET", "k", "1"), "e2", ("ZADD", "index", 0, "e2"), [wrong])
    later.send(client, wrong, "e3", ("ZADD", "index", 0, "e3"), [("SET", "k", "1")])
    later.settle()
    assert client.zscore("index", "e2") == 0
    assert client.zscore("index", "e3") is None


def test_a_write_that_would_fail_again_keeps_its_entry_as_it_was(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An error the write would meet again (a key of the wrong type) does not run the
    fallback: run again at every sweep, the event's code would run again at every sweep."""
    later = Unawaited(idle_s=NEVER)
    client.zadd("index", {"pending": 1000.0})
    client.hset("h", "f", "v")
    wrong = ("EVAL", "return redis.call('GET', KEYS[1])", 1, "h")
    with caplog.at_level(logging.ERROR, logger="wm.state.unawaited"):
        later.send(client, wrong, "the outcome of e1", ("ZADD", "index", "XX", 0, "pending"))
        later.settle()
    assert client.zscore("index", "pending") == 1000.0
    [line] = caplog.records
    assert "again after WM_REDELIVER_AFTER_S" in line.getMessage(), line.getMessage()


def test_a_write_whose_reply_never_came_has_its_fallback_run_on_a_new_connection(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    later = Unawaited(idle_s=NEVER)
    client.zadd("index", {"pending": 1000.0})
    later.send(client, ("CLIENT", "SETNAME", "wm-unawaited-lost"), "the name")
    fallback = ("ZADD", "index", "XX", 0, "pending")
    later.send(client, ("BLPOP", "nothing", 10), "the outcome of e1", fallback)
    _kill(client, "wm-unawaited-lost")
    with caplog.at_level(logging.WARNING, logger="wm.state.unawaited"):
        later.settle()
    assert client.zscore("index", "pending") == 0
    [line] = caplog.records
    message = line.getMessage()
    assert "the outcome of e1 may not have been written" in message, message
    assert (
        "if it was not, the pending ledger's sweep delivers its event again at its next turn)"
        in message
    )


def test_a_connection_the_server_closed_is_found_before_the_send(client: redis.Redis) -> None:
    """The write would go into a socket the server closed (and be lost, logged only at the
    next send): the send finds the close first, as redis-py's pool does, and connects again."""
    later = Unawaited(idle_s=NEVER)
    later.send(client, ("CLIENT", "SETNAME", "wm-unawaited-closed"), "the name")
    later.settle()
    _kill(client, "wm-unawaited-closed")
    later.send(client, ("SET", "k", "5"), "the write")
    later.settle()
    assert client.get("k") == b"5"


def test_settling_waits_for_a_reply_a_bounded_time(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    later = Unawaited(idle_s=NEVER)
    later.send(client, ("BLPOP", "nothing", 10), "the slow one")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="wm.state.unawaited"):
        later.settle(timeout_s=0.2)
    assert time.monotonic() - started < 5
    [line] = caplog.records
    assert "the slow one may not have been written: its reply did not come" in line.getMessage()
    assert later.unread() == []


def test_each_thread_has_its_own_connection_and_a_forked_child_none(client: redis.Redis) -> None:
    later = Unawaited(idle_s=NEVER)
    later.send(client, ("SET", "a", "1"), "main's write")
    sent, done = threading.Event(), threading.Event()

    def other() -> None:
        later.send(client, ("SET", "b", "1"), "its write")
        sent.set()
        done.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert sent.wait(10)
        assert sorted(later.unread()) == ["its write", "main's write"]
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: none of the parent's connections or replies
            os.write(write, str(len(later.unread())).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        os.close(write)
        with os.fdopen(read, "rb") as answer:
            assert answer.read() == b"0"
        assert sorted(later.unread()) == ["its write", "main's write"]
    finally:
        done.set()
        thread.join()
    del thread
    gc.collect()
    assert later.unread() == ["main's write"]  # a thread's slot goes with it


def test_a_record_a_failover_refused_is_due_at_the_sweeps_next_turn(
    own_redis: tuple[int, Callable[[], None]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the defaults: a delivery without outputs whose record a demoted primary refused
    (READONLY), read after the failover, is due at once in the pending ledger, so the sweep's
    next turn delivers its event again, not the turn an hour later."""
    port, _ = own_redis
    url = f"redis://127.0.0.1:{port}/1"
    settings = make_settings(f"sqlite:///{tmp_path / 'wm.db'}", redis_url=url)
    ledger, worker, key, payload = Ledger(settings), str(uuid.uuid4()), "/src:e1", "{}"
    ledger.add([(worker, "queue")], key, payload)
    monkeypatch.setattr(UNAWAITED, "idle_s", NEVER)  # read below, after the failover
    server = redis.Redis(port=port)
    server.replicaof("127.0.0.1", free_port())  # demoted: a replica of a primary not there
    settlement = ledger.settlement(worker, key, payload)
    Outcomes(settings).record(worker, key, [], settlement, unread=0)
    server.replicaof("NO", "ONE")  # the failover: it is the primary again
    UNAWAITED.settle()
    assert [p.key for p in ledger.overdue(worker, settings.redeliver_after_s)] == [key]
    assert settings.redeliver_after_s == 3600  # the default: an hour it no longer waits


def test_a_reply_no_send_reads_is_read_by_the_reader_thread(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A process gone idle after a failed write: its reader thread reads the reply once it
    is ``idle_s`` old, and runs the fallback, with no other send."""
    later = Unawaited(idle_s=0.2)
    client.zadd("index", {"pending": 1000.0})
    with caplog.at_level(logging.ERROR, logger="wm.state.unawaited"):
        later.send(client, READONLY, "the outcome of e1", ("ZADD", "index", "XX", 0, "pending"))
        deadline = time.monotonic() + 10
        while client.zscore("index", "pending") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert client.zscore("index", "pending") == 0
    assert later.unread() == []
    [line] = caplog.records
    assert line.threadName == "wm-unawaited", line.threadName
    assert "the outcome of e1 was not written" in line.getMessage()


def test_a_reply_that_has_not_come_is_left_to_the_next_send(client: redis.Redis) -> None:
    """A slow server is no lost connection: the reader reads only a reply that came."""
    later = Unawaited(idle_s=0.1)
    later.send(client, ("BLPOP", "slow", 30), "the slow one")
    time.sleep(0.5)  # the reader's turns came and went
    assert later.unread() == ["the slow one"]
    client.lpush("slow", "now")  # the reply comes
    later.settle(timeout_s=5)
    assert later.unread() == []
    assert client.llen("slow") == 0  # it was the BLPOP's
