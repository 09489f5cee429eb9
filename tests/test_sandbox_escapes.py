"""Escape corpus: each attempt must be refused by the engine or killed, leaving the host healthy.

After every attempt: the canary file outside the sandbox is unchanged and nothing new appeared
next to it, no child process is left, and the host's secret environment variable appears in
no output or error. Attempts that reach a function object by walking the object graph must
still fail at the effect (the audit hook), which is what the messages assert.
"""

from __future__ import annotations

import dis
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import wm  # noqa: F401 - import the platform before engines (engines.base needs wm first)
from engines.childproc import frames
from engines.python import PythonEngine, sandbox
from engines.python.protocol import event_body
from tests.workers import child_pids, code
from wm.config import Settings
from wm.engine import WorkerSpec
from wm.errors import InvalidCode, WorkerExecutionError, WorkerTimeout
from wm.events import CloudEvent, make_event

SECRET = "wm-secret-canary-7f3a91"
CANARY_TEXT = "the host's own file\n"

#: Prelude of walk-based attempts: real os/sys/builtins reached without any import.
WALK = """
def _find(name):
    for cls in ().__class__.__base__.__subclasses__():
        if cls.__name__ == name:
            return cls
    raise LookupError(name)
_os = _find('_wrap_close').__init__.__globals__
_sys = _os['sys']
_real_builtins = _os['__builtins__']
_real_import = _real_builtins['__import__']
"""

REFUSED = r"not allowed|is not defined|cannot be created|KeyError: 'pidfd_open'"


@dataclass(frozen=True)
class Attempt:
    name: str
    body: str
    expect: str = "refused"  # refused | killed | contained
    match: str = REFUSED
    walk: bool = False

    def source(self, canary_dir: str) -> bytes:
        prelude = "from wm.devkit import make_event\n" + (WALK if self.walk else "")
        code = prelude + "CANARY_DIR = " + repr(canary_dir) + "\n" + self.body
        return code.encode("utf-8")


def fn(body: str) -> str:
    """A process(event) whose body is ``body`` (one statement per line)."""
    lines = "\n".join("    " + line for line in body.splitlines())
    return f"def process(event):\n{lines}\n"


