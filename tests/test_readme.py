"""The README stays true to the code: every setting is documented, the commands exist."""

from __future__ import annotations

import re
from pathlib import Path

from wm.cli import build_parser
from wm.config import settings_table
from wm.lifecycle import TRANSITIONS, Status

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table() -> None:
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", README, flags=re.MULTILINE))
    assert documented == {name for name, _, _ in settings_table()}


def test_quick_start_and_test_command() -> None:
    assert "pip install -e '.[embedded]' && wm up --demo" in README
    assert "\nbash .ci/run\n" in README
    test_command = "python -m pytest -q"
    assert f"`{test_command}`" in README
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert ci.rstrip().endswith(test_command)


def test_documented_commands_exist() -> None:
    parser = build_parser()
    for command in re.findall(r"^\| `wm ([a-z]+(?: [a-z][a-z-]*)?)", README, flags=re.MULTILINE):
        words = command.split()
        args = (
            [*words, "--help"]
            if words[0] not in ("worker", "dlq", "db")
            else [*words[:2], "--help"]
        )
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            assert exc.code == 0, command


def test_the_state_diagram_is_the_transition_table() -> None:
    block = README.split("```mermaid\nstateDiagram-v2\n", 1)[1].split("```", 1)[0]
    drawn = set(re.findall(r"^    (\w+) --> (\w+)$", block, flags=re.MULTILINE))
    table = {
        (str(source), str(target))
        for source, targets in TRANSITIONS.items()
        for target in targets
        if target != Status.DELETED
    }
    assert drawn == table
    assert all(Status.DELETED in TRANSITIONS[s] for s in Status if s != Status.DELETED)
