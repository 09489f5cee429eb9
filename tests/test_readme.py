"""The README and the docs stay true to the code: every setting is documented, the commands
exist."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import doc
from wm.cli import reference
from wm.config import settings_table
from wm.lifecycle import TRANSITIONS, Status

README = doc("README.md")


def test_every_setting_is_in_the_configuration_table() -> None:
    table = doc("docs/reference/configuration.md")
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", table, flags=re.MULTILINE))
    assert documented == {name for name, _, _ in settings_table()}


def test_quick_start_and_test_command() -> None:
    assert "pip install -e '.[embedded]' && wm up --demo" in README
    assert "\nbash scripts/test\n" in README
    test_command = "python -m pytest -q -n 2"
    assert f"`{test_command}`" in README
    root = Path(__file__).resolve().parent.parent
    assert (root / "scripts" / "test").read_text().rstrip().endswith(test_command)
    ci = (root / ".ci" / "run").read_text()  # the machine's wrapper around the same command
    assert ci.rstrip().endswith("bash scripts/test")


def test_the_command_reference_is_the_real_help() -> None:
    """The command reference is what every command's ``--help`` prints; after a change to
    the command line, ``python -m wm.cli.reference docs/reference/cli.md`` renders it anew."""
    page = doc(reference.PAGE)
    assert reference.BEGIN in page
    assert reference.replace(page) == page


def test_the_state_diagram_is_the_transition_table() -> None:
    block = (
        doc("docs/guides/states.md").split("```mermaid\nstateDiagram-v2\n", 1)[1].split("```", 1)[0]
    )
    drawn = set(re.findall(r"^    (\w+) --> (\w+)$", block, flags=re.MULTILINE))
    table = {
        (str(source), str(target))
        for source, targets in TRANSITIONS.items()
        for target in targets
        if target != Status.DELETED
    }
    assert drawn == table
    assert all(Status.DELETED in TRANSITIONS[s] for s in Status if s != Status.DELETED)
