"""The kernel layers alone hold: escape probes with the audit hook and import guard **off**.

``tests/kernel_only_probe.py`` runs a worker with ``os``, ``ctypes``, ``socket`` and
``subprocess`` importable and no in-process layer, as root and as an unprivileged user
(``setpriv`` to nobody). Every probe must fail; only the control (writing its own tmpfs)
succeeds. Needs bubblewrap with user namespaces, and pyseccomp with libseccomp: skipped
locally without them, failed in CI (``need``).
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
from engines.python import isolation
from tests.conftest import need

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_only_probe.py")
ROOT = os.path.dirname(os.path.dirname(PROBE))
#: seconds one probe run may take (two sandbox starts and a dozen probes).
RUN_TIMEOUT_S = 120
#: uid/gid of the unprivileged run.
NOBODY = 65534


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
