"""The session of the docs' page on the ``wm`` command (docs/guides/cli.md), run as written:
each ``$ wm …`` line is a real command (``python -m wm.cli``, its arguments split like a
shell's, no shell) against SQLite, Redis and a real node, in the repository's root so
``examples/`` is found, and what it prints must be what the page shows.

Ids, times and durations differ from run to run, so the page's stand for any (a UUID, a
``2026-11-21 01:19:36Z``, a ``41 ms``); ``…`` ending a value means the value is cut there,
and ``…`` alone on a line means lines left out. Columns may be wider or narrower than shown.
The shout worker must really answer: the shouted event is read back from the inbox.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.conftest import BROKER_DB, ROOT, STATE_DB, env_of, flush_redis, make_settings
from tests.helpers import drain, eventually
from wm import Settings, WorkManager, store

PAGE = ROOT / "docs" / "guides" / "cli.md"
SECTION = "# The `wm` command"
INBOX_TOPIC, INBOX = "greetings.shouted", "greetings.shouted::sub::inbox"
#: Longest one command may take, in seconds: a guard against hangs, not a timing test.
GUARD_S = 60.0
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
#: What differs from run to run, as the page shows it -> what it stands for.
VARYING = {
    UUID: UUID,
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ": r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ",
    r"\b\d+ ms\b": r"(?:\d+ ms|\d+\.\d s|\d+ min)",
}
_VARYING = re.compile("|".join(f"({shown})" for shown in VARYING))
#: A line of the page that stands for any number of lines left out.
LEFT_OUT = "…"


class Step(NamedTuple):
    """One ``$ wm …`` line of the session and the lines the page shows it printing."""

    command: str
    shown: list[str]

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.command)
        assert words[0] == "wm", f"the session runs only wm commands: {self.command}"
        return [sys.executable, "-m", "wm.cli", *words[1:]]

    @property
    def fails(self) -> bool:
        return bool(self.shown) and self.shown[0].startswith("wm: error: ")


def session() -> list[Step]:
    """The first ``console`` block of the docs' page on the ``wm`` command, before its first
    subsection."""
    section = PAGE.read_text().split(f"{SECTION}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```console\n", 1)[1].split("\n```", 1)[0]
    steps: list[Step] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append(Step(line[2:], []))
        else:
            assert steps, f"output before the first command: {line!r}"
            steps[-1].shown.append(line.rstrip())
    return steps


def pattern(line: str) -> re.Pattern[str]:
    """The page's line as a pattern: its varying parts stand for any such value."""
    parts, at = [], 0
    for match in _VARYING.finditer(line):
        parts += [_literal(line[at : match.start()]), list(VARYING.values())[match.lastindex - 1]]
        at = match.end()
    parts.append(_literal(line[at:]))
    return re.compile("".join(parts))


def _literal(text: str) -> str:
    """Text as shown: spaces between columns are any spaces, ``…`` cuts a value."""
    return "".join(
        " +" if piece.startswith(" ") else re.escape(piece).replace(LEFT_OUT, r"\S*")
        for piece in re.split(r"( +)", text)
        if piece
    )


def assert_shows(shown: list[str], printed: list[str], command: str) -> None:
    """``printed`` is what the page's ``shown`` says, line for line (``…``: lines left out)."""
    why = f"`{command}` printed:\n" + "\n".join(printed) + "\nthe page shows:\n" + "\n".join(shown)
    at, skipping = 0, False
    for line in shown:
        if line == LEFT_OUT:
            skipping = True
            continue
        wanted = pattern(line)
        while skipping and at < len(printed) and not wanted.fullmatch(printed[at]):
            at += 1
        assert at < len(printed) and wanted.fullmatch(printed[at]), f"{line!r} differs; {why}"
        at, skipping = at + 1, False
    assert skipping or at == len(printed), f"more lines than the page shows; {why}"


def test_the_session_parses_into_commands_and_matches_its_own_text() -> None:
    """The reader of the other test's failures can trust the parsing and the placeholders."""
    steps = session()
    assert [s.command.split()[:3] for s in steps][:2] == [
        ["wm", "db", "upgrade"],
        ["wm", "worker", "create"],
    ]
    assert any("--file examples/shout.py" in s.command for s in steps)
    assert any("--file examples/quiet.py" in s.command for s in steps)
    for step in steps:
        printed = [line for line in step.shown if line != LEFT_OUT]
        assert_shows(step.shown, printed, step.command)
    assert pattern("worker 3f2a0c1e-0000-4000-8000-000000000000 (shout), 5 ms").fullmatch(
        "worker a2ce0df7-69e4-4130-85f0-a92544759ae2 (shout), 1.2 s"
    )
    assert not pattern("7599e846…").fullmatch("7599e847abc")


@pytest.fixture
def session_env(tmp_path: Path, redis_ok: None, start_node: Any) -> Iterator[dict[str, str]]:
    """A fresh SQLite database, clean Redis databases and a running node, as after ``wm up``;
    the environment that points ``wm`` at them (no ``COLUMNS``: tables as in a pipe). Logs
    are not output: only errors are logged (a host without bubblewrap warns of the Python
    sandbox's missing layers)."""
    flush_redis(BROKER_DB, STATE_DB)
    settings = make_settings(f"sqlite:///{tmp_path / 'wm.db'}")
    store.upgrade(settings)  # the node starts on a migrated database; `wm db upgrade` again
    store.dispose_engines()
    start_node(settings, "session")
    env = env_of(settings, WM_LOG_LEVEL="ERROR")
    env.pop("COLUMNS", None)
    yield env
    flush_redis(BROKER_DB, STATE_DB)


def test_the_readme_session_runs_as_written(session_env: dict[str, str]) -> None:
    settings = Settings.from_env(session_env)
    settle = _settlers(settings)
    for step in session():
        done = subprocess.run(
            step.argv, env=session_env, cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S
        )
        expected_code = 1 if step.fails else 0
        assert done.returncode == expected_code, f"{step.command}: {done.stdout}{done.stderr}"
        printed = done.stderr if step.fails else done.stdout
        assert_shows(step.shown, printed.rstrip("\n").splitlines(), step.command)
        if step.fails:
            assert done.stdout == ""
        settle.get(step.command.split()[1], lambda: None)()
    shouted = drain(settings, INBOX, 2, timeout_s=2)
    assert len(shouted) == 1, shouted
    event = shouted[0]
    assert (event["type"], event["source"], event["data"]) == (
        INBOX_TOPIC,
        "/examples/shout",
        {"text": "HELLO"},
    )
    assert event["correlationid"] == "c-42"


def _settlers(settings: Settings) -> dict[str, Callable[[], None]]:
    """What the session's reader waits for before the next command, by command: after a
    publish, the shout worker's answer in the inbox (the node runs it meanwhile)."""
    manager = WorkManager(settings)

    def answered() -> None:
        def depth() -> int:
            found = manager.list_subscriptions(INBOX_TOPIC)
            return sum(int(s["depth"]) for s in found if s["queue"] == INBOX)

        eventually(depth, timeout_s=GUARD_S)

    return {"publish": answered}