ATTEMPTS = [
    Attempt("import_os", "import os\n" + fn("os.system('id')")),
    Attempt("dunder_import", fn("__import__('os').system('id')")),
    Attempt("importlib", "import importlib\n" + fn("importlib.import_module('os')")),
    Attempt("builtins_dict_import", fn("__builtins__['__import__']('os').system('id')")),
    Attempt(
        "walk_wrap_close_system", fn("_os['system']('touch ' + CANARY_DIR + '/pwned')"), walk=True
    ),
    Attempt("walk_popen", fn("_real_import('subprocess').Popen(['id'])"), walk=True),
    Attempt("walk_posix_spawn", fn("_os['posix_spawn']('/bin/sh', ['sh'], {})"), walk=True),
    Attempt(
        "walk_catch_warnings",
        fn("module = _find('catch_warnings')()._module\nmodule.sys.modules['os'].fork()"),
        walk=True,
    ),
    Attempt(
        "type_subclasses",
        fn(
            "[c for c in type.__subclasses__(object) if c.__name__ == '_wrap_close'][0]"
            ".__init__.__globals__['execv']('/bin/sh', ['sh'])"
        ),
    ),
    Attempt("open_etc_passwd_for_writing", fn("open('/etc/passwd', 'a')")),
    Attempt("write_canary", fn("open(CANARY_DIR + '/canary.txt', 'w').write('pwned')")),
    Attempt("write_tmp_outside_sandbox", fn("open(CANARY_DIR + '/new.txt', 'w')")),
    Attempt(
        "write_via_str_subclass",
        "class Path(str):\n    def startswith(self, *a):\n        return True\n"
        + fn("open(Path(CANARY_DIR + '/new.txt'), 'w')"),
    ),
    Attempt(
        "write_via_dir_fd",
        fn("fd = _os['open'](CANARY_DIR, 0)\n_os['open']('new.txt', 65, dir_fd=fd)"),
        walk=True,
    ),
    Attempt("symlink_out", fn("_os['symlink'](CANARY_DIR + '/canary.txt', 'link')"), walk=True),
    Attempt("chdir_out", fn("_os['chdir'](CANARY_DIR)\nopen('new.txt', 'w')"), walk=True),
    Attempt("fork_bomb", fn("while True:\n    _os['fork']()"), walk=True),
    Attempt(
        "memory_bomb",
        fn("hog = []\nwhile True:\n    hog.append(bytearray(64 << 20))"),
        match="MemoryError",
    ),
    Attempt("socket", "import socket\n" + fn("pass")),
    Attempt(
        "walk_socket", fn("_real_import('socket').create_connection(('1.1.1.1', 80))"), walk=True
    ),
    Attempt("ctypes", fn("_real_import('ctypes').CDLL(None).system(b'id')"), walk=True),
    Attempt(
        "cffi",
        fn("_real_import('cffi').FFI().dlopen(None)"),
        match=REFUSED + "|No module named 'cffi'",  # under bwrap, not even bound
        walk=True,
    ),
    Attempt(
        "host_env_via_os_environ",
        fn("return make_event('env', '/x', dict(_os['environ']))"),
        expect="contained",
        walk=True,
    ),
    Attempt(
        "host_env_via_proc",
        fn("return open('/proc/%d/environ' % _os['getppid'](), 'rb').read()"),
        walk=True,
    ),
    Attempt("infinite_loop", fn("while True:\n    pass"), expect="killed"),
    Attempt("sys_import", "import sys\n" + fn("sys.modules['os'].system('id')")),
    Attempt("sys_modules_walk", fn("_sys.modules['os'].system('id')"), walk=True),
    Attempt("getframe_globals", fn("return _sys._getframe().f_back.f_globals"), walk=True),
    Attempt(
        "generator_frame",
        "def gen():\n    yield 1\n" + fn("return gen().gi_frame.f_back.f_globals"),
    ),
    Attempt(
        "traceback_frame",
        fn(
            "try:\n    1 / 0\nexcept ZeroDivisionError as exc:\n"
            "    return exc.__traceback__.tb_frame.f_back.f_globals"
        ),
    ),
    Attempt("exec_missing", fn("exec('import os')")),
    Attempt("eval_missing", fn("eval('1')")),
    Attempt("compile_missing", fn("compile('1', 'x', 'eval')")),
    Attempt(
        "exec_with_forged_builtins",
        fn(
            "_real_builtins['exec'](\"__import__('os').system('id')\", "
            "{'__builtins__': _real_builtins})"
        ),
        walk=True,
    ),
    Attempt("pathlib", "import pathlib\n" + fn("pass")),
    Attempt("shutil", "import shutil\n" + fn("pass")),
    Attempt("signal", "import signal\n" + fn("pass")),
    Attempt("kill_host", fn("_os['kill'](_os['getppid'](), 9)"), walk=True),
    Attempt("pidfd_kill_host", fn("_os['pidfd_open'](_os['getppid']())"), walk=True),
    Attempt("threading", "import threading\n" + fn("pass")),
    Attempt("proc_self_mem", fn("open('/proc/self/mem', 'r+b')")),
    Attempt("addaudithook", fn("_sys.addaudithook(lambda *args: None)"), walk=True),
    Attempt("settrace", fn("_sys.settrace(lambda *args: None)"), walk=True),
    Attempt("gc_hunt", fn("return _real_import('gc').get_objects()"), walk=True),
    Attempt("breakpoint", fn("breakpoint()")),
    Attempt("pdb", "import pdb\n" + fn("pass")),
    Attempt(
        "loader_spec",
        "import json\n" + fn("json.__loader__.__class__.__init__.__globals__['_os'].system('id')"),
    ),
    Attempt("module_loader_name", fn("__loader__.load_module('os')")),
    Attempt("import_posixsubprocess", "import _posixsubprocess\n" + fn("pass")),
    Attempt("walk_posixsubprocess", fn("_real_import('_posixsubprocess')"), walk=True),
    Attempt("import_posix", "import posix\n" + fn("pass")),
    Attempt(
        "recreate_posix_module",
        fn(
            "spec = _sys.modules['importlib._bootstrap'].ModuleSpec('posix', None)\n"
            "_sys.modules['_imp'].create_builtin(spec)"
        ),
        walk=True,
    ),
    Attempt("forge_code_object", fn("(lambda: 0).__code__.replace(co_consts=(1,))")),
    Attempt(
        "raise_rlimit",
        fn("r = _sys.modules['resource']\nr.setrlimit(r.RLIMIT_AS, (-1, -1))"),
        walk=True,
    ),
    Attempt("subinterpreter", fn("_real_import('_xxsubinterpreters').create()"), walk=True),
    Attempt(
        "disable_hook_defaults",
        fn(
            "hook = _sys.modules['engines.python.sandbox'].audit_hook\n"
            "hook.__defaults__ = ((), frozenset(), (), ValueError)\n_os['system']('id')"
        ),
        walk=True,
    ),
    Attempt(
        "disable_hook_globals",
        fn(
            "box = _sys.modules['engines.python.sandbox']\n"
            "box.DENIED_EVENTS = frozenset()\nbox.DENIED_PREFIXES = ()\n"
            "box._on_open = lambda *a: None\n"
            "open(CANARY_DIR + '/canary.txt', 'w')"
        ),
        walk=True,
    ),
    Attempt(
        "load_own_native_code",
        fn(
            "open('evil.so', 'wb').write(b'\\x7fELF')\n"
            "m = _sys.modules['importlib.machinery']\n"
            "loader = m.ExtensionFileLoader('evil', 'evil.so')\n"
            "loader.create_module(m.ModuleSpec('evil', loader, origin='evil.so'))"
        ),
        walk=True,
    ),
]


