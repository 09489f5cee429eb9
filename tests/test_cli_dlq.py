"""``wm dlq …`` as an operator runs it: a real process against real Redis, SQLite and
PostgreSQL; tables and progress bars in a pseudo-terminal, JSON and summaries through pipes."""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from tests.cli_env import wm, wm_json
from tests.conftest import (
    CLI_BROKER_DB,
    CLI_STATE_DB,
    PG_ADMIN_URL,
    REDIS_HOST,
    env_of,
    flush_redis,
    fresh_schema,
    make_settings,
)
from tests.helpers import STUB, plain, run_in_terminal, stub
from wm import Settings, WorkManager, store
from wm.dataplane.deadletters import DeadLetters, Failure
from wm.events import encode, key_of, make_event
from wm.store.models import DeadLetter

#: An error message longer than any terminal here: made of numbered words, so a test can tell
#: it was wrapped whole (every word shown) rather than cut.
LONG_ERROR = " ".join(f"word{n:02d}" for n in range(40))
#: Letters a replay sends in the progress test, and its rate (letters per second): slow
#: enough that the bar is drawn part-way several times (rich refreshes 10 times a second).
REPLAYED, REPLAY_RATE = 21, "10"


def in_terminal(env: dict[str, str], *args: str, columns: int) -> list[str]:
    """The lines ``wm ARGS`` showed in a pseudo-terminal ``columns`` wide (exit code 0)."""
    shown = run_in_terminal([sys.executable, "-m", "wm.cli", *args], env, columns=columns)
    screen = plain(shown.screen)
    assert shown.code == 0, screen
    return screen.splitlines()


def require(service: str, check: Any) -> None:
    """A missing service fails these tests: they are about talking to it."""
    try:
        check()
    except Exception as exc:
        pytest.fail(f"{service} is not available: {exc}")


def _ping_postgres() -> None:
    engine = sa.create_engine(PG_ADMIN_URL)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def any_settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """Settings on a fresh, migrated database of each kind and clean Redis databases."""
    yield from _settings(request, tmp_path, request.param)


@pytest.fixture
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """Settings on a fresh SQLite database: for the tests about the terminal."""
    yield from _settings(request, tmp_path, "sqlite")


