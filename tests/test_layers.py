"""The folders are the architecture (docs/architecture.md, DESIGN.md §2): every import of
``wm`` and ``engines`` goes to the same floor or a lower one, no modules import each other in a
loop (lazy imports inside functions included), and the core never imports an engine."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Floor of each module, by longest matching prefix; a module imports only from floors <= its own.
FLOORS = {
    "wm.errors": 0,
    "wm.text": 0,
    "wm.extras": 0,
    "wm.config": 1,
    "wm.events": 1,
    "wm.lifecycle": 1,
    "wm.views": 1,
    "wm.workersettings": 1,
    "wm.tenantlimits": 1,
    "wm.idempotency": 1,
    "wm.names": 1,
    "wm.schedules": 1,
    "wm.sentinelurl": 1,
    "wm.engine": 2,
    "wm.urlguard": 2,
    "wm.codesource": 2,
    "wm.devkit": 2,
    "wm.store": 3,
    "wm.state": 4,
    "wm.dataplane": 5,
    "wm.control": 6,
    "wm.manager": 7,
    "wm.ops": 7,  # health: loaded by name (wm.celeryapp registers it, wm health loads it)
    "wm.celeryapp": 8,
    "celeryconfig": 6,
    "wm.cli": 8,
    "wm.local": 8,
    "wm.bench": 8,
    "wm": 8,  # the package itself: the public API, re-exported lazily
    "engines": 9,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*ROOT.glob("wm/**/*.py"), *ROOT.glob("engines/**/*.py"), ROOT / "celeryconfig.py"]
    return {_module_name(p): p for p in files}


def _imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """Project modules ``name`` imports anywhere in its file (lazy and TYPE_CHECKING too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            # ``from wm import store`` imports the module wm.store; ``from wm.x import f`` wm.x.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def _floor(module: str) -> int:
    prefix = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[prefix]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    sources = _sources()
    return {name: set(_imports(name, path, set(sources))) for name, path in sources.items()}


def test_every_module_has_a_floor(graph: dict[str, set[str]]) -> None:
    for module in graph:
        _floor(module)  # raises ValueError for a module outside every floor


def test_no_import_runs_up_a_floor(graph: dict[str, set[str]]) -> None:
    upward = sorted(
        f"{src} (floor {_floor(src)}) imports {dst} (floor {_floor(dst)})"
        for src, targets in graph.items()
        for dst in targets
        if _floor(dst) > _floor(src)
    )
    assert upward == []


def test_the_core_never_imports_an_engine(graph: dict[str, set[str]]) -> None:
    core = {
        src: {t for t in targets if t.split(".")[0] == "engines"} for src, targets in graph.items()
    }
    assert {src: t for src, t in core.items() if t and not src.startswith("engines")} == {}


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    assert _cycles(graph) == []


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules that can reach themselves through imports, each with the loop's members."""
    looped = [start for start in sorted(graph) if start in _reach(graph, start)]
    return [
        f"{start}: {', '.join(sorted(n for n in looped if start in _reach(graph, n)))}"
        for start in looped
    ]


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def test_the_checker_sees_a_circle_and_an_upward_import() -> None:
    """The checks above can fail: a loop and an upward arrow are found when present."""
    loop = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(loop) == ["a: a, b, c", "b: a, b, c", "c: a, b, c"]
    assert _floor("wm.state.locks") > _floor("wm.store.models")
    assert _floor("wm.dataplane.tasks") < _floor("wm.control.overview") < _floor("wm.manager")


FEATURES_PACKAGE = "wm.dataplane.features"


def test_features_never_import_each_other(graph: dict[str, set[str]]) -> None:
    """A feature is one module: it reaches another only through the pipeline's hooks."""
    tied = sorted(
        f"{src} imports {dst}"
        for src, targets in graph.items()
        if src.startswith(FEATURES_PACKAGE + ".")
        for dst in targets
        if dst.startswith(FEATURES_PACKAGE + ".")
    )
    assert tied == []


def test_the_core_never_imports_a_feature_by_name(graph: dict[str, set[str]]) -> None:
    """Outside their package only the ordered list (``wm.dataplane.features``) is imported."""
    named = sorted(
        f"{src} imports {dst}"
        for src, targets in graph.items()
        if not src.startswith(FEATURES_PACKAGE)
        for dst in targets
        if dst.startswith(FEATURES_PACKAGE + ".")
    )
    assert named == []