@pytest.fixture(autouse=True)
def host_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WM_SECRET_CANARY", SECRET)


@pytest.fixture
def canary_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="wm-canary-") as directory:
        path = Path(directory)
        (path / "canary.txt").write_text(CANARY_TEXT)
        yield path


def attempt(item: Attempt, canary_dir: Path) -> tuple[str, BaseException | None]:
    """Run one attempt; (output text, error raised by the engine or None)."""
    engine = PythonEngine(Settings())
    worker = WorkerSpec(worker_id=f"escape-{item.name}", topic="escapes")
    try:
        engine.load(item.source(str(canary_dir)), worker)
        outputs = engine.process(make_event("escape", "/tests"), timeout_s=1.5)
        return repr([(o.get_attributes(), o.get_data()) for o in outputs]), None
    except (InvalidCode, WorkerExecutionError) as exc:
        return "", exc
    finally:
        engine.close()


@pytest.mark.parametrize("item", ATTEMPTS, ids=[a.name for a in ATTEMPTS])
def test_escape_attempt_fails_and_host_stays_healthy(item: Attempt, canary_dir: Path) -> None:
    before = child_pids()

    output, error = attempt(item, canary_dir)

    if item.expect == "killed":
        assert isinstance(error, WorkerTimeout), error
    elif item.expect == "refused":
        assert error is not None and not isinstance(error, WorkerTimeout), output
        assert re.search(item.match, str(error)), str(error)
    else:
        assert error is None, error
        assert "WM_SECRET_CANARY" not in output
    assert SECRET not in output + str(error or "") + getattr(error, "traceback", "")
    assert sorted(p.name for p in canary_dir.iterdir()) == ["canary.txt"]
    assert (canary_dir / "canary.txt").read_text() == CANARY_TEXT
    assert child_pids() <= before
    assert os.environ["WM_SECRET_CANARY"] == SECRET


def test_the_corpus_is_large_enough() -> None:
    assert len(ATTEMPTS) >= 25
    assert len({a.name for a in ATTEMPTS}) == len(ATTEMPTS)