def _settings(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> Iterator[Settings]:
    require("Redis", lambda: redis.Redis.from_url(f"{REDIS_HOST}/0").ping())
    if kind == "postgres":
        require("PostgreSQL", _ping_postgres)
        url = fresh_schema(request.getfixturevalue("pg_url"))
    else:
        url = f"sqlite:///{tmp_path / 'wm.db'}"
    flush_redis(CLI_BROKER_DB, CLI_STATE_DB)
    result = make_settings(
        url,
        broker_url=f"{REDIS_HOST}/{CLI_BROKER_DB}",
        redis_url=f"{REDIS_HOST}/{CLI_STATE_DB}",
        log_level="WARNING",
    )
    store.upgrade(result)
    yield result
    store.dispose_engines()
    flush_redis(CLI_BROKER_DB, CLI_STATE_DB)


@dataclass(frozen=True)
class Letters:
    """Dead letters of a live worker ``flaky`` and of a deleted worker ``gone``."""

    flaky: str
    gone: str
    timeouts: list[str]
    crash: str
    malformed: str
    orphan: str


def park(settings: Settings, worker_id: str, error_type: str, message: str, n: int) -> str:
    """Dead-letter one event the way the delivery task does."""
    event = make_event("orders", "/test", {"n": n})
    failure = Failure(
        topic="orders",
        worker_id=worker_id,
        envelope=encode(event),
        key=key_of(event),
        event_id=event.get_id(),
        error_type=error_type,
        error_message=message,
        attempts=3,
        version=1,
    )
    return DeadLetters(settings).park(failure)


def make_letters(settings: Settings, timeouts: int = 1) -> Letters:
    manager = WorkManager(settings)
    code = stub(output_type="done")
    flaky = str(manager.create_worker(code=code, mime_type=STUB, topic="orders", name="flaky").id)
    gone = str(manager.create_worker(code=code, mime_type=STUB, topic="orders", name="gone").id)
    parked = [park(settings, flaky, "WorkerTimeout", "timed out", n) for n in range(timeouts)]
    crash = park(settings, flaky, "WorkerExecutionError", LONG_ERROR, timeouts)
    malformed = DeadLetters(settings).park(
        Failure("orders", flaky, "not json {", None, None, "MalformedMessage", "no event", 1)
    )
    orphan = park(settings, gone, "WorkerTimeout", "timed out", timeouts + 1)
    manager.delete_worker(gone)
    store.dispose_engines()
    return Letters(flaky, gone, parked, crash, malformed, orphan)


def zoned(text: str) -> bool:
    return datetime.fromisoformat(text).utcoffset() is not None


# -- JSON ---------------------------------------------------------------------------------------


def test_json_names_workers_and_gives_the_event_as_an_object(any_settings: Settings) -> None:
    letters = make_letters(any_settings)
    env = env_of(any_settings)

    listed = {d["id"]: d for d in wm_json(env, "dlq", "list")}
    assert set(listed) == {*letters.timeouts, letters.crash, letters.malformed, letters.orphan}
    assert listed[letters.crash]["worker_name"] == "flaky"
    assert listed[letters.orphan]["worker_name"] == "gone"  # its worker was deleted
    one = listed[letters.crash]
    assert "envelope" not in one and one["error_message"] == LONG_ERROR
    assert zoned(one["first_failure_at"]) and zoned(one["last_failure_at"])

    shown = wm_json(env, "dlq", "show", letters.crash[:8])  # a short id
    assert shown["envelope"]["data"] == {"n": 1} and shown["envelope"]["source"] == "/test"
    assert shown["worker_name"] == "flaky" and shown["id"] == letters.crash
    assert wm_json(env, "dlq", "show", letters.malformed)["envelope"] == "not json {"

    # A deleted worker's letters stay reachable by its name and by its short id.
    by_name = wm_json(env, "dlq", "list", "--worker", "gone")
    assert [d["id"] for d in by_name] == [letters.orphan]
    assert wm_json(env, "dlq", "list", "--worker", letters.gone[:8]) == by_name

    purged = wm_json(env, "dlq", "purge", letters.orphan[:10], letters.malformed)
    assert purged["purged"] == 2
    assert len(wm_json(env, "dlq", "list")) == len(listed) - 2


def test_show_prints_the_fields_then_the_event_pretty(settings: Settings) -> None:
    letters = make_letters(settings)
    out = wm(env_of(settings), "dlq", "show", letters.crash).out
    fields, _, event = out.partition("\nevent:\n")
    assert re.search(r"^worker: +flaky \(" + letters.flaky + r"\)", fields, re.M), fields
    assert json.loads(event)["data"] == {"n": 1}
    assert '\n  "data": {\n    "n": 1\n  }' in event  # indented, one key a line


# -- tables -------------------------------------------------------------------------------------


@pytest.mark.parametrize("columns", [60, 120])
def test_the_table_fits_the_terminal_names_workers_and_wraps_errors(
    settings: Settings, columns: int
) -> None:
    letters = make_letters(settings)
    lines = in_terminal(env_of(settings), "dlq", "list", columns=columns)
    assert max(len(line) for line in lines) <= columns, "\n".join(lines)
    screen = "\n".join(lines)
    assert "flaky (" in screen and "gone (" in screen  # names beside the (short) ids
    assert letters.crash[:12] in screen
    words = LONG_ERROR.split()
    assert all(word in screen for word in words), screen  # wrapped whole, never cut
    first = next(line for line in lines if words[0] in line)
    assert words[-1] not in first  # on several lines


def test_a_pipe_gets_whole_rows_whatever_columns_says(settings: Settings) -> None:
    """Issue 29, point 11: a shell or CI that exports COLUMNS=120 had the error text of a
    piped table folded over lines (``grep`` found half of it) and narrow columns cut."""
    letters = make_letters(settings)
    out = wm(env_of(settings, COLUMNS="120"), "dlq", "list").out
    [row] = [line for line in out.splitlines() if line.startswith(letters.crash)]
    assert row.endswith(LONG_ERROR)  # the whole error on its row, every column whole
    assert all(h in out.splitlines()[0] for h in ("TOPIC", "ERROR TYPE", "REPLAYS"))
    assert "…" not in out


# -- replay -------------------------------------------------------------------------------------


def test_replay_shows_progress_in_a_terminal_and_a_summary(settings: Settings) -> None:
    letters = make_letters(settings, timeouts=REPLAYED)
    env = env_of(settings)
    lines = in_terminal(
        env, "dlq", "replay", "--error-type", "WorkerTimeout", "--worker", "flaky",
        "--rate", REPLAY_RATE, columns=100,
    )  # fmt: skip
    screen = "\n".join(lines)
    drawn = {int(n) for n in re.findall(rf"(\d+)/{REPLAYED}\b", screen)}
    assert REPLAYED in drawn and drawn - {0, REPLAYED}, screen  # drawn part-way, then done
    summary = re.search(
        rf"replayed {REPLAYED} of {REPLAYED} dead letter\(s\) in ([\d.]+) s", screen
    )
    assert summary and float(summary[1]) >= (REPLAYED - 1) / float(REPLAY_RATE), screen

    waiting = {d["id"] for d in wm_json(env, "dlq", "list")}
    assert waiting == {letters.crash, letters.malformed, letters.orphan}
    counts = {d["id"]: d["replay_count"] for d in wm_json(env, "dlq", "list", "--all")}
    assert all(counts[letter] == 1 for letter in letters.timeouts)


def test_replay_without_a_terminal_prints_only_the_summary(settings: Settings) -> None:
    letters = make_letters(settings, timeouts=3)
    env = env_of(settings)
    done = wm(env, "dlq", "replay", *letters.timeouts[:2], "--rate", "100")
    assert done.err == ""  # no progress bar through a pipe
    assert re.fullmatch(r"replayed 2 of 2 dead letter\(s\) in [\d.]+ s\n", done.out)

    replayed = wm_json(env, "dlq", "replay", "--worker", letters.flaky, "--error-type",
                       "WorkerTimeout", "--rate", "100")  # fmt: skip
    assert replayed["replayed"] == replayed["selected"] == 1
    assert replayed["ids"] == [letters.timeouts[2]] and replayed["elapsed_s"] >= 0

    # A deleted worker's letter cannot be replayed: one error line saying why and how far.
    failed = wm(env, "dlq", "replay", letters.orphan, expect=1)
    assert failed.err.startswith("wm: error: ") and "purge it instead" in failed.err
    assert "0 of 1 replayed before" in failed.err and len(failed.err.splitlines()) == 1


# -- purge --------------------------------------------------------------------------------------


def test_purge_by_filter_without_yes_only_counts(settings: Settings) -> None:
    letters = make_letters(settings, timeouts=2)
    env = env_of(settings)
    wm(env, "dlq", "replay", letters.timeouts[0], "--rate", "100")  # replayed ones count too
    before = wm_json(env, "dlq", "list", "--all")

    refused = wm(env, "dlq", "purge", "--error-type", "WorkerTimeout", expect=1)
    assert refused.out == ""
    [line] = refused.err.splitlines()
    assert line.startswith("wm: error: would purge 3 dead letter(s) matching --error-type")
    assert "nothing deleted" in line and "--yes" in line
    assert wm_json(env, "dlq", "list", "--all") == before

    done = wm(env, "dlq", "purge", "--error-type", "WorkerTimeout", "--yes")
    assert re.fullmatch(r"purged 3 dead letter\(s\) in [\d.]+ s\n", done.out)
    assert done.err == ""
    left = {d["id"] for d in wm_json(env, "dlq", "list", "--all")}
    assert left == {letters.crash, letters.malformed}

    # By id each must exist: a typo deletes nothing.
    wm(env, "dlq", "purge", letters.crash, "f" * 32, expect=1)
    assert wm_json(env, "dlq", "purge", letters.crash[:6], "--yes")["purged"] == 1


def test_a_large_purge_shows_progress_in_a_terminal(settings: Settings) -> None:
    bulk = 1234
    now = datetime.now(UTC)
    with store.session_scope(settings) as session:
        session.add_all(
            DeadLetter(
                id=uuid.UUID(int=n).hex, topic="bulk", worker_id=None, envelope="{}",
                error_type="WorkerTimeout", error_message="timed out", attempts=1,
                first_failure_at=now, last_failure_at=now, replay_count=0,
            )
            for n in range(bulk)
        )  # fmt: skip
    store.dispose_engines()
    env = env_of(settings)
    screen = "\n".join(in_terminal(env, "dlq", "purge", "--topic", "bulk", "--yes", columns=100))
    assert "purging" in screen and f"{bulk}/{bulk}" in screen, screen
    assert re.search(rf"^purged {bulk} dead letter\(s\) in [\d.]+ s$", screen, re.M), screen
    assert wm_json(env, "dlq", "list", "--all") == []
