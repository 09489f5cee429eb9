"""One exception tree: every error of WorkManager derives from the root and sits under exactly
one group, no name is a library's, and the admin API, the CLI and the docs (the errors table
of docs/guides/python-api.md) map every group; a database URL that names nothing usable is one
line, not a library's traceback."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import amqp.exceptions
import celery.exceptions
import kombu.exceptions
import pytest
import redis.exceptions
import sqlalchemy.exc

from tests.cli_env import one_error_line, wm
from wm import errors
from wm.errors import GROUPS, EngineError, WorkManagerError

ROOT = Path(__file__).resolve().parent.parent
#: Not groups and not errors of their own: the root, and EngineError, which gathers what an
#: engine raises across two groups (EngineLoadError is Refused, WorkerExecutionError is
#: DeliveryFailed).
BASES = (WorkManagerError, EngineError)
#: Libraries whose exception names ours must not take: a reader seeing ``IntegrityError``
#: should never have to ask whose it is.
FOREIGN = (sqlalchemy.exc, redis.exceptions, kombu.exceptions, celery.exceptions, builtins)
#: py-amqp's ``NotFound`` (AMQP reply 404, a channel error WorkManager only catches as
#: ``ChannelError``) is the one name shared, and kept: the group is what the issue names.
AMQP_SHARED = {"NotFound"}


def _classes_in_errors() -> list[type[BaseException]]:
    return [
        value
        for value in vars(errors).values()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
    ]


def _subclasses_elsewhere() -> Iterator[tuple[str, str]]:
    """(module, class) of every class in ``wm`` and ``engines`` whose base is an error of the
    tree, found in the source (importing every module would start apps and engines)."""
    known = {cls.__name__ for cls in _classes_in_errors()}
    found: dict[tuple[str, str], set[str]] = {}
    for path in [*ROOT.joinpath("wm").rglob("*.py"), *ROOT.joinpath("engines").rglob("*.py")]:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module == errors.__name__:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                found[(module, node.name)] = bases
    grew = True
    while grew:
        new = {name for (_, name), bases in found.items() if bases & known} - known
        known |= new
        grew = bool(new)
    yield from sorted(key for key, bases in found.items() if bases & known)


def _concrete() -> list[type[WorkManagerError]]:
    ours = [c for c in _classes_in_errors() if c not in GROUPS and c not in BASES]
    for module, name in _subclasses_elsewhere():
        ours.append(getattr(importlib.import_module(module), name))
    return ours


def test_every_error_derives_from_the_root_and_says_when_it_is_raised() -> None:
    for cls in _classes_in_errors():
        assert issubclass(cls, WorkManagerError), cls
        assert (cls.__doc__ or "").startswith("Raised"), f"{cls.__name__}: 'Raised when…'"


def test_every_concrete_error_is_under_exactly_one_group() -> None:
    concrete = _concrete()
    assert len(concrete) > len(_classes_in_errors()) - len(GROUPS) - len(BASES)  # others found
    for cls in concrete:
        groups = [g.__name__ for g in GROUPS if issubclass(cls, g)]
        assert len(groups) == 1, f"{cls.__module__}.{cls.__name__} is under {groups or 'none'}"
        assert (cls.__doc__ or "").startswith("Raised"), f"{cls.__name__}: 'Raised when…'"
    for group in GROUPS:
        assert group.__bases__ == (WorkManagerError,), group


def test_no_error_takes_a_library_s_name() -> None:
    ours = {cls.__name__ for cls in _classes_in_errors()}
    for module in FOREIGN:
        theirs = {n for n, v in vars(module).items() if inspect.isclass(v)}
        assert not ours & theirs, f"{module.__name__}: {sorted(ours & theirs)}"
    amqp_names = {n for n, v in vars(amqp.exceptions).items() if inspect.isclass(v)}
    assert ours & amqp_names == AMQP_SHARED


def test_the_api_and_the_cli_map_every_group() -> None:
    from wm.cli import EXIT_CODES
    from wm.ops.api import ERROR_STATUS

    assert list(ERROR_STATUS) == list(GROUPS)
    assert list(EXIT_CODES) == list(GROUPS)


def test_the_docs_list_every_group_with_its_errors_and_codes() -> None:
    from wm.cli import EXIT_CODES
    from wm.ops.api import ERROR_STATUS

    readme = ROOT.joinpath("docs", "guides", "python-api.md").read_text()  # its Errors table
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \| (\d+) \| (\d+) \|$", readme, re.M)
    documented = {g: (set(re.findall(r"`(\w+)`", errs)), int(s), int(x)) for g, errs, s, x in rows}
    concrete = [c for c in _classes_in_errors() if c not in GROUPS and c not in BASES]
    assert documented == {
        group.__name__: (
            {c.__name__ for c in concrete if issubclass(c, group)},
            ERROR_STATUS[group],
            EXIT_CODES[group],
        )
        for group in GROUPS
    }


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://nobody@127.0.0.1:1/none", "needs the driver module 'MySQLdb'"),
        ("nosuchdialect://x", "names no database WorkManager can use"),
        ("sqlite:////proc/none/wm.db", "the SQLite file's directory cannot be made"),
    ],
)
def test_a_database_url_nothing_can_open_is_one_line(
    unmigrated_env: dict[str, str], url: str, says: str
) -> None:
    for command in (["worker", "list"], ["db", "upgrade"]):
        failed = wm({**unmigrated_env, "WM_DATABASE_URL": url}, *command, expect=1)
        line = one_error_line(failed)
        assert line.startswith("wm: error: WM_DATABASE_URL=") and says in line, line


def test_a_database_of_a_newer_workmanager_is_one_line(env: dict[str, str]) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(env["WM_DATABASE_URL"])
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'from-the-future'"))
    engine.dispose()
    line = one_error_line(wm(env, "db", "upgrade", expect=1))
    assert "cannot be migrated to head" in line and "'from-the-future'" in line, line