def test_allowed_work_still_works_under_the_hook(canary_dir: Path) -> None:
    body = (
        "import collections, dataclasses, enum, typing, json, re, decimal, random\n"
        "from wm.devkit import make_event\n"
        "Point = collections.namedtuple('Point', 'x y')\n"
        "@dataclasses.dataclass\nclass Box:\n    size: int = 3\n"
        "T = typing.TypeVar('T')\n"
        + fn(
            "Color = enum.Enum('Color', 'red green')\n"
            "open('scratch.txt', 'w').write(json.dumps([Point(1, 2).x, Box().size]))\n"
            "kept = json.loads(open('scratch.txt').read())\n"
            "return make_event('fine', '/x', {'kept': kept, 'color': Color.red.name,\n"
            "    'match': bool(re.match('a+', 'aaa')), 'dec': str(decimal.Decimal('1.5')),\n"
            "    'rand': 0 <= random.random() < 1})"
        )
    )
    output, error = attempt(Attempt("allowed", body), canary_dir)

    assert error is None, getattr(error, "traceback", error)
    assert "'kept': [1, 3]" in output and "'color': 'red'" in output and "'rand': True" in output


@pytest.mark.parametrize("function", sandbox.HOOK_FUNCTIONS, ids=lambda f: f.__name__)
def test_hook_functions_depend_on_nothing_mutable(function: object) -> None:
    """No globals, no builtins, no closure cells: rebinding a name cannot change the hook."""
    code = sandbox.code_of(function)  # type: ignore[arg-type]
    names = {i.opname for i in dis.get_instructions(code)}

    assert not names & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLOSURE", "STORE_GLOBAL"}
    assert getattr(function, "__closure__", None) is None
    assert getattr(function, "__kwdefaults__", None) is None


# --- layers, as the host sees the child ---------------------------------------------------


@pytest.fixture
def engine() -> Iterator[PythonEngine]:
    before = child_pids()
    instance = PythonEngine(Settings())
    yield instance
    instance.close()
    assert child_pids() <= before


def spec(**overrides: Any) -> WorkerSpec:
    return WorkerSpec(worker_id="w-layers", topic="layers", **overrides)


def event() -> CloudEvent:
    return make_event("layers", "/tests")


