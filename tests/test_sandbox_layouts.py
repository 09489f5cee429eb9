"""The Python sandbox wherever Python is installed, and its errors when it cannot start.

Where the standard library, ``lib-dynload`` and the sandbox's dependencies live is fixed when
an interpreter starts, so each layout is a real environment made by the test (``venv``,
``venv --system-site-packages``, ``pip install --user``, Debian's ``/usr/bin/python3``, ``uv
venv``, and the interpreter running this suite) and the engine runs there, in a subprocess of
that interpreter. There it must run a worker, refuse the usual escapes, and read nothing but
the standard library and the packages it names: never a prefix or a whole site directory.

Installs are real ``pip install`` runs, offline from a wheelhouse: wheels of the project's
dependencies at the versions this test run uses, built once per interpreter version with that
interpreter's pip (markers differ: Python before 3.11.3 also needs ``async-timeout``) and kept
in pytest's cache directory, so only the first run on a machine reaches the package index.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import wm  # noqa: F401 - import the platform before engines
from engines.python import PythonEngine, isolation
from engines.python.process import SandboxProcess, interpreter_argv
from tests.conftest import ROOT, need
from wm.config import Settings
from wm.engine import WorkerSpec
from wm.errors import WorkerExecutionError

#: Seconds a venv creation, an offline install or a probe run may take.
STEP_TIMEOUT_S = 180
#: Seconds building a wheelhouse may take (it downloads from the package index).
WHEELHOUSE_TIMEOUT_S = 600
#: Distributions never pinned: the build tools a fresh venv brings its own versions of.
UNPINNED = frozenset({"pip", "setuptools", "wheel", "workmanager"})
#: What a refused attempt's error says (the audit hook, the import guard, builtin creation).
REFUSED = re.compile(r"not allowed|cannot be created")

#: Run by each layout's interpreter: the engine on a small worker and on escape attempts.
PROBE = '''
import importlib.util
import json
import site
import sys

import wm  # noqa: F401 - the platform before the engine
from engines.python import PythonEngine, isolation
from wm.engine import WorkerSpec
from wm.config import Settings
from wm.errors import WorkManagerError
from wm.events import make_event

WALK = """
def _find(name):
    for cls in ().__class__.__base__.__subclasses__():
        if cls.__name__ == name:
            return cls
    raise LookupError(name)
_import = _find('_wrap_close').__init__.__globals__['__builtins__']['__import__']
"""
ECHO = """
import decimal
from wm.devkit import make_event

def process(event):
    total = str(decimal.Decimal("0.1") * 3)
    return make_event("probe.out", "/probe", {"got": event.get_data(), "total": total})
