"""The kernel layers alone hold: escape probes with the audit hook and import guard **off**.

``tests/kernel_only_probe.py`` runs a worker with ``os``, ``ctypes``, ``socket`` and
``subprocess`` importable and no in-process layer, as root and as an unprivileged user
(``setpriv`` to nobody). Every probe must fail; only the control (writing its own tmpfs)
succeeds. Needs bubblewrap with user namespaces, and pyseccomp with libseccomp: skipped
locally without them, failed in CI (``need``).

The limit layers below them hold too: a fork bomb and a memory bomb, with every setting at
its default, stop at the sandbox's own cgroups (needs writable cgroup memory and pids
hierarchies: as root, or in a delegated cgroup v2 subtree).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from typing import Any

import pytest

import wm  # noqa: F401 - the platform before engines
from engines.childproc import limits
from engines.python import isolation
from engines.python.engine import PythonEngine
from tests.conftest import need
from tests.kernel_only_probe import KernelOnlyEngine
from wm.config import Settings
from wm.engine import WorkerSpec
from wm.events import make_event

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_only_probe.py")
ROOT = os.path.dirname(os.path.dirname(PROBE))
#: seconds one probe run may take (two sandbox starts and a dozen probes).
RUN_TIMEOUT_S = 120
#: uid/gid of the unprivileged run.
NOBODY = 65534
#: MiB each child of the memory bomb fills, and how many it starts (the finding's figures).
BOMB_CHILD_MB, BOMB_CHILDREN = 300, 6
#: Forks the fork bomb tries: far over the default process limit.
BOMB_FORKS = 500

#: Bombs run with the in-process layers off. The fork bomb keeps every child it makes alive
#: until it cannot make another (then ends them); the memory bomb's children each fill
#: BOMB_CHILD_MB together, and are reported by exit status (-9: the OOM killer's SIGKILL).
BOMBS = f"""
import os, time
from wm.devkit import make_event


def fork_bomb():
    children, refused = [], None
    for _ in range({BOMB_FORKS}):
        try:
            pid = os.fork()
        except OSError as exc:
            refused = type(exc).__name__
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return {{"forked": len(children), "refused": refused}}


def memory_bomb():
    children = []
    for _ in range({BOMB_CHILDREN}):
        pid = os.fork()
        if pid == 0:
            block = b"x" * ({BOMB_CHILD_MB} << 20)
            time.sleep(5)
            os._exit(0)
        children.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]


def process(event):
    return make_event("bombs", "/kernel-only", {{"fork": fork_bomb(), "memory": memory_bomb()}})