def proc_limits(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/limits", encoding="utf-8") as handle:
        rows = handle.read().splitlines()[1:]
    return {row[:26].strip(): row[26:47].strip() for row in rows}


def test_child_runs_with_rlimits_empty_env_own_session_and_temp_cwd(engine: PythonEngine) -> None:
    engine.load(code("echo"), spec(settings={"memory_mb": 256}))
    pid = engine.pid
    assert pid is not None

    limits = proc_limits(pid)
    with open(f"/proc/{pid}/environ", "rb") as handle:
        environ = handle.read()

    assert limits["Max address space"] == str(256 * 1024 * 1024)
    assert limits["Max open files"] == "64"
    assert limits["Max file size"] == str(16 * 1024 * 1024)
    assert limits["Max processes"] == "0"
    assert limits["Max cpu time"] == "300"
    cwd = os.readlink(f"/proc/{pid}/cwd")
    assert environ in (b"", f"PWD={cwd}\0".encode())  # bwrap sets PWD to the child's cwd
    assert os.getsid(pid) != os.getsid(0)  # its own session (under bwrap: bwrap's, which
    assert os.getpgid(pid) == os.getsid(pid)  # the host's killpg reaches)
    assert os.path.basename(os.readlink(f"/proc/{pid}/cwd")).startswith("wm-py-")


def test_child_runs_isolated_interpreter(engine: PythonEngine) -> None:
    engine.load(code("echo"), spec())
    pid = engine.pid
    assert pid is not None

    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        argv = handle.read().split(b"\0")

    assert argv[1:4] == [b"-I", b"-S", b"-B"]
    assert argv[4].endswith(b"engines/python/bootstrap.py")


def test_network_namespace_when_permitted(engine: PythonEngine) -> None:
    if "network namespace" not in engine.isolation_layers:
        pytest.skip("this host does not permit network namespaces")
    engine.load(code("echo"), spec())

    assert os.readlink(f"/proc/{engine.pid}/ns/net") != os.readlink("/proc/self/ns/net")


def test_no_capabilities_when_permitted(engine: PythonEngine) -> None:
    if "no capabilities" not in engine.isolation_layers:
        pytest.skip("this host does not permit dropping capabilities")
    engine.load(code("echo"), spec())

    with open(f"/proc/{engine.pid}/status", encoding="utf-8") as handle:
        status = dict(line.split(":\t", 1) for line in handle.read().splitlines())

    assert int(status["CapEff"], 16) == 0
    assert int(status["CapBnd"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1"


def test_without_kernel_layers_the_audit_hook_still_refuses_sockets(
    engine: PythonEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engines.python import isolation

    monkeypatch.setattr(isolation, "kernel_isolation", lambda: isolation.Isolation((), ()))
    source = (
        b"def find(name):\n"
        b"    return [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == name][0]\n"
        b"def process(event):\n"
        b"    real = find('_wrap_close').__init__.__globals__['__builtins__']\n"
        b"    real['__import__']('socket').create_connection(('127.0.0.1', 9))\n"
    )
    engine.load(source, spec())

    assert os.readlink(f"/proc/{engine.pid}/ns/net") == os.readlink("/proc/self/ns/net")
    with pytest.raises(WorkerExecutionError, match="_socket is not allowed"):
        engine.process(event(), timeout_s=5)


# --- import guard: allowed packages ---------------------------------------------------

NUMPY_AND_YAML = (
    b"import numpy\nimport yaml\nfrom wm.devkit import make_event\n"
    b"def process(event):\n"
    b"    total = int(numpy.arange(event.get_data()).sum())\n"
    b"    return make_event('calc', '/w', {'total': total, 'doc': yaml.safe_load('a: [1, 2]')})\n"
)


def test_packages_allowed_by_settings_import() -> None:
    settings = Settings()
    allowed = (*settings.python_allowed_packages, "numpy", "yaml")
    configured = PythonEngine(settings.replace(python_allowed_packages=allowed))
    try:
        configured.load(NUMPY_AND_YAML, spec())
        [output] = configured.process(make_event("calc", "/tests", 10), timeout_s=10)
    finally:
        configured.close()

    assert output.get_data() == {"total": 45, "doc": {"a": [1, 2]}}


def test_unlisted_package_names_the_setting(engine: PythonEngine) -> None:
    with pytest.raises(InvalidCode) as caught:
        engine.load(NUMPY_AND_YAML, spec())

    assert "import of 'numpy' is not allowed" in str(caught.value)
    assert "PYTHON_ALLOWED_PACKAGES" in str(caught.value)


def test_no_worker_code_runs_at_interpreter_exit(canary_dir: Path) -> None:
    """CPython drops audit hooks before freeing what ``sys`` holds; the child skips that phase.

    The planted finalizer would first mark its own (writable) directory, then try the canary.
    """
    body = fn("raise SystemExit(0)").replace(
        "def process",
        "class Bomb:\n"
        "    def __del__(self, open_=_os['open']):\n"
        "        open_('finalized', 0o101)\n"
        "        open_(CANARY_DIR + '/after-exit', 0o101)\n"
        "_sys.planted = Bomb()\n"
        "def process",
    )
    engine = PythonEngine(Settings())
    try:
        engine.load(Attempt("exit", body, walk=True).source(str(canary_dir)), spec())
        child = engine._process  # white box: let the child exit on its own before the kill
        assert child is not None
        call = event_body(make_event("exit", "/tests"))
        kind, reply = child.request(frames.CALL, call, time.monotonic() + 5)
        assert kind == frames.FAILED and reply["fatal"]
        deadline = time.monotonic() + 5
        while not child.exited and time.monotonic() < deadline:
            time.sleep(0.02)
        assert child.exited
        assert not os.path.exists(os.path.join(child.directory, "finalized"))
    finally:
        engine.close()

    assert sorted(p.name for p in canary_dir.iterdir()) == ["canary.txt"]