"""


def body(line):
    return WALK + "def process(event):\\n    " + line + "\\n"


def attempts():
    unlisted = importlib.util.find_spec("celery").origin
    return {
        "echo": ECHO,
        "read_etc_passwd": body("open('/etc/passwd').read()"),
        "read_interpreter": body(f"open({sys.executable!r}, 'rb').read(4)"),
        "read_unlisted_package": body(f"open({unlisted!r}).read()"),
        "import_socket": "import socket\\n" + body("pass"),
        "import_subprocess": "import subprocess\\n" + body("pass"),
        "walk_socket": body("_import('socket').socket()"),
        "walk_subprocess": body("_import('subprocess').Popen(['true'])"),
    }


def attempt(engine, name, source):
    worker = WorkerSpec(worker_id="layout-" + name, topic="layouts")
    try:
        engine.load(source.encode(), worker)
        outputs = engine.process(make_event("probe", "/layouts", {"n": 1}), timeout_s=10)
    except WorkManagerError as exc:
        return {"error": type(exc).__name__ + ": " + str(exc)}
    return {"outputs": [output.get_data() for output in outputs]}


def main():
    settings = Settings()
    paths = isolation.sandbox_paths(tuple(settings.python_allowed_packages))
    engine = PythonEngine(settings)
    try:
        results = {name: attempt(engine, name, code) for name, code in attempts().items()}
    finally:
        engine.close()
    report = {
        "executable": sys.executable,
        "prefixes": sorted({sys.prefix, sys.base_prefix, sys.exec_prefix}),
        "site_dirs": [*site.getsitepackages(), site.getusersitepackages()],
        "sys_path": list(paths.sys_path),
        "read_roots": list(paths.read_roots),
        "native_roots": list(paths.native_roots),
        "results": results,
    }
    print(json.dumps(report))


main()
'''


@dataclass(frozen=True)
class Layout:
    """An interpreter to run the probe with, and the environment it needs."""

    python: str
    env: dict[str, str]


# --- environments, shared with tests/test_quickstart.py ----------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would steer pip, Python or WorkManager."""
    steering = ("PIP_", "PYTHON", "WM_", "VIRTUAL_ENV", "UV_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(steering)}
    env.update(extra)
    return env


def run(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> str:
    """Run a setup step; its output, or a test failure that shows it."""
    timeout_s = STEP_TIMEOUT_S
    try:
        done = subprocess.run(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{argv} did not finish within {timeout_s}s: {exc.stdout!r} {exc.stderr!r}")
    if done.returncode != 0:
        pytest.fail(f"{argv} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


#: What a copy of the work tree leaves out: environments, caches, state, build output.
NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", ".wm", "*.egg-info", "__pycache__", ".*_cache", "build", "dist", "site"
)


def copy_work_tree(into: Path) -> Path:
    """The work tree as a fresh clone has it, uncommitted changes included."""
    shutil.copytree(ROOT, into, ignore=NOT_COPIED)
    return into


def base_python() -> str:
    """The interpreter this suite runs on, outside the venv it may run in."""
    return str(getattr(sys, "_base_executable", "") or sys.executable)


def wheelhouse_root(config: pytest.Config, factory: pytest.TempPathFactory) -> Path:
    """pytest's cache directory (kept across runs), or a fresh one if caching is off."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return factory.mktemp("wheelhouses")
    return Path(cache.mkdir("wm-wheelhouses"))


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extras = project["project"]["optional-dependencies"]
    build = project["build-system"]["requires"]
    return [*project["project"]["dependencies"], *extras["embedded"], *build]


def _pins() -> str:
    """``name==version`` of every distribution this test run uses (the first one visible)."""
    pins: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name and name not in UNPINNED and name not in pins:
            pins[name] = dist.version
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def wheelhouse(root: Path, python: str | Path) -> Path:
    """Wheels of everything ``pip install -e <repo>[embedded]`` needs under ``python``."""
    version = "import sys, sysconfig; print(sys.version, sysconfig.get_platform())"
    tag = run([str(python), "-c", version], clean_env())
    requirements, pins = _requirements(), _pins()
    key = hashlib.sha256("\n".join([tag, *requirements, pins]).encode()).hexdigest()[:16]
    final = root / key
    if not final.is_dir():
        # a directory of this process's own: another xdist worker may build the same one
        partial = root / f"{key}.{os.getpid()}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        _build_wheels(python, partial, requirements, pins)
        try:
            partial.rename(final)
        except OSError:  # the other finished first: its wheels are the same
            if not final.is_dir():
                raise
            shutil.rmtree(partial, ignore_errors=True)
    return final


def _build_wheels(python: str | Path, into: Path, requirements: list[str], pins: str) -> None:
    constraints = into / "constraints.txt"
    constraints.write_text(pins, encoding="utf-8")
    argv = [str(python), "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check"]
    argv += ["--wheel-dir", str(into), "-c", str(constraints), *requirements]
    # This machine's pip settings stay: they are how it reaches the package index.
    env = clean_env() | {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    try:
        subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=WHEELHOUSE_TIMEOUT_S, check=True
        )
    except subprocess.CalledProcessError as exc:
        need("the package index (for the test wheelhouse)", RuntimeError(exc.stderr))
    except subprocess.TimeoutExpired as exc:
        need("the package index (for the test wheelhouse)", exc)


def offline_install(python: str | Path, links: Path, *args: str, env: dict[str, str]) -> None:
    """``pip install`` from the wheelhouse only, whatever pip configuration this machine has."""
    argv = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    argv += ["--no-index", "--find-links", str(links), *args]
    run(argv, env | {"PIP_CONFIG_FILE": os.devnull})


# --- layouts -------------------------------------------------------------------------------


def _venv(tmp_path: Path, root: Path, python: str, *options: str, source: str = "") -> Layout:
    """A venv made by ``python``, with the project installed editable (or from ``source``)."""
    venv = tmp_path / "venv"
    run([python, "-m", "venv", *options, str(venv)], clean_env())
    inside = venv / "bin" / "python"
    project = [source] if source else ["-e", str(ROOT)]
    offline_install(inside, wheelhouse(root, inside), *project, env=clean_env())
    return Layout(str(inside), clean_env())


def plain_venv(tmp_path: Path, root: Path) -> Layout:
    return _venv(tmp_path, root, base_python())


def installed_venv(tmp_path: Path, root: Path) -> Layout:
    """A regular (not editable) install, as the Dockerfile makes: the code in site-packages."""
    source = copy_work_tree(tmp_path / "source")
    return _venv(tmp_path, root, base_python(), source=str(source))


def system_site_venv(tmp_path: Path, root: Path) -> Layout:
    """Whatever the base interpreter already has is used from its own site-packages."""
    return _venv(tmp_path, root, base_python(), "--system-site-packages")


def system_python_venv(tmp_path: Path, root: Path) -> Layout:
    """The OS's interpreter; Debian's keeps the standard library in /usr/lib/python3.X and
    packages in dist-packages."""
    python = "/usr/bin/python3"
    if not os.path.exists(python) or os.path.realpath(python) == os.path.realpath(base_python()):
        pytest.skip("no /usr/bin/python3 besides the interpreter running the tests")
    if not _imports(python, "ensurepip", "venv"):
        pytest.skip("/usr/bin/python3 cannot make venvs (apt-get install python3-venv)")
    return _venv(tmp_path, root, python, "--system-site-packages")


def _imports(python: str, *modules: str) -> bool:
    argv = [python, "-c", "import " + ", ".join(modules)]
    done = subprocess.run(argv, capture_output=True, timeout=STEP_TIMEOUT_S, check=False)
    return done.returncode == 0


def user_site(tmp_path: Path, root: Path) -> Layout:
    """``pip install --user``: the base interpreter, everything in a user site directory."""
    env = clean_env(PYTHONUSERBASE=str(tmp_path / "userbase"))
    python = base_python()
    if not _imports(python, "pip"):
        pytest.skip(f"{python} has no pip")
    marker = Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED"
    forced = ["--break-system-packages"] if marker.exists() else []
    links = wheelhouse(root, python)
    offline_install(
        python, links, "--user", "--ignore-installed", *forced, "-e", str(ROOT), env=env
    )
    return Layout(python, env)


def uv_venv(tmp_path: Path, root: Path) -> Layout:
    """A uv venv: no pip inside, ``bin/python`` a symlink to the base interpreter."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    venv = tmp_path / "venv"
    env = clean_env()
    run([uv, "venv", "--quiet", "--python", base_python(), str(venv)], env)
    inside = venv / "bin" / "python"
    links = wheelhouse(root, base_python())
    argv = [uv, "pip", "install", "--quiet", "--python", str(inside), "--no-index"]
    run([*argv, "--find-links", str(links), "-e", str(ROOT)], env)
    return Layout(str(inside), env)


def this_interpreter(tmp_path: Path, root: Path) -> Layout:
    """The interpreter running this suite, as it is: in a venv or not, as it was started."""
    return Layout(sys.executable, {k: v for k, v in os.environ.items() if not k.startswith("WM_")})


LAYOUTS: dict[str, Callable[[Path, Path], Layout]] = {
    "venv": plain_venv,
    "venv-not-editable": installed_venv,
    "venv-system-site-packages": system_site_venv,
    "pip-install-user": user_site,
    "usr-bin-python3-venv": system_python_venv,
    "uv-venv": uv_venv,
    "this-interpreter": this_interpreter,
}


@pytest.fixture(scope="session")
def wheelhouses(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wheelhouse_root(request.config, tmp_path_factory)


def probe(layout: Layout, tmp_path: Path) -> dict[str, Any]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE, encoding="utf-8")
    out = run([layout.python, str(script)], layout.env, cwd=tmp_path)
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


def _contains(root: str, path: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def assert_nothing_wide_is_readable(report: dict[str, Any]) -> None:
    """No read root is, or holds, a prefix or a site directory (of those that exist)."""
    listed = [*report["prefixes"], *report["site_dirs"]]
    wide = [os.path.normpath(p) for p in listed if os.path.isdir(p)]
    for root in report["read_roots"]:
        assert not [p for p in wide if _contains(root, p)], f"{root} is readable: {report}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sandbox_works_and_stays_closed(name: str, tmp_path: Path, wheelhouses: Path) -> None:
    report = probe(LAYOUTS[name](tmp_path, wheelhouses), tmp_path)
    results: dict[str, dict[str, Any]] = report["results"]

    assert results.pop("echo") == {"outputs": [{"got": {"n": 1}, "total": "0.3"}]}, report
    for attempt, result in results.items():
        assert REFUSED.search(str(result.get("error"))), (attempt, result)
    assert_nothing_wide_is_readable(report)


# --- when the sandbox cannot start -----------------------------------------------------------


@pytest.fixture
def fresh_paths() -> Iterator[None]:
    """``sandbox_paths`` is cached per process: recompute it for this test and after it."""
    isolation.sandbox_paths.cache_clear()
    yield
    isolation.sandbox_paths.cache_clear()


def load_echo() -> None:
    engine = PythonEngine(Settings())
    try:
        engine.load(b"def process(event):\n    return None\n", WorkerSpec("w-layouts", "layouts"))
    finally:
        engine.close()


def test_a_missing_dependency_is_named_before_any_child_starts(
    monkeypatch: pytest.MonkeyPatch, fresh_paths: None
) -> None:
    wanted = (*isolation.SANDBOX_DEPENDENCIES, "wm_absent_dependency")
    monkeypatch.setattr(isolation, "SANDBOX_DEPENDENCIES", wanted)

    with pytest.raises(WorkerExecutionError) as caught:
        load_echo()

    assert "'wm_absent_dependency'" in str(caught.value)
    assert f"searched sys.path {sys.path}" in str(caught.value)


def test_a_missing_standard_library_module_is_named_with_where_it_was_looked_for(
    monkeypatch: pytest.MonkeyPatch, fresh_paths: None
) -> None:
    wanted = (*isolation.REQUIRED_STDLIB, "wm_absent_stdlib_module")
    monkeypatch.setattr(isolation, "REQUIRED_STDLIB", wanted)

    with pytest.raises(WorkerExecutionError) as caught:
        load_echo()

    assert "'wm_absent_stdlib_module'" in str(caught.value)
    assert os.path.dirname(os.__file__) in str(caught.value)


def test_a_child_dying_on_a_missing_module_names_it_and_its_sys_path() -> None:
    """The original venv failure: a sys.path without lib-dynload, where ``resource`` lives."""
    resource = importlib.util.find_spec("resource")
    if resource is None or resource.origin in (None, "built-in"):
        pytest.skip("resource is built into this interpreter")
    paths = isolation.sandbox_paths(tuple(Settings().python_allowed_packages))
    without_dynload = [p for p in paths.sys_path if p != os.path.dirname(str(resource.origin))]
    argv = interpreter_argv(isolation.kernel_isolation().prefix, isolation.BOOTSTRAP)
    child = SandboxProcess(argv, "w-layouts", lambda request, remaining: {})
    init = {"sys_path": without_dynload, "packages": dict(paths.packages)}
    try:
        with pytest.raises(WorkerExecutionError) as caught:
            child.init(init, "", time.monotonic() + 30)
    finally:
        child.kill()

    message = str(caught.value)
    assert "while starting: module 'resource' was not found" in message
    assert str(without_dynload) in message