"""


@pytest.fixture(scope="module")
def bwrap_layers() -> tuple[str, ...]:
    layers = isolation.kernel_isolation().layers
    missing = [name for name in isolation.WANTED_LAYERS if name not in layers]
    if missing:
        need("the bubblewrap and seccomp sandbox layers", RuntimeError(f"missing {missing}"))
    return layers


@pytest.fixture
def ports() -> Iterator[tuple[int, int]]:
    """(a port with a listener, a port with none) on 127.0.0.1."""
    with socket.socket() as listener, socket.socket() as spare:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        spare.bind(("127.0.0.1", 0))
        unused = spare.getsockname()[1]
        spare.close()
        yield listener.getsockname()[1], unused


def _run(prefix: list[str], python: str, ports: tuple[int, int], env: dict[str, str]) -> Any:
    argv = [*prefix, python, PROBE, str(os.getpid()), *map(str, ports)]
    done = subprocess.run(
        argv, cwd="/", env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(result: Any) -> None:
    probes = dict(result["probes"])
    assert probes.pop("control: write own directory").startswith("ESCAPED"), probes
    escaped = {name: out for name, out in probes.items() if not out.startswith("blocked")}
    assert not escaped
    assert set(isolation.WANTED_LAYERS) <= set(result["layers"])


def test_kernel_layers_alone_stop_escapes_as_root(
    bwrap_layers: tuple[str, ...], ports: tuple[int, int]
) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": ROOT}
    _check(_run([], sys.executable, ports, env))


def _unprivileged_python() -> tuple[str, str]:
    """(interpreter, PYTHONPATH) that nobody can run: ours, or the system one of the same
    version with our site-packages (a home directory may be closed to other users)."""
    site = sysconfig.get_paths()["purelib"]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [
        os.path.realpath(sys.executable),
        f"/usr/bin/{version}",
        f"/usr/local/bin/{version}",
    ]
    prefix = _setpriv()
    for python in filter(None, candidates):
        path = f"{ROOT}:{site}"
        check = "import wm, cloudevents, pyseccomp, subprocess as s, sys; s.run([sys.executable"
        probe = [*prefix, python, "-c", check + ", '-I', '-S', '-c', ''], check=True)"]
        done = subprocess.run(
            probe, cwd="/", env={"PYTHONPATH": path}, capture_output=True, timeout=30, check=False
        )
        if done.returncode == 0:
            return python, path
    pytest.fail(f"no interpreter among {candidates} runs the project as uid {NOBODY}")


def _setpriv() -> list[str]:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        need("setpriv (util-linux)", FileNotFoundError("setpriv"))
    return [str(setpriv), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


def test_kernel_layers_alone_stop_escapes_as_an_unprivileged_user(
    bwrap_layers: tuple[str, ...], ports: tuple[int, int]
) -> None:
    if os.geteuid() != 0:
        _check(_run([], sys.executable, ports, {"PYTHONPATH": ROOT}))
        return
    site = sysconfig.get_paths()["purelib"]
    with _traversable([ROOT, site, os.path.realpath(sys.executable)]):
        python, path = _unprivileged_python()
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "HOME": "/tmp"}
        _check(_run(_setpriv(), python, ports, env))


@contextlib.contextmanager
def _traversable(paths: list[str]) -> Iterator[None]:
    """Let other users pass through the folders above ``paths`` for the test's duration: a
    clone in ``mktemp -d`` (mode 0700) or under ``/root`` is closed to uid nobody. Only the
    search bit is added, and every mode is restored afterwards."""
    opened: dict[str, int] = {}
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        while folder not in opened and folder != "/":
            mode = os.stat(folder).st_mode
            if not mode & stat.S_IXOTH:
                opened[folder] = mode
                os.chmod(folder, stat.S_IMODE(mode) | stat.S_IXOTH)
            folder = os.path.dirname(folder)
    try:
        yield
    finally:
        for folder, mode in opened.items():
            os.chmod(folder, stat.S_IMODE(mode))


def test_a_fork_bomb_and_a_memory_bomb_stop_at_the_sandbox_limits_by_default() -> None:
    """Finding 6: past the audit hook, 115 processes and six 300 MiB children (over 1.5 GiB)
    ran, stopped only by an outer cgroup. Now the sandbox's own cgroups stop both."""
    defaults = Settings.from_env({})
    found = {h.controller for h in limits.placement()}
    if found != set(limits.CONTROLLERS):
        need("writable cgroup memory and pids hierarchies", RuntimeError(f"found {found}"))
    layers = PythonEngine.host_facts(defaults)["limit_layers"]
    assert {"memory", "pids"} <= {name.rsplit(" ", 1)[1] for name in layers}, layers
    engine = KernelOnlyEngine(defaults)
    try:
        engine.load(BOMBS.encode(), WorkerSpec(worker_id="w-bombs", topic="bombs"))
        [reply] = engine.process(make_event("bomb", "/tests"), timeout_s=120)
        fork, memory = reply.get_data()["fork"], reply.get_data()["memory"]
        assert fork["refused"] == "BlockingIOError"  # EAGAIN: the pids limit
        assert fork["forked"] < defaults.sandbox_max_processes
        survivors = memory.count(0)
        assert memory.count(-9) >= 1 and set(memory) <= {0, -9}, memory
        assert survivors * BOMB_CHILD_MB <= defaults.sandbox_memory_mb
        [again] = engine.process(make_event("bomb", "/tests"), timeout_s=120)
        assert again.get_data()["fork"]["refused"] == "BlockingIOError"  # the sandbox lives
    finally:
        engine.close()
